"""`python -m llamabatch.cli`: the same command line as `llamabatch`."""

from . import main

main()
