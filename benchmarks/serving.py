"""The stand-in replica's batched serving (its engine, `pipeline/serving/standin/engine.py`, without HTTP): tokens/s at
batch 1, 8 and 32 with and without speculation, and the batch threshold the engine chooses.

The demo's simulated target (pre-trained, cached under the data dir) and the demo's drafter trained on its
sampled rollouts (`evaluation.demo_drafter`, 6 epochs); requests are the held-out rollouts' prompts, sampled at
temperature 1 (the rollouts' own), each seeded, 128 tokens each (k = `eval.num_speculative_tokens`, greedy
drafting). A batch is B requests submitted at once to one engine; tokens/s is their tokens over the wall time
from submission to the last completion. Arms: `plain` (threshold 0: no round speculates), `speculative` (every
round speculates) and `auto` (the engine measures both kinds of round per batch size and decides per round);
`auto` runs batch 1, 8 and 32 in turn, every round, on one engine that keeps its measurements, as a
long-running replica does (its first round pays for measuring from nothing); its threshold after each round
is in `thresholds`, the last is `threshold`. The arms take turns within each of `REPEATS` rounds, each
figure the best of its rounds, so that load from other work on the machine meets every arm alike. Ratios
are over `plain` at the same batch, measured in the same run. Beside them, `tau_t1_by_draft_method`: the
drafter's tau at temperature 1 on the held-out prompts with each of vLLM's draft methods (greedy: its argmax,
accepted with p; probabilistic: sampled, accepted with min(1, p/q)), the same seeds for both. One thread.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

ALWAYS = 1 << 20


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    new_tokens: int
    repeats: int


FULL = Sizes(batches=(1, 8, 32), new_tokens=128, repeats=5)
TINY = Sizes(batches=(1, 4), new_tokens=8, repeats=1)


def _tokens_per_s(engine, prompts: list, batch: int, new_tokens: int, seed: int) -> float:
    """`batch` requests submitted at once -> their tokens per second."""
    from pipeline.evaluation.rejection_sampler import RequestSampling
    from pipeline.evaluation.speculative import Request
    from pipeline.sampling import SamplingParams

    params = SamplingParams(temperature=1.0)
    requests = [Request(prompts[i % len(prompts)], new_tokens, RequestSampling.seeded(params, seed + i))
                for i in range(batch)]
    start = time.perf_counter()
    done = [f.result() for f in [engine.submit(r) for r in requests]]
    seconds = time.perf_counter() - start
    return sum(len(d.tokens) for d in done) / seconds


def run(tiny: bool = False) -> dict:
    import torch

    from benchmarks import evaluation
    from benchmarks.evaluation import demo_drafter
    from pipeline.evaluation.scheduler import SpeculationThreshold
    from pipeline.evaluation.speculative import evaluate, follow_target
    from pipeline.sampling import DRAFT_SAMPLE_METHODS, SamplingParams
    from pipeline.serving.standin.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sizes = TINY if tiny else FULL
        cfg, target, drafter, held, train_s, _, _ = demo_drafter(torch, evaluation.TINY if tiny else evaluation.FULL)
        k = cfg.eval.num_speculative_tokens
        prompts = [torch.tensor(r.input_ids[: r.prompt_len]) for r in held]
        new_proposer = follow_target(drafter, target)

        def engine(threshold: SpeculationThreshold) -> Engine:
            return Engine(target, new_proposer, k, "greedy", threshold, "policy-demo")

        arms = {"plain": engine(SpeculationThreshold(fixed=0)),
                "speculative": engine(SpeculationThreshold(fixed=ALWAYS)), "auto": engine(SpeculationThreshold())}
        best = {(arm, b): 0.0 for arm in arms for b in sizes.batches}
        thresholds = []
        for repeat in range(sizes.repeats):
            for b in sizes.batches:
                for arm, e in arms.items():
                    rate = _tokens_per_s(e, prompts, b, sizes.new_tokens, seed=1000 * repeat + b)
                    best[arm, b] = max(best[arm, b], rate)
            thresholds.append(arms["auto"].threshold.threshold)
        tau = arms["speculative"].counters.mean_acceptance_length
        for e in arms.values():
            e.close()
        # The draft method's acceptance at the rollouts' temperature, on the same held-out prompts and seeds.
        drafting = {method: evaluate(target, new_proposer, prompts, sizes.new_tokens, k, params=SamplingParams(1.0),
                                     draft_method=method).tau for method in DRAFT_SAMPLE_METHODS}
    finally:
        torch.set_num_threads(threads)
    out: dict = {"tau_served": tau, "drafter_train_s": train_s, "new_tokens": sizes.new_tokens, "k": k,
                 "threshold": thresholds[-1], "thresholds": thresholds,
                 "tau_t1_by_draft_method": drafting, "probabilistic_over_greedy_tau_ratio":
                     drafting["probabilistic"] / drafting["greedy"]}
    for b in sizes.batches:
        plain = best["plain", b]
        out[f"batch_{b}"] = {arm: round(best[arm, b], 1) for arm in ("plain", "speculative", "auto")}
        out[f"batch_{b}_speculative_speedup"] = best["speculative", b] / plain
        out[f"batch_{b}_auto_speedup"] = best["auto", b] / plain
    return out


if __name__ == "__main__":
    import sys

    sys.stdout.write(json.dumps(run(), indent=2) + "\n")
