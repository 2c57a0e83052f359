"""Each supported policy family through rl_step_job, published as an external trainer publishes it.

For every family of tests/support/families.py (a tiny random policy, sharded safetensors, non-zero
biases and norms) and both drafter kinds: the trainer client publishes two RL steps (the second
policy an update of the first), rl_step_job runs both on a test instance (the second trains, on the
buffer of both), and then

* the stored hidden states are a plain transformers forward of the step's policy, layer by layer,
  to within bf16 rounding (the storage dtype);
* the registered drafter's export round-trips: reloaded and exported again, the same config and tensors;
* speculative decoding with that drafter against the step's policy equals greedy decoding, token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
import torch
from safetensors.torch import load_file

from definitions import build_definitions
from pipeline.client import Rollout, publish_checkpoint, publish_step
from pipeline.config import PipelineConfig, load_config
from pipeline.data import shards
from pipeline.data.held_out import held_out_prompts
from pipeline.data.rollouts import read_policy_pointer
from pipeline.data.store import open_store
from pipeline.evaluation.speculative import follow_target, generate_batch, greedy_generate
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.models.checkpoint import load_drafter, save_drafter
from pipeline.registry import DrafterRegistry
from tests.support.config import write_config
from tests.support.families import FAMILIES, LAYERS, SHARD, V, random_model

ROLLOUTS, PROMPT, RESPONSE = 24, 6, 14  # RESPONSE + PROMPT > Mistral's sliding window of 4


def _publish(cfg: PipelineConfig, policy: torch.nn.Module, step: int, staging: Path) -> None:
    """What the trainer does after step `step`: its rollouts and the policy that wrote them."""
    g = torch.Generator().manual_seed(step)
    rollouts = [
        Rollout.from_prompt_and_response(f"s{step}-{i}", torch.randint(0, V, (PROMPT,), generator=g).tolist(),
                                         torch.randint(0, V, (RESPONSE,), generator=g).tolist(), 0.5,
                                         policy_version=step - 1)
        for i in range(ROLLOUTS)
    ]
    staged = publish_checkpoint(policy, staging / f"step-{step}", max_shard_size=SHARD)
    assert len(staged.files) > 3  # config, index, several shards
    publish_step(cfg.storage_root, cfg.run, step, rollouts, staged, policy_version=step - 1,
                 model_id="tiny-policy")


def _updated(policy: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return policy


def _expected_states(policy: torch.nn.Module, ids: torch.Tensor, kind: str) -> dict[int, torch.Tensor]:
    """transformers' own forward of one sample, as the drafter kind stores it: EAGLE-3 the residual
    stream entering each decoder layer (ids 0..L-1) and the last layer's output before the final norm
    (id L); EAGLE-1/2 the post-norm last layer, what the lm_head reads."""
    caught = []
    hook = policy.model.norm.register_forward_pre_hook(lambda _, args: caught.append(args[0]))
    try:
        with torch.no_grad():
            out = policy(ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    if kind == "eagle":
        return {LAYERS: out.hidden_states[LAYERS][0]}
    return {**{k: out.hidden_states[k][0] for k in range(LAYERS)}, LAYERS: caught[0][0]}  # (T, H) each


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("family", FAMILIES)
def test_two_published_steps_of_each_family_through_rl_step_job(tmp_path: Path, family: str, kind: str) -> None:
    config_path = write_config(tmp_path, {
        "run": f"{family}-{kind}", "rollout_source": "external", "drafter": {"kind": kind},
        # Step 2 trains, on the buffer of both steps' samples (a training process costs seconds of start-up).
        "train": {"training_interval_steps": 2, "epochs": 1},
    }, pretrained=False)
    cfg = load_config(config_path)
    policy = random_model(family)
    _publish(cfg, policy, 1, tmp_path / "staging")
    _publish(cfg, _updated(policy), 2, tmp_path / "staging")

    job = build_definitions(str(config_path)).resolve_job_def("rl_step_job")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("rl_step", ["step-000001", "step-000002"])
        for key in ("step-000001", "step-000002"):
            result = job.execute_in_process(instance=instance, partition_key=key, raise_on_error=False)
            failures = [str(e.step_failure_data.error) for e in result.all_events if e.is_step_failure]
            assert result.success, failures

    store = open_store(cfg)
    manifest = shards.read_manifest(store, cfg.run, 2)
    assert manifest.layer_ids[-1] == LAYERS
    assert len(set(manifest.layer_ids)) == len(manifest.layer_ids)  # each layer stored once
    samples = list(shards.iter_samples(store, cfg.run, manifest))
    assert samples
    for sample in samples[:4]:
        expected = _expected_states(policy, sample.input_ids, kind)
        for j, layer in enumerate(manifest.layer_ids):
            reference = expected[layer].to(torch.bfloat16).float()  # (T, H) at storage precision
            torch.testing.assert_close(sample.hidden[:, j].float(), reference, rtol=2**-7, atol=1e-5,
                                       msg=lambda m, where=f"{sample.sample_id} layer {layer}": f"{where}: {m}")

    registry = DrafterRegistry(cfg.tracking_uri, cfg.mlflow.experiment, cfg.mlflow.model_name)
    version = registry.alias_version("champion")
    assert version is not None
    exported = registry.download(version, tmp_path / "exported")
    drafter = load_drafter(exported, LAYERS)
    assert drafter.kind == kind
    again = save_drafter(drafter, tmp_path / "again", target_forward.TargetMetadata.of(policy.config))
    assert json.loads((again / "config.json").read_text()) == json.loads((exported / "config.json").read_text())
    original, round_tripped = load_file(exported / "model.safetensors"), load_file(again / "model.safetensors")
    assert original.keys() == round_tripped.keys()
    assert all(torch.equal(original[k], round_tripped[k]) for k in original)

    served = target_lib.load_policy(store, read_policy_pointer(store, cfg.run, 2).checkpoint_uri)
    drafter.attach(served)
    prompts = held_out_prompts(store, cfg, 2)
    traces = generate_batch(served, follow_target(drafter, served), prompts, 12, cfg.eval.num_speculative_tokens)
    assert [t.tokens for t in traces] == [greedy_generate(served, p, 12) for p in prompts]
