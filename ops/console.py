"""What the commands and the demo print, and the libraries' output they silence."""

from __future__ import annotations

import logging
import os
import sys
import warnings


def out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def quiet_libraries() -> None:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    import mlflow  # noqa: F401  (imported first: it configures its loggers on import)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    for name in ("mlflow", "alembic", "dagster"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Deprecation notices of the libraries (transformers 5 renames `past_key_values`) would print into the
    # progress bar; they are for this project's developers, who see them in the tests' output.
    warnings.filterwarnings("ignore", category=FutureWarning)
