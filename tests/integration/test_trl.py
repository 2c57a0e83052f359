"""TRL's GRPOTrainer (from PyPI, on CPU) publishing through the trainer client into the pipeline."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import dagster as dg
import pytest
import torch

from definitions import build_definitions
from jobs.sensors import SENSOR_NAME, rl_step_sensor
from pipeline.config import load_config
from pipeline.data import parts as parts_lib
from pipeline.data import shards
from pipeline.data.held_out import training_rollouts
from pipeline.data.rollouts import read_policy_pointer, read_rollouts
from pipeline.data.store import open_store
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.sources import trl as trl_source
from pipeline.sources.simulation import part_of
from tests.support.config import write_config

STEPS = 3
SETTINGS = trl_source.GRPODemoSettings(prompts_per_step=4, num_generations=6, max_completion_length=10)


def recording_trainer_class() -> type:
    """The demo's trainer, also keeping each generation batch as TRL holds it (padded tensors) and TRL's
    own per-token log-probabilities of the completions under the weights that generated them."""

    class Recording(trl_source._grpo_trainer_class()):
        batches: list[dict] = []

        def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
            out = super()._generate_and_score_completions(inputs)
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)  # (B, P + C) left/right padded
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            with torch.no_grad():  # TRL's model, padded as TRL pads it, before the optimizer step
                logits = self.model(input_ids=ids, attention_mask=mask).logits  # (B, P + C, V)
            self.batches.append({k: out[k].clone() for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                              "completion_mask")} | {"logits": logits.clone()})
            return out

    return Recording


def _in_trl_order(rows: list, pub: trl_source.PublishedGRPOStep) -> list:
    """A committed step's rollouts (in part order) in the order of TRL's generation batch."""
    order = {r.sample_id: i for i, r in enumerate(pub.rollouts)}
    return sorted(rows, key=lambda r: order[r.sample_id])


@pytest.mark.slow
def test_grpo_steps_through_the_pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_path = write_config(tmp_path, {"fleet": {"driver": "none"}}, pretrained=False)
    cfg = load_config(config_path)
    store = open_store(cfg)
    recorder = recording_trainer_class()
    monkeypatch.setattr(trl_source, "_grpo_trainer_class", lambda: recorder)  # the demo builds this class
    demo = trl_source.GRPODemo(store, cfg.run, STEPS, tmp_path / "trl", SETTINGS)
    tokenizer = demo.tokenizer
    published = [demo.run_step(step) for step in range(1, STEPS + 1)]
    history = demo.finish()

    # The committed rollouts are TRL's own: its token ids (padding stripped by its masks) and its rewards.
    logged = {h["step"]: h["reward"] for h in history if "reward" in h}
    assert len(recorder.batches) == STEPS
    for step, batch, pub in zip(range(1, STEPS + 1), recorder.batches, published, strict=True):
        # Published in parts as the completions finish (shortest first), then committed: the commit lists them.
        committed = read_rollouts(store, cfg.run, step)
        assert len(pub.parts) > 1
        assert parts_lib.committed_part_numbers(store, cfg.run, step) == list(pub.parts)
        lengths = [sum(r.loss_mask) for r in committed]
        slices = [part_of(n, max(lengths), SETTINGS.parts_per_step) for n in lengths]
        assert slices == sorted(slices)
        assert slices[0] < slices[-1]
        rows = _in_trl_order(committed, pub)
        assert [r.sample_id for r in rows] == [r.sample_id for r in pub.rollouts]
        for i, r in enumerate(rows):
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
            completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
            assert r.input_ids == prompt + completion
            assert r.loss_mask == [0] * len(prompt) + [1] * len(completion)
            assert r.policy_version == step - 1
        assert read_policy_pointer(store, cfg.run, step).policy_version == step - 1
        assert sum(r.reward for r in rows) / len(rows) == pytest.approx(logged[step], abs=1e-6)
        assert pub.mean_reward == pytest.approx(logged[step], abs=1e-6)

    first = read_rollouts(store, cfg.run, 1)
    # Prompts of different lengths were left-padded inside TRL; none of that padding is committed.
    assert len({r.prompt_len for r in first}) > 1
    assert (recorder.batches[0]["prompt_mask"] == 0).any()
    # Completions end with EOS (kept as response) or are truncated at the length limit.
    ends = Counter("eos" if r.input_ids[-1] == tokenizer.eos_token_id else "cut" for r in first)
    assert ends["eos"] > 0
    assert ends["cut"] > 0
    assert all(len(r.input_ids) - r.prompt_len == SETTINGS.max_completion_length
               for r in first if r.input_ids[-1] != tokenizer.eos_token_id)

    # The step's checkpoint reproduces TRL's logits for the completions it generated (unpadded here, padded there).
    for step, batch, pub in zip(range(1, STEPS + 1), recorder.batches, published, strict=True):
        policy = target_lib.load_policy(store, read_policy_pointer(store, cfg.run, step).checkpoint_uri)
        real = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1).bool()  # (B, P + C)
        for i, r in enumerate(_in_trl_order(read_rollouts(store, cfg.run, step), pub)):
            logits = target_forward.forward(policy, torch.tensor([r.input_ids])).logits[0]  # (T, V)
            torch.testing.assert_close(logits, batch["logits"][i][real[i]], atol=1e-4, rtol=1e-4)

    # Through the pipeline: the sensor sees the three steps, each runs as a Dagster run.
    defs = build_definitions(str(config_path))
    job = defs.resolve_job_def("rl_step_job")
    with dg.instance_for_test() as instance:
        result = rl_step_sensor(dg.build_sensor_context(instance=instance, sensor_name=SENSOR_NAME,
                                                        definitions=defs, resources=defs.resources))
        assert [r.partition_key for r in result.run_requests] == ["step-000001", "step-000002", "step-000003"]
        instance.add_dynamic_partitions("rl_step", [r.partition_key for r in result.run_requests])
        for request in result.run_requests:
            assert job.execute_in_process(instance=instance, partition_key=request.partition_key).success

    # Identical completions of a group keep their own sample ids and all reach the shards; no pad id does.
    twins = []
    for step in range(1, STEPS + 1):
        rows = read_rollouts(store, cfg.run, step)
        train = {r.sample_id for r in training_rollouts(rows, cfg.eval.held_out_fraction)}
        stored = list(shards.iter_samples(store, cfg.run, shards.read_manifest(store, cfg.run, step)))
        assert sorted(s.sample_id for s in stored) == sorted(train)
        assert all(tokenizer.pad_token_id not in s.input_ids.tolist() for s in stored)
        by_tokens: dict[tuple[int, ...], list[str]] = {}
        for r in rows:
            if r.sample_id in train:
                by_tokens.setdefault(tuple(r.input_ids), []).append(r.sample_id)
        twins += [ids for ids in by_tokens.values() if len(ids) > 1]
    assert twins, "no identical training completions: the seed no longer produces the case this test is about"
