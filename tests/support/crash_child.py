"""A step's work in a process that SIGKILLs itself at a named point: the crash half of the fault tests.

    python -m tests.support.crash_child <work> <config.yaml> <step> [version]

work:
    hidden_states   extract the step's hidden states; killed halfway through writing the first shard
    train_unregistered  train the step's drafter; killed after logging the checkpoint, before the version exists
    train_registered    the same, killed right after the model version is created (aliases not yet set)
    deploy          roll `version` out; killed once the first replica passed its gates, before the next

The kill points are installed here, by wrapping the product's own functions in this process only:
the product has no crash hook. The process dies by SIGKILL (no cleanup, no finally blocks).
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_halfway_through_first_shard() -> None:
    from pipeline.data.store import ObjectStore

    original = ObjectStore.open_write

    class HalfThenDie:
        def __init__(self, f) -> None:
            self.f = f

        def write(self, data: bytes) -> None:
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            os.fsync(self.f.fileno())
            _die()

    @contextmanager
    def open_write(self: ObjectStore, key: str):
        with original(self, key) as f:
            yield HalfThenDie(f) if key.endswith(".arrow") else f

    ObjectStore.open_write = open_write


def _kill_around_create_model_version(after: bool) -> None:
    from mlflow.tracking import MlflowClient

    original = MlflowClient.create_model_version

    def create_model_version(self: MlflowClient, *args, **kwargs):
        if not after:
            _die()
        result = original(self, *args, **kwargs)
        _die()
        return result

    MlflowClient.create_model_version = create_model_version


def _kill_after_first_replica() -> None:
    from pipeline.serving import fleet

    original = fleet.check_replica

    def check_replica(*args, **kwargs) -> float:
        tau = original(*args, **kwargs)
        _die()
        return tau

    fleet.check_replica = check_replica


def main(work: str, config_path: str, step: int, version: str = "") -> None:
    from pipeline.config import load_config
    from pipeline.data.store import open_store

    cfg = load_config(config_path)
    store = open_store(cfg)
    if work == "hidden_states":
        from pipeline.sources import extract

        _kill_halfway_through_first_shard()
        extract.extract_hidden_states(store, cfg, step)
    elif work.startswith("train_"):
        from pipeline.registry import DrafterRegistry
        from pipeline.training import cotrain

        _kill_around_create_model_version(after=work == "train_registered")
        registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
        cotrain.train_step(store, cfg, step, registry, {"rl_step": f"step-{step:06d}", "attempt": "killed"})
    elif work == "deploy":
        from pipeline.registry import DrafterRegistry
        from pipeline.serving import deploy

        _kill_after_first_replica()
        registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
        deploy.deploy(cfg, store, registry, version)
    else:
        raise SystemExit(f"unknown work {work!r}")
    raise SystemExit(f"{work}: finished without reaching its kill point")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
