"""EAGLE-3 and P-EAGLE side by side on the demo's data: `python -m benchmarks.drafter_kinds [--step N]
[--epochs E]` after `make demo` (default: its last step, the demo's epochs).

Each kind is trained fresh on the step's buffer (the demo's training settings), then
P-EAGLE once more warm-started from that EAGLE-3 drafter; each is measured on the step's held-out
prompts against its policy at k = 4 and 8: exact tau, drafter forwards per round and per generated
token, training tokens/s (one process, the machine's threads), and the estimated rollout speedup
of the cost model (`pipeline/evaluation/round_cost.py`) with c the drafter's weights over the demo
target's, and with c as a drafter of the same shape would have next to Llama-3.1-8B (hidden 4096,
32 layers, MLP 14336, draft vocab 32000), where the drafter is a smaller share of the target.
The last line is the path of the JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch

from pipeline.config import load_config
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.buffer import iter_buffer_samples, read_buffer
from pipeline.data.store import open_store
from pipeline.evaluation import round_cost, speculative
from pipeline.evaluation.acceptance import held_out_prompts
from pipeline.models import drafter as drafters
from pipeline.models import target as target_lib
from pipeline.training.cotrain import _token_counts
from pipeline.training.dataset import InMemoryDataset
from pipeline.training.loop import train_drafter

KS = (4, 8)


def _llama8b_weights(layers: int) -> float:
    """c next to Llama-3.1-8B: the weights an EAGLE-3 (1 layer) or P-EAGLE drafter of `layers` layers reads per
    forward over the target's (embeddings excluded)."""
    h, mlp, vocab, kv = 4096, 14336, 128256, 1024
    target = 32 * (2 * h * h + 2 * h * kv + 3 * h * mlp) + h * vocab
    first = 2 * h * h + 2 * 2 * h * kv + h * h + 3 * h * mlp  # q, k, v read 2H; o; MLP
    block = 2 * h * h + 2 * h * kv + 3 * h * mlp
    drafter = 3 * h * h + first + (layers - 1) * block + h * 32000  # fc, layers, lm_head over the draft vocab
    return drafter / target


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--step", type=int, default=None, help="the demo step whose buffer and policy to use")
    parser.add_argument("--epochs", type=int, default=None, help="train.epochs (the demo's when unset)")
    args = parser.parse_args()
    cfg = load_config(args.config)
    if args.epochs:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"epochs": args.epochs})})
    store = open_store(cfg)
    step = args.step or json.loads((cfg.data_path / "demo" / "summary.json").read_text())["steps"][-1]["step"]
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    target = target_lib.load_policy(store, pointer.checkpoint_uri, "cpu", target_lib.load_settings(cfg))
    num_layers = target.config.num_hidden_layers
    prompts = held_out_prompts(store, cfg, step, rollouts_lib.TargetLimits.of(target.config))
    entries = read_buffer(store, cfg.run, step)
    hidden = list(iter_buffer_samples(store, cfg.run, entries))
    counts = _token_counts(hidden, target.config.vocab_size)
    out: dict = {"step": step, "buffer_samples": len(hidden), "prompts": len(prompts), "epochs": cfg.train.epochs}

    def run(name: str, drafter) -> None:
        drafter.attach(target)
        samples = [drafter.training_sample(s, num_layers) for s in hidden]
        result = train_drafter(drafter, InMemoryDataset(samples), cfg.train, teacher=drafter.teacher(target))
        drafter.attach(target)
        new = speculative.follow_target(drafter, target)
        layers = getattr(drafter.config, "num_hidden_layers", 1)
        rows = []
        for c in round_cost.round_costs(target, drafter, new, prompts, cfg.eval.max_new_tokens, list(KS)):
            rows.append({**c.to_json(), "estimated_speedup_llama8b": round(
                replace(c, drafter_cost_ratio=_llama8b_weights(layers)).speedup, 4)})
        out[name] = {"train_tokens_per_s": round(result.tokens_per_s, 1), "train_wall_s": round(result.wall_s, 1),
                     "final_loss": round(result.loss, 4), "at_k": rows}
        sys.stdout.write(f"{name}: {json.dumps(out[name])}\n")

    eagle3 = drafters.fresh_drafter(cfg.drafter.model_copy(update={"kind": "eagle3"}), target, counts, cfg.train.seed)
    run("eagle3", eagle3)
    peagle_cfg = cfg.drafter.model_copy(update={"kind": "peagle"})
    run("peagle", drafters.fresh_drafter(peagle_cfg, target, counts, cfg.train.seed))
    run("peagle_from_eagle3", drafters.warm_start_from(eagle3, peagle_cfg))
    path = cfg.data_path / "demo" / f"drafter_kinds-step{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    sys.stdout.write(f"{path}\n")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
