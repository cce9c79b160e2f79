"""One folder per experiment; runners go from the repository root: `python -m experiments.NAME.run`."""
