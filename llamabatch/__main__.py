"""`python -m llamabatch`: the same command line as `llamabatch`."""

from .cli import main

main()
