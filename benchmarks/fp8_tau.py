"""What fp8-e4m3 storage of hidden states costs in tau: the demo's steps, both drafter kinds.

For each drafter kind, the same steps of a source (the simulated one, or TRL's GRPO demo:
real GRPO steps of `pipeline.sources.trl`, 64 completions of at most 16 tokens a step) are captured (capture plan,
windows only) and stored twice, lossless (`none`) and `fp8-e4m3`; a drafter is co-trained on
each as the pipeline trains it (fresh at step 1, then warm-started from the previous step's,
the buffer of `train.buffer_steps` steps, 100,000 trained positions), and its tau measured
by speculative decoding on the step's held-out prompts. Both sides see the same rollouts, the
same forward pass and the same seeds: the storage alone differs. Goal: fp8's tau at most 0.05
below lossless at every step (`fp8_tau_max_loss`; docs/storage.md, Compression). Its absolute
difference, either way, is `fp8_tau_max_abs_diff`: training on slightly other values moves tau
by that much as noise (up to 0.08 here, as often up as down).

`--tiny` (the smoke run's): two steps of `benchmarks.tiny`'s simulated source, trainings of `tiny.TRAIN`'s token budget.

    python -m benchmarks.fp8_tau [--steps 3] [--source simulated|trl] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from pipeline.models.drafter import Drafter

ROOT = Path(__file__).resolve().parent.parent
COMPRESSIONS = ("none", "fp8-e4m3")
TRAIN_BUDGET = 100_000  # trained positions per training: about half the demo's 20 epochs, to bound the run


def _config(data_dir: Path, kind: str, overrides: dict | None):
    from pipeline.config import load_config

    cfg = load_config(overrides=overrides)
    return cfg.model_copy(update={"data_dir": str(data_dir), "run": "fp8tau",
                                  "drafter": cfg.drafter.model_copy(update={"kind": kind})})


def _pretrained_cache(cfg) -> None:
    """The demo's pre-trained target, when a demo has cached it: pre-training is not what is measured."""
    cached = ROOT / ".data" / "cache"
    if cached.is_dir():
        shutil.copytree(cached, cfg.data_path / "cache", dirs_exist_ok=True)


def _publish_steps(cfg, store, steps: int, source: str, workdir: Path) -> None:
    """Steps 1..`steps` of the source, committed to the store as the pipeline reads them."""
    if source == "trl":
        from pipeline.sources.trl import GRPODemo

        rl = GRPODemo(store, cfg.run, steps, workdir / "trl")
        for step in range(1, steps + 1):
            rl.run_step(step)
        rl.finish()
        return
    from pipeline.sources.simulation import SimulatedRL

    simulation = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache")
    for step in range(1, steps + 1):
        simulation.run_step(step)


@dataclass(frozen=True)
class _Captured:
    """A step's rollouts captured as the pipeline captures them, before either storage."""

    policy: PreTrainedModel  # the step's policy, the target the drafters follow
    layer_ids: list[int]  # the layers whose hidden states are stored (`extract.stored_layer_ids`)
    samples: list  # the plan's windows with their hidden states
    prompts: list  # the step's held-out prompts, which tau is measured on
    counts: torch.Tensor  # (V,) int64: each token's trained positions, a fresh drafter's vocabulary


@dataclass
class _Storages:
    """One drafter kind's figures per storage: tau at each step, and the bytes stored over the steps."""

    taus: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in COMPRESSIONS})
    stored: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMPRESSIONS, 0))


def _capture(cfg, store, step: int) -> _Captured:
    """The capture plan's windows of step `step` and their hidden states under the step's policy."""
    import torch

    from pipeline.data import capture
    from pipeline.data.held_out import held_out_prompts
    from pipeline.data.rollouts import read_policy_pointer, read_rollouts
    from pipeline.models import target as target_lib
    from pipeline.sources import extract

    policy = target_lib.load_policy(store, read_policy_pointer(store, cfg.run, step).checkpoint_uri)
    rollouts = read_rollouts(store, cfg.run, step)
    plan = capture.plan_capture(rollouts, step, held_out_fraction=cfg.eval.held_out_fraction,
                                window_tokens=cfg.train.window_tokens,
                                max_samples=cfg.capture.max_samples, max_tokens=cfg.capture.max_tokens)
    windows = plan.bounds()
    layer_ids = extract.stored_layer_ids(cfg.drafter, policy.config.num_hidden_layers)
    samples = [s for s in extract.iter_hidden_states(
        policy, [r for r in rollouts if r.sample_id in windows], step,
        tokens_per_batch=cfg.hidden_states.tokens_per_batch, layer_ids=layer_ids, windows=windows)]
    prompts = held_out_prompts(store, cfg, step)
    counts = torch.zeros(policy.config.vocab_size, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(s.input_ids[s.loss_mask.bool()], minlength=policy.config.vocab_size)
    return _Captured(policy, layer_ids, samples, prompts, counts)


def _store(store, run_name: str, step: int, captured: _Captured, compression: str) -> int:
    """The step's samples written as hidden-state shards with `compression`: the bytes stored."""
    from pipeline.data import shards

    config = captured.policy.config
    manifest = shards.write_hidden_states(
        store, run_name, step, captured.samples, hidden_size=config.hidden_size,
        layer_ids=captured.layer_ids or [config.num_hidden_layers], target={"model_id": "demo"},
        compression=compression)
    return manifest.total_bytes


def _co_train(cfg, store, run_name: str, step: int, captured: _Captured, previous: Drafter | None,
              budget: int) -> Drafter:
    """A drafter trained as the pipeline trains it, on the buffer of the steps stored under `run_name`:
    warm-started from `previous`, fresh at the first step."""
    import copy

    from pipeline.data import shards
    from pipeline.data.buffer import select_buffer
    from pipeline.models import drafter as drafters
    from pipeline.training.dataset import BufferDataset
    from pipeline.training.loop import train_drafter

    policy, num_layers = captured.policy, captured.policy.config.num_hidden_layers
    manifests = [shards.read_manifest(store, run_name, s)
                 for s in range(max(1, step - cfg.train.buffer_steps + 1), step + 1)]
    entries = select_buffer(manifests, step, cfg.train.buffer_steps, cfg.train.data_buffer_max_size)
    drafter = (copy.deepcopy(previous) if previous is not None
               else drafters.fresh_drafter(cfg.drafter, policy, captured.counts, cfg.train.seed))
    drafter.attach(policy)
    data = BufferDataset(store, run_name, entries, lambda s: drafter.training_sample(s, num_layers))
    train_drafter(drafter, data, cfg.train.model_copy(update={"max_tokens": budget}), teacher=drafter.teacher(policy))
    return drafter


def _tau(cfg, captured: _Captured, drafter: Drafter) -> float:
    from pipeline.evaluation import speculative

    policy = captured.policy
    result = speculative.evaluate(policy, speculative.follow_target(drafter, policy), captured.prompts,
                                  cfg.eval.max_new_tokens, cfg.eval.num_speculative_tokens)
    return round(result.tau, 3)


def _compare_storages(cfg, store, steps: int, budget: int) -> _Storages:
    """Each step captured once, stored both ways, and a drafter of `cfg.drafter.kind` co-trained on each way's
    buffer, its tau measured."""
    figures = _Storages()
    drafter_of: dict[str, Drafter | None] = dict.fromkeys(COMPRESSIONS)
    for step in range(1, steps + 1):
        captured = _capture(cfg, store, step)
        for compression in COMPRESSIONS:
            run_name = f"{cfg.drafter.kind}-{compression}"
            figures.stored[compression] += _store(store, run_name, step, captured, compression)
            drafter_of[compression] = _co_train(cfg, store, run_name, step, captured, drafter_of[compression], budget)
            figures.taus[compression].append(_tau(cfg, captured, drafter_of[compression]))
    return figures


def run(steps: int = 3, kinds: tuple[str, ...] = ("eagle3", "eagle"), source: str = "simulated",
        tiny: bool = False) -> dict:
    from benchmarks import tiny as smoke
    from pipeline.data.store import open_store

    overrides, budget = None, TRAIN_BUDGET
    if tiny:
        overrides = {"simulation": smoke.SIMULATION, "eval": smoke.EVAL}
        budget, steps = smoke.TRAIN["max_tokens"], min(steps, 2)
    by_kind: dict[str, _Storages] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(Path(tmp), kinds[0], overrides)
        if not tiny:
            _pretrained_cache(cfg)
        store = open_store(cfg)
        _publish_steps(cfg, store, steps, source, Path(tmp))
        for kind in kinds:
            by_kind[kind] = _compare_storages(_config(Path(tmp), kind, overrides), store, steps, budget)
    taus = {kind: figures.taus for kind, figures in by_kind.items()}
    diffs = {kind: max(abs(a - b) for a, b in zip(*taus[kind].values(), strict=True)) for kind in kinds}
    losses = {kind: max(a - b for a, b in zip(*taus[kind].values(), strict=True)) for kind in kinds}
    return {
        "source": source,
        "steps": steps,
        "tau": taus,
        "fp8_tau_max_abs_diff": max(diffs.values()),
        "fp8_tau_abs_diff_by_kind": diffs,
        "fp8_tau_max_loss": max(losses.values()),  # lossless tau - fp8 tau, the worst step: the goal's figure
        "fp8_size_ratio": {kind: f.stored["none"] / f.stored["fp8-e4m3"] for kind, f in by_kind.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kinds", default="eagle3,eagle")
    parser.add_argument("--source", choices=["simulated", "trl"], default="simulated")
    parser.add_argument("--tiny", action="store_true", help="the smoke run's sizes (seconds)")
    args = parser.parse_args()
    result = run(args.steps, tuple(args.kinds.split(",")), args.source, args.tiny)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
