"""Fixtures of the serving tests: tiny models on disk and a stand-in driver that stops what it started."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline.config import DrafterConfig
from pipeline.models.checkpoint import save_drafter
from pipeline.models.drafter import fresh_drafter
from pipeline.serving.drivers import ReplicaSpec, Speculation, StandInDriver
from tests.support.targets import tiny_target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny target (and the next policy, `target2`) and two EAGLE-1/2 drafter checkpoints (v1, v2) plus a
    broken one."""
    root = tmp_path_factory.mktemp("models")
    target = tiny_target(32, 32, 2, 2)
    target.save_pretrained(root / "target", safe_serialization=True)
    tiny_target(32, 32, 2, 2, seed=1).save_pretrained(root / "target2", safe_serialization=True)
    out = {"target": (root / "target").as_uri(), "target2": (root / "target2").as_uri()}
    for version, seed in (("v1", 1), ("v2", 2)):
        drafter = fresh_drafter(DrafterConfig(kind="eagle"), target, torch.arange(32), seed)
        out[version] = str(save_drafter(drafter, root / version))
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{}")
    out["broken"] = str(root / "broken")
    return out


ALWAYS = Speculation(max_batch=256)  # every round speculates: what a replica counts is what decoding alone counts


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[StandInDriver]:
    d = StandInDriver(k=3, state_dir=tmp_path / "fleet", speculation=ALWAYS)
    yield d
    d.stop_all([ReplicaSpec(name, "", 0) for name in list(d.processes)])
