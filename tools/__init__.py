"""The reproducible benchmarks of this repository and the studies beside them: `python -m tools` lists them,
`python -m tools NAME [ARGS]` runs one (tools/harness.py: the registry, the timer, the table writer)."""
