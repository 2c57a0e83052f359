"""The demo: a source of RL steps run against the pipeline as a deployment runs it, in one process that does what
the Dagster daemon would (`daemon.py`), and the report it ends with (`report.py`); `run.py` is `cli.py demo` and
`cli.py compare-schedules`."""
