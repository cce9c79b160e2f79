"""One-file CLIs, run from the repository root as `python -m tools.NAME` (see each docstring)."""
