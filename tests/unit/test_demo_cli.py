"""`cli.py demo --fleet vllm`: the toy demo on vLLM replicas takes configs/vllm.yaml, and is refused where that
cannot serve (a source whose policy vLLM's CPU attention cannot run, or a --config of the user's own)."""

from __future__ import annotations

import pytest

import cli
from pipeline.config import load_config


def test_the_vllm_fleets_config_serves_the_simulated_target_on_vllm() -> None:
    cfg = load_config(str(cli.VLLM_CONFIG))
    assert cfg.fleet.driver == "vllm"
    assert cfg.simulation.hidden_size // cfg.simulation.num_heads >= 32  # vLLM's CPU attention: head size 32 and up
    assert cfg.fleet.vllm.dtype == "float32"  # as the product's own count, which the deploy's gate compares
    assert len({r.port for r in cfg.fleet.replicas}) == len(cfg.fleet.replicas)


@pytest.mark.parametrize(("argv", "why"), [
    (["demo", "--fleet", "vllm", "--source", "trl"], "16-wide attention heads"),
    (["--config", "mine.yaml", "demo", "--fleet", "vllm"], "merge its keys into your --config"),
])
def test_a_vllm_fleet_it_cannot_serve_is_refused(argv: list[str], why: str, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.CONFIG_ENV, "")  # main() sets it from --config: put back at teardown
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert why in capsys.readouterr().err
