"""llamabatch's benchmarks: `python -m benchmarks --list`, `python -m benchmarks NAME [--smoke]`,
`python -m benchmarks report`. One harness (harness.py) for all of them; every run writes its
figures, with the machine it ran on, to a JSON file, and the docs' tables are made from those."""
