"""Benchmarks (`make bench`, or one at a time with `python -m benchmarks.NAME`)."""

import os

# The benchmarks register and load drafters through MLflow: its per-download progress bars would bury the figures.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
