"""A step of realistic shape at a tiny hidden size, and the projection for the reference step.

The step: 4,096 rollouts, lognormal lengths of mean 3,000 tokens and p99 12,000 (capped at
16,384), a 4-layer Llama target of hidden size 64. A capture plan of 128 rollouts (the cap
that keeps the run near 3 minutes on 2 cores) picks its rollouts and windows; they are
extracted into shards and an EAGLE-3 drafter trains on them under `train.max_tokens`. Figures:

* `bytes_vs_windows`: the stored layer bytes over captured windows x stored layers x H x 2
  (goal 1.0: nothing but the windows is stored); `total_bytes_vs_windows` with the shards'
  token ids, masks and Arrow framing.
* `extraction_peak_rss_ratio_vs_quarter_step`: extraction's peak RSS above the process's
  before it (rollouts loaded) against the same for a step a quarter the size (goal within 10%:
  memory bounded by a batch, whatever the step).
* `training_wall_vs_budget_prediction`: wall time of a training of `train.max_tokens` over
  the wall time its tokens predict (goal within 10%): a fixed cost per training plus tokens at a
  rate, both fitted to two trainings of a quarter and half the budget in the same process
  (after a warm-up training, discarded). `training_cpu_vs_budget_prediction`: the same with
  the process's CPU seconds, which other work on a shared machine does not stretch.
* `projection`: `cli.py plan` for the reference step (Qwen3-8B, 4,096 x 3,000 tokens, p99
  12,000, 8 x H100, a 600 s RL step, the shipped H100 figures) before capture plans and token
  budgets and after; goals: bytes stored <= 2x what training reads, drafter GPU-seconds <= 10%
  of the RL step's, the served drafter at most 1 RL step old.

`--tiny` (the smoke run's): a step of 64 rollouts of mean 200 tokens, 16 captured, a budget of 4,000 in
batches of 2.

    python -m benchmarks.scale [--tiny]
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLLOUTS, MEAN_TOKENS, P99_TOKENS = 4096, 3000, 12000  # the reference step's
HIDDEN, LAYERS, VOCAB = 64, 4, 256


@dataclass(frozen=True)
class Sizes:
    rollouts: int
    mean_tokens: int
    p99_tokens: int
    max_tokens: int
    tokens_per_batch: int
    train_budget: int  # trained positions of the measured training (the calibration trains half)
    captured: int
    batch_size: int | None = None  # samples a training step packs (None: train.batch_size_per_gpu)


# The cap that keeps the run near 3 minutes on 2 cores: a forward over 3,000-token contexts runs at about
# 15k tokens per CPU-second even at hidden size 64 (attention), so 128 rollouts are captured, not 1,024.
FULL = Sizes(rollouts=ROLLOUTS, mean_tokens=MEAN_TOKENS, p99_tokens=P99_TOKENS, max_tokens=16384,
             tokens_per_batch=32768, train_budget=64_000, captured=128)
# Batches of 2 samples: the calibration's budgets end at different batches.
TINY = Sizes(rollouts=64, mean_tokens=200, p99_tokens=800, max_tokens=1024, tokens_per_batch=4096, train_budget=4000,
             captured=16, batch_size=2)
# The reference step's budgets "after": capture and training budgets sized for an 8B policy on 8 GPUs.
REFERENCE_AFTER = {"capture": {"max_samples": 1024}, "train": {"max_tokens": 4_000_000}}
QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _rollouts(sizes: Sizes, count: int, seed: int) -> list:
    import numpy as np

    from pipeline.accounting.capacity import StepShape
    from pipeline.data.rollouts import Rollout

    lengths = StepShape(count, sizes.mean_tokens, sizes.p99_tokens, 1, "", 1).lengths()
    rng = random.Random(seed)
    ids = np.random.default_rng(seed)
    out = []
    for i in range(count):
        n = min(sizes.max_tokens, max(64, int(rng.choice(lengths))))
        prompt = min(256, n // 4)
        out.append(Rollout(f"r{seed}-{i:05d}", ids.integers(0, VOCAB, n).tolist(), [0] * prompt + [1] * (n - prompt),
                           rng.random(), 1))
    return out


@dataclass(frozen=True)
class FixedPlusRate:
    """A training's seconds: a fixed cost (setup, the first batch's reads) plus its tokens at a rate."""

    fixed_s: float
    tokens_per_s: float

    def predict(self, tokens: int) -> float:
        return self.fixed_s + tokens / self.tokens_per_s


def fixed_plus_rate(tokens_a: int, seconds_a: float, tokens_b: int, seconds_b: float) -> FixedPlusRate:
    """The line through two trainings of different budgets (tokens_b > tokens_a)."""
    per_token = (seconds_b - seconds_a) / (tokens_b - tokens_a)
    return FixedPlusRate(seconds_a - per_token * tokens_a, 1.0 / per_token)


def measure_step(sizes: Sizes, count: int, train: bool) -> dict:
    """In this process: a step of `count` rollouts captured with the shipped defaults, extracted into shards;
    with `train`, an EAGLE-3 drafter trained on them under a token budget (and half of it)."""
    import torch

    from pipeline.config import load_config
    from pipeline.data import capture, shards
    from pipeline.data.buffer import select_buffer
    from pipeline.data.store import ObjectStore
    from pipeline.models import drafter as drafters
    from pipeline.models import target as target_lib
    from pipeline.sources.extract import iter_hidden_states, stored_layer_ids
    from pipeline.training.dataset import BufferDataset
    from pipeline.training.loop import train_drafter

    torch.set_num_threads(1)
    cfg = load_config()
    if sizes.batch_size:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_size_per_gpu": sizes.batch_size})})
    config = target_lib.tiny_llama_config(VOCAB, HIDDEN, LAYERS, 4)
    config.max_position_embeddings = sizes.max_tokens
    target = target_lib.build_target(config, seed=0)
    rollouts = _rollouts(sizes, count, seed=count)
    plan = capture.plan_capture(rollouts, 1, held_out_fraction=cfg.eval.held_out_fraction,
                                window_tokens=cfg.train.window_tokens, max_samples=sizes.captured)
    windows = plan.bounds()
    layer_ids = stored_layer_ids(cfg.drafter, LAYERS)
    baseline_rss = _rss_bytes("VmRSS:")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        store = ObjectStore(Path(tmp).as_uri())
        samples = iter_hidden_states(target, [r for r in rollouts if r.sample_id in windows], 1,
                                     tokens_per_batch=sizes.tokens_per_batch, layer_ids=layer_ids, windows=windows)
        manifest = shards.write_hidden_states(store, "scale", 1, samples, hidden_size=HIDDEN, layer_ids=layer_ids,
                                              target={"model_id": "tiny"})
        extraction_s = time.perf_counter() - start
        result = {
            "rollouts": count, "captured": plan.captured, "tokens_forwarded": plan.forwarded_tokens,
            "tokens_stored": manifest.num_tokens, "stored_layers": len(layer_ids), "hidden_size": HIDDEN,
            "layer_bytes": sum(r.length for e in manifest.samples for r in e.layers),
            "total_bytes": manifest.total_bytes, "extraction_s": extraction_s,
            "extraction_peak_rss_bytes": _rss_bytes("VmHWM:") - baseline_rss,
        }
        if train:
            entries = select_buffer([manifest], 1, 1, cfg.train.data_buffer_max_size)
            counts = torch.ones(VOCAB)
            runs: dict[int, tuple[float, float, int]] = {}  # budget: (wall s, CPU s, trained tokens)
            # A first short training warms what the first training of a process pays for alone (allocator,
            # kernels' first calls); a quarter and half the budget then fit the model that predicts the whole.
            whole = sizes.train_budget
            for budget in (whole // 16, whole // 4, whole // 2, whole):
                drafter = drafters.fresh_drafter(cfg.drafter, target, counts, cfg.train.seed)
                data = BufferDataset(store, "scale", entries, lambda s, d=drafter: d.training_sample(s, LAYERS))
                cpu_start = time.process_time()
                trained = train_drafter(drafter, data, cfg.train.model_copy(update={"max_tokens": budget}),
                                        teacher=drafter.teacher(target))
                runs[budget] = (trained.wall_s, time.process_time() - cpu_start, trained.tokens)
            quarter, half, full = runs[whole // 4], runs[whole // 2], runs[whole]
            wall_model, cpu_model = (fixed_plus_rate(quarter[2], quarter[i], half[2], half[i]) for i in (0, 1))
            result.update({"train_tokens": full[2], "train_wall_s": full[0], "train_cpu_s": full[1],
                           "train_predicted_s": wall_model.predict(full[2]),
                           "train_predicted_cpu_s": cpu_model.predict(full[2]),
                           "train_fixed_s": wall_model.fixed_s, "train_tokens_per_s": wall_model.tokens_per_s,
                           "train_calibration": {"quarter": quarter, "half": half}})
    return result


def _in_subprocess(count: int, train: bool, tiny: bool) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--measure-step", str(count),
                          *(["--train"] if train else []), *(["--tiny"] if tiny else [])],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def projection() -> dict:
    """`cli.py plan` for the reference step, before (every token of every training rollout, epochs over the
    buffer) and after (windows of a capture plan, a token budget per training)."""
    from pipeline.accounting.capacity import PolicyShape, StepShape, Throughput, plan_capacity
    from pipeline.config import load_config

    cfg = load_config()
    before_cfg = cfg.model_copy(update={"capture": cfg.capture.model_copy(update={"max_samples": 0, "max_tokens": 0}),
                                        "train": cfg.train.model_copy(update={"max_tokens": 0,
                                                                              "warm_start_epochs": 0})})
    after_cfg = cfg.model_copy(update={key: getattr(cfg, key).model_copy(update=value)
                                       for key, value in REFERENCE_AFTER.items()})
    step = StepShape(ROLLOUTS, MEAN_TOKENS, P99_TOKENS, 8, "H100", 600.0)
    policy, throughput = PolicyShape.from_config(QWEN3_8B), Throughput.load()
    before = plan_capacity(policy, step, throughput, before_cfg, whole_rollouts=True)
    after = plan_capacity(policy, step, throughput, after_cfg)
    return {
        "before": before.to_json(), "after": after.to_json(), "after_settings": REFERENCE_AFTER,
        "goals_met": {"bytes_stored_le_2x_read": after.stored_vs_read <= 2.0,
                      "drafter_gpu_s_le_10pct": after.drafter_share <= 0.10,
                      "served_drafter_le_1_step_old": after.lag_steps <= 1},
    }


def run(tiny: bool = False) -> dict:
    rollouts = (TINY if tiny else FULL).rollouts
    full = _in_subprocess(rollouts, train=True, tiny=tiny)
    quarter = _in_subprocess(rollouts // 4, train=False, tiny=tiny)
    windows = full["tokens_stored"] * full["stored_layers"] * full["hidden_size"] * 2
    return {
        "bytes_vs_windows": full["layer_bytes"] / windows,
        "total_bytes_vs_windows": full["total_bytes"] / windows,
        "extraction_peak_rss_ratio_vs_quarter_step": full["extraction_peak_rss_bytes"]
        / quarter["extraction_peak_rss_bytes"],
        "training_wall_vs_budget_prediction": full["train_wall_s"] / full["train_predicted_s"],
        "training_cpu_vs_budget_prediction": full["train_cpu_s"] / full["train_predicted_cpu_s"],
        "step": full,
        "quarter_step": quarter,
        "projection": projection(),
    }


def main() -> None:
    if "--measure-step" in sys.argv:
        count = int(sys.argv[sys.argv.index("--measure-step") + 1])
        sizes = TINY if "--tiny" in sys.argv else FULL
        sys.stdout.write(json.dumps(measure_step(sizes, count, "--train" in sys.argv)) + "\n")
        return
    sys.stdout.write(json.dumps(run(tiny="--tiny" in sys.argv), indent=2) + "\n")


if __name__ == "__main__":
    main()
