"""The demo's economics against a deployment's: what a drafter forward costs next to a target forward, how
predictable the policy's tokens are at the rollouts' temperature, and what speculative decoding buys its rollouts.

* cost: c, one EAGLE-3 drafter forward over one target forward, on the demo's target (the `simulation` shape,
  fresh weights: a forward's cost does not depend on them), by the weights each reads
  (`pipeline/evaluation/round_cost.py`) and in seconds (`speculative.RoundTimes`, the rounds of speculative decoding at
  batch 1, 2, 4 and the step's full batch, one thread). Goal: at most 0.2 both ways at every batch.
* language: the per-token entropy (nats) and top-1 probability of the demo's policy, pre-trained and then through
  RL steps 1-6, on its own answers sampled at the rollouts' temperature (48 answers of 64 tokens a step), beside
  SmolLM2-135M-Instruct's on its own sampled answers (REFERENCE).
* rollouts: the last step of the demo under `.data` (skipped without one) replayed as the pipeline replays every
  step (`pipeline/evaluation/replay.py`: one replica's share of its rollouts, the same requests and seeds, without a
  drafter and with the never-retrained, served and co-trained drafters): each arm's speedup over no speculation,
  whole step and tail (the four longest requests on their own). Goal: the served drafter >= 1.5x in the tail.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

K = 4
NEW_TOKENS = 64
REPEATS = 2
BATCHES = (1, 2, 4)

# SmolLM2-135M-Instruct (GGUF Q4_1 de-quantized to float32) on 48 of its own answers sampled at T=1 (top_k 0, top_p 1;
# two thirds arithmetic questions, one third short-answer chat questions; 2234 answer tokens), per answer token.
REFERENCE = {
    "model": "SmolLM2-135M-Instruct, 48 own answers at T=1",
    "entropy_mean": 2.237, "entropy_median": 2.142,
    "entropy_deciles": [0.23, 0.74, 1.21, 1.68, 2.14, 2.55, 3.06, 3.57, 4.33],
    "top1_mean": 0.522, "top1_median": 0.479,
    "top1_deciles": [0.16, 0.24, 0.31, 0.39, 0.48, 0.58, 0.71, 0.85, 0.97],
    "top1_share_above": {"0.5": 0.479, "0.8": 0.237, "0.95": 0.123},
}


def _thread_one() -> None:
    import torch

    torch.set_num_threads(1)


def cost(tiny: bool = False) -> dict:
    """c by weights read and in seconds at each decoding batch, on the demo's target shape (`tiny`: batch 1 alone)."""
    import torch

    from pipeline.config import DrafterConfig, load_config
    from pipeline.evaluation import speculative
    from pipeline.evaluation.round_cost import drafter_cost_ratio
    from pipeline.models import target as target_lib
    from pipeline.models.drafter import fresh_drafter

    sim = load_config().simulation
    target = target_lib.build_target(
        target_lib.tiny_llama_config(sim.vocab_size, sim.hidden_size, sim.num_layers, sim.num_heads), sim.seed)
    drafter = fresh_drafter(DrafterConfig(), target, torch.ones(sim.vocab_size), seed=0)
    g = torch.Generator().manual_seed(0)
    out: dict = {"target": f"{sim.num_layers} layers, hidden {sim.hidden_size}, vocab {sim.vocab_size}",
                 "weights_ratio": round(drafter_cost_ratio(drafter, target), 4)}
    for batch in (1,) if tiny else (*BATCHES, sim.rollouts_per_step):
        prompts = [torch.randint(sim.vocab_size, (sim.prompt_len,), generator=g) for _ in range(batch)]
        ratios = []
        for _ in range(REPEATS):
            times = speculative.RoundTimes()
            speculative.generate_batch(target, speculative.follow_target(drafter, target), prompts, NEW_TOKENS, K,
                                       times)
            ratios.append(times.draft_s / (times.target_s * K))
        out[f"seconds_ratio_b{batch}"] = round(min(ratios), 4)
    return out


def _token_stats(model, task, step: int, temperature: float, prompt_len: int, seed: int):  # noqa: ANN001, ANN202
    """(N,) entropy and (N,) top-1 probability of every token of 48 answers the policy samples itself."""
    import torch
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed + step)
    tokens = task.sample(step, 48, prompt_len, g)  # (48, P) prompts of the step's task
    cache, entropy, top1 = DynamicCache(), [], []
    with torch.no_grad():
        logits = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[:, -1]  # (48, V)
        for _ in range(NEW_TOKENS):
            probs = (logits / temperature).softmax(dim=-1)
            entropy.append(-(probs * probs.clamp_min(1e-12).log()).sum(dim=-1))
            top1.append(probs.max(dim=-1).values)
            tokens = torch.multinomial(probs, 1, generator=g)  # (48, 1)
            logits = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[:, -1]
    return torch.stack(entropy, 1).flatten(), torch.stack(top1, 1).flatten()


def _summary(entropy, top1) -> dict:  # noqa: ANN001
    import torch

    def deciles(x: torch.Tensor) -> list[float]:
        return [round(float(v), 2) for v in torch.quantile(x, torch.linspace(0.1, 0.9, 9))]

    return {"entropy_mean": round(float(entropy.mean()), 3), "entropy_median": round(float(entropy.median()), 3),
            "entropy_deciles": deciles(entropy), "top1_mean": round(float(top1.mean()), 3),
            "top1_median": round(float(top1.median()), 3), "top1_deciles": deciles(top1),
            "top1_share_above": {str(t): round(float((top1 > t).float().mean()), 3) for t in (0.5, 0.8, 0.95)},
            "tokens": int(top1.numel())}


def language(tiny: bool = False) -> dict:
    """The demo policy's per-token statistics on its own answers, steps 1-6 pooled (`tiny`: the target pre-trained
    10 iterations, steps 1-2), beside REFERENCE."""
    import torch

    from pipeline.config import load_config
    from pipeline.sources.simulation import SimulatedRL

    sim = load_config().simulation
    if tiny:
        sim = sim.model_copy(update={"pretrain_iters": 10, "rl_iters": 2})
    with tempfile.TemporaryDirectory() as cache:
        rl = SimulatedRL(sim, None, "bench", Path(cache))
        started = time.perf_counter()
        model = rl.pretrained()
        pretrain_s = time.perf_counter() - started
        entropy, top1 = [], []
        for step in range(1, 3 if tiny else 7):
            model, _ = rl._rl_update(step, model)
            e, p = _token_stats(model, rl.task, step, sim.temperature, sim.prompt_len, seed=5)
            entropy.append(e)
            top1.append(p)
    demo = _summary(torch.cat(entropy), torch.cat(top1))
    return {"demo": demo, "reference": REFERENCE, "pretrain_s": round(pretrain_s, 1),
            "top1_mean_vs_reference": round(demo["top1_mean"] / REFERENCE["top1_mean"], 3),
            "entropy_mean_vs_reference": round(demo["entropy_mean"] / REFERENCE["entropy_mean"], 3)}


def rollouts(tiny: bool = False) -> dict:
    """The demo's last step replayed: each drafter's speedup over no speculation (`tiny`: its first 8 requests)."""
    from pipeline.config import load_config
    from pipeline.data.acceptance_record import AcceptanceRecord
    from pipeline.data.keys import acceptance_key
    from pipeline.data.records import read_record
    from pipeline.data.rollouts import committed_steps
    from pipeline.data.store import open_store
    from pipeline.evaluation import acceptance
    from pipeline.registry import open_registry

    cfg = load_config()
    store = open_store(cfg)
    steps = [s for s in committed_steps(store, cfg.run) if store.exists(acceptance_key(cfg.run, s))]
    if not steps:
        return {"skipped": f"no evaluated demo step under {cfg.data_path} (run `make demo` first)"}
    record = read_record(store, acceptance_key(cfg.run, steps[-1]), AcceptanceRecord)
    roles = {role: d.version if d else None for role, d in
             (("cotrained", record.cotrained), ("served", record.served), ("baseline", record.baseline))}
    measurement = acceptance.StepMeasurement(record.step, record.policy_version, record.num_prompts, roles, {}, None,
                                             record.sampling, record.draft_sample_method)
    if tiny:
        cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"replay_max_requests": 8})})
    replayed = acceptance.replay_rollouts(store, cfg, open_registry(cfg), measurement)
    out: dict = {"step": record.step, "requests": replayed.requests,
                 "draft_sample_method": replayed.draft_sample_method}
    for arm in ("baseline", "served", "cotrained"):
        for tail in (False, True):
            out[f"{arm}{'_tail' if tail else ''}_speedup"] = replayed.speedup(arm, tail=tail)
    return out


def run(tiny: bool = False) -> dict:
    """Every figure, flat: the drafter's cost, the language's ratios to SmolLM2's (its statistics in `language`) and
    the demo's last step replayed (`rollouts`)."""
    _thread_one()
    lang = language(tiny)
    out = {f"drafter_cost_{key}": value for key, value in cost(tiny).items()}
    replayed = rollouts(tiny)
    return out | {"language": lang, "language_top1_mean_ratio": lang["top1_mean_vs_reference"],
                  "language_entropy_mean_ratio": lang["entropy_mean_vs_reference"], "rollouts": replayed,
                  "rollout_served_tail_speedup": replayed.get("served_tail_speedup"),
                  "rollout_served_speedup": replayed.get("served_speedup")}


if __name__ == "__main__":
    _thread_one()
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    parts = {"cost": cost, "language": language, "rollouts": rollouts}
    result = {name: fn() for name, fn in parts.items() if what in (name, "all")}
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
