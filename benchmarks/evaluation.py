"""Speculative-decoding evaluation at scale: cost per token vs context length, batching, and the
teacher-forced estimate against exact tau.

* per_token_cost_ratio_2048_vs_128: seconds per generated token with a 2048-token prompt over a
  128-token one: the median time between two proposals (one round: verification + proposal, the
  prefill left out) over the tokens a round yields. Both caches keep a round at k + 1 target
  positions and k drafter steps, so only attention over the longer cache grows (2 S H of the
  16 H^2 multiply-adds per token and layer: S / 8H); without caches (a full forward per round,
  the drafter re-reading the prefix per draft) the ratio would be about 2048 / 128. Target:
  Llama hidden 1024, 2 layers, MLP 4096, vocab 2048 (big enough on one CPU core that matmuls,
  not Python, set the cost); the worse of the two drafter kinds.
* batched_speedup: 16 prompts decoded as one batch over the same 16 one at a time. Beside it,
  matmul_bound: the same ratio for the target's largest matmul on its own, over one round's k + 1
  rows per prompt. On one CPU thread the BLAS runs a few rows barely faster per row than one, and
  many rows only a few times faster per row, so batching a round cannot gain much more than this.
* tau_estimate_abs_diff: the demo's simulated target (pre-trained, cached under the data dir) and
  its sampled rollouts (temperature 1); an EAGLE-3 drafter trained on them (the demo's settings,
  6 epochs); at the rollouts' temperature with greedy drafts, exact tau (the held-out prompts decoded
  by vLLM's rejection rule) against the teacher-forced estimate over the same held-out rollouts
  (a draft kept where it is the rollout's token: with greedy drafts, accepted with the target's
  probability of it, the same expectation).

* drafter_kinds: the drafter's share of a round per kind at k = 4 and 8 (EAGLE-3 drafts a token per
  forward, P-EAGLE all k in one): per kind, the median seconds of a round (verification + proposal)
  and of its proposal alone, the drafter forwards per round, and c, the cost model's drafter
  forward in target forwards (`pipeline/evaluation/round_cost.py`). Target: the cost ratio's, 8 layers
  deep so that a drafter is a realistic fraction of it (c about 0.2 for EAGLE-3, 0.3 for a
  two-layer P-EAGLE). peagle_eagle3_per_token_k{4,8}_ratio: P-EAGLE's evaluation time per
  generated token over EAGLE-3's at equal tau, i.e. the ratio of their round times (tau divides
  both); the untrained drafters' taus are beside it (about 1 for both).

* estimate_scaling: the teacher-forced acceptance estimate (`teacher_forced.estimate_acceptance`, what the
  acceptance stage runs on every step's held-out rollouts) over 8 rollouts of 128 and of 2,048 tokens, on the cost
  ratio's target with an EAGLE-3 drafter, `eval.estimate_chunk_tokens` columns at a time: seconds per rollout token
  at each length (best of `repeats`) and their ratio, `estimate_per_token_cost_ratio_2048_vs_128`; and each length's
  peak memory in a process of its own (its peak RSS, VmHWM, over the RSS before the estimate: torch's CPU
  allocations are not seen by tracemalloc), `estimate_peak_mem_ratio_2048_vs_128`. What grows with the length
  is the target's key/value cache and the drafter's step-0 keys (a few H per token); logits, layers and
  attention scores are a chunk's.

Goals: ratio <= 1.5, speedup >= 4, estimate per-token ratio <= 1.5 and peak memory ratio well under 16 (the
lengths'), estimate within 0.3 of exact tau, P-EAGLE/EAGLE-3 per token below
1 at k = 4 and lower at k = 8. One thread throughout. `run(tiny=True)`: the same at `TINY`'s sizes, a smoke run.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import tiny as smoke

K = 4


@dataclass(frozen=True)
class Sizes:
    hidden: int  # the cost ratio's and batching's target
    vocab: int
    kinds_layers: int  # drafter_kinds' target: as deep as a drafter is a realistic fraction of it
    contexts: tuple[int, int]  # the cost ratio's short and long prompt
    cost_new_tokens: int
    prompts: int  # batching's
    prompt_lens: tuple[int, int]  # batching's prompts: lengths drawn in [low, high)
    batch_new_tokens: int
    kinds_prompt: int
    kinds_new_tokens: int
    repeats: int  # batching's rounds, best of them
    tau_epochs: int  # tau_estimate's training
    estimate_lengths: tuple[int, int] = (128, 2048)  # estimate_scaling's rollouts
    tau_overrides: dict | None = None  # tau_estimate's config (None: the demo's, its pre-trained target cached)


FULL = Sizes(hidden=1024, vocab=2048, kinds_layers=8, contexts=(128, 2048), cost_new_tokens=24, prompts=16,
             prompt_lens=(24, 48), batch_new_tokens=16, kinds_prompt=128, kinds_new_tokens=40, repeats=3, tau_epochs=6)


TINY = Sizes(hidden=64, vocab=256, kinds_layers=2, contexts=(16, 64), cost_new_tokens=8, prompts=4,
             prompt_lens=(8, 16), batch_new_tokens=4, kinds_prompt=16, kinds_new_tokens=12, repeats=1, tau_epochs=1,
             tau_overrides={"simulation": smoke.SIMULATION, "eval": smoke.EVAL}, estimate_lengths=(16, 64))


def _target(torch, sizes: Sizes, layers: int = 2):
    from pipeline.models import target as target_lib

    hidden, vocab = sizes.hidden, sizes.vocab
    config = target_lib.tiny_llama_config(vocab, hidden, layers, 16)
    config.intermediate_size = 4 * hidden
    config.max_position_embeddings = 4096
    return target_lib.build_target(config, seed=0)


def _drafter(torch, target, kind: str):
    from pipeline.config import DrafterConfig
    from pipeline.models.drafter import fresh_drafter

    drafter = fresh_drafter(DrafterConfig(kind=kind), target, torch.ones(target.config.vocab_size), seed=0)
    drafter.attach(target)
    return drafter


def _best_interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Each fn's best time over `repeats` rounds, the fns taking turns within a round: a shared machine that slows
    down for a while slows them alike, rather than whichever was being timed then."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


class TimedProposer:
    """A drafter's proposer that notes when each round's proposal is asked for: the time between two
    calls is one round (verification + proposal), whatever the prefill cost."""

    def __init__(self, inner, stamps: list[float]) -> None:
        self.inner, self.stamps, self.layer_ids = inner, stamps, inner.layer_ids

    def propose(self, pairs, k: int):
        self.stamps.append(time.perf_counter())
        return self.inner.propose(pairs, k)


def _per_token_s(torch, target, drafter, context: int, new_tokens: int) -> float:
    """Median seconds per round over tokens per round (1 + mean accepted drafts)."""
    import statistics

    from pipeline.evaluation.speculative import generate_batch

    prompt = torch.randint(0, target.config.vocab_size, (context,), generator=torch.Generator().manual_seed(context))
    stamps: list[float] = []
    trace = generate_batch(target, lambda: TimedProposer(drafter.proposer(), stamps), [prompt], new_tokens, K)[0]
    rounds = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    tokens_per_round = 1 + sum(trace.accepted_per_round) / len(trace.accepted_per_round)
    return statistics.median(rounds) / tokens_per_round


def cost_ratio(torch, sizes: Sizes) -> dict:
    target = _target(torch, sizes)
    out = {}
    for kind in ("eagle", "eagle3"):
        drafter = _drafter(torch, target, kind)
        short, long = (_per_token_s(torch, target, drafter, n, sizes.cost_new_tokens) for n in sizes.contexts)
        out[kind] = {"per_token_ms_128": short * 1e3, "per_token_ms_2048": long * 1e3, "ratio": long / short}
    return out


class _ProposalClock(TimedProposer):
    """TimedProposer that also notes how long each proposal itself takes."""

    def __init__(self, inner, stamps: list[float], proposing: list[float]) -> None:
        super().__init__(inner, stamps)
        self.proposing = proposing

    def propose(self, pairs, k: int):
        self.stamps.append(time.perf_counter())
        out = self.inner.propose(pairs, k)
        self.proposing.append(time.perf_counter() - self.stamps[-1])
        return out


def drafter_kinds(torch, sizes: Sizes) -> dict:
    import statistics

    from pipeline.evaluation.round_cost import drafter_cost_ratio
    from pipeline.evaluation.speculative import generate_batch

    target = _target(torch, sizes, layers=sizes.kinds_layers)
    prompt = torch.randint(0, target.config.vocab_size, (sizes.kinds_prompt,),
                           generator=torch.Generator().manual_seed(3))
    out: dict = {}
    for k in (4, 8):
        for kind in ("eagle3", "peagle"):
            drafter = _drafter(torch, target, kind)
            stamps: list[float] = []
            proposing: list[float] = []
            proposers: list = []

            def new(drafter=drafter, stamps=stamps, proposing=proposing, proposers=proposers):
                proposers.append(drafter.proposer())
                return _ProposalClock(proposers[-1], stamps, proposing)

            trace = generate_batch(target, new, [prompt], sizes.kinds_new_tokens, k)[0]
            rounds = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            out[f"{kind}_k{k}"] = {
                "round_ms": statistics.median(rounds) * 1e3, "proposal_ms": statistics.median(proposing[1:]) * 1e3,
                "drafter_forwards_per_round": sum(p.forwards for p in proposers) / len(proposing),
                "drafter_cost_ratio": drafter_cost_ratio(drafter, target),
                "tau": 1 + sum(trace.accepted_per_round) / len(trace.accepted_per_round),
            }
        out[f"peagle_eagle3_per_token_k{k}_ratio"] = out[f"peagle_k{k}"]["round_ms"] / out[f"eagle3_k{k}"]["round_ms"]
    return out


def batched_speedup(torch, sizes: Sizes) -> dict:
    from pipeline.evaluation.speculative import generate_batch

    target = _target(torch, sizes)
    drafter = _drafter(torch, target, "eagle3")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.config.vocab_size, (int(n),), generator=g)
               for n in torch.randint(*sizes.prompt_lens, (sizes.prompts,), generator=g)]
    new_tokens = sizes.batch_new_tokens
    weight = target.model.layers[0].mlp.up_proj.weight  # (I, H) the verification forward's largest matmul
    one, all_rows = (torch.randn(n * (K + 1), weight.shape[1], generator=g) for n in (1, len(prompts)))
    times = _best_interleaved({
        "batched": lambda: generate_batch(target, drafter.proposer, prompts, new_tokens, K),
        "alone": lambda: [generate_batch(target, drafter.proposer, [p], new_tokens, K) for p in prompts],
        "matmul_batched": lambda: [torch.nn.functional.linear(all_rows, weight) for _ in range(20)],
        "matmul_alone": lambda: [torch.nn.functional.linear(one, weight) for _ in range(20 * len(prompts))],
    }, sizes.repeats)
    batched, alone = times["batched"], times["alone"]
    return {"batched_s": batched, "one_at_a_time_s": alone, "speedup": alone / batched, "prompts": len(prompts),
            "matmul_bound": times["matmul_alone"] / times["matmul_batched"]}


def demo_drafter(torch, sizes: Sizes = FULL) -> tuple:
    """The demo's simulated step (or `sizes.tau_overrides`', pre-trained in a temporary directory): its training
    rollouts' hidden states extracted as the pipeline extracts them (long-tailed lengths, batched and padded by
    `iter_hidden_states`), a fresh drafter trained on them -> (cfg, target, drafter, held-out rollouts, training
    seconds, training samples, the training rollouts' shortest and longest length)."""
    from pipeline.config import load_config
    from pipeline.data.held_out import is_held_out
    from pipeline.models.drafter import fresh_drafter
    from pipeline.models.layers import stored_layer_ids
    from pipeline.sources.extract import iter_hidden_states
    from pipeline.sources.simulation import SimulatedRL
    from pipeline.training.dataset import InMemoryDataset
    from pipeline.training.loop import train_drafter

    with tempfile.TemporaryDirectory(prefix="bench-evaluation-") as tmp:
        cfg = load_config(overrides=sizes.tau_overrides)
        cache = cfg.data_path / "cache" if sizes.tau_overrides is None else Path(tmp)
        sim = SimulatedRL(cfg.simulation, store=None, run="bench", cache_dir=cache)
        target = sim.pretrained()
    rollouts = sim.generate_rollouts(target, 1, torch.Generator().manual_seed(7))
    held = [r for r in rollouts if is_held_out(r.sample_id, cfg.eval.held_out_fraction)]
    train = [r for r in rollouts if not is_held_out(r.sample_id, cfg.eval.held_out_fraction)]
    num_layers, vocab = target.config.num_hidden_layers, target.config.vocab_size
    hidden = list(iter_hidden_states(target, train, 1, tokens_per_batch=cfg.hidden_states.tokens_per_batch,
                                     layer_ids=stored_layer_ids(cfg.drafter, num_layers)))
    counts = sum(torch.bincount(s.input_ids[s.loss_mask.bool()], minlength=vocab) for s in hidden)
    drafter = fresh_drafter(cfg.drafter, target, counts, cfg.train.seed)
    samples = [drafter.training_sample(s, num_layers) for s in hidden]
    start = time.perf_counter()
    train_drafter(drafter, InMemoryDataset(samples), cfg.train.model_copy(update={"epochs": sizes.tau_epochs}),
                  teacher=drafter.teacher(target))
    train_s = time.perf_counter() - start
    drafter.attach(target)
    lengths = [min(len(r.input_ids) for r in train), max(len(r.input_ids) for r in train)]
    return cfg, target, drafter, held, train_s, len(samples), lengths


def tau_estimate(torch, sizes: Sizes) -> dict:
    """Exact and estimated tau of the demo's drafter (`demo_drafter`) on its held-out rollouts, at the rollouts'
    own temperature with greedy drafts: decoding the held-out prompts by vLLM's rule against the teacher-forced
    estimate on the rollouts themselves (drafts kept where they draw the rollout's token)."""
    from pipeline.evaluation import speculative
    from pipeline.evaluation.teacher_forced import estimate_acceptance
    from pipeline.sampling import SamplingParams

    cfg, target, drafter, held, train_s, train_samples, train_lengths = demo_drafter(torch, sizes)
    k, max_new = cfg.eval.num_speculative_tokens, cfg.eval.max_new_tokens
    params = SamplingParams(temperature=cfg.simulation.temperature)
    prompts = [torch.tensor(r.input_ids[: r.prompt_len]) for r in held]
    start = time.perf_counter()
    exact = speculative.evaluate(target, speculative.follow_target(drafter, target), prompts, max_new, k,
                                 params=params)
    exact_s = time.perf_counter() - start
    start = time.perf_counter()
    estimate = estimate_acceptance(target, drafter, [torch.tensor(r.input_ids) for r in held],
                                   [r.prompt_len for r in held], k, sampled=True)
    estimate_s = time.perf_counter() - start
    if estimate is None:
        raise RuntimeError(f"no held-out rollout has {k} response tokens: nothing to estimate on")
    return {"temperature": params.temperature,
            "exact": {**exact.as_dict(), "prompts": len(prompts), "wall_s": exact_s},
            "estimate": {**estimate.as_dict(), "wall_s": estimate_s}, "train_s": train_s,
            "train_samples": train_samples, "train_lengths": train_lengths, "abs_diff": abs(estimate.tau - exact.tau)}


ESTIMATE_ROLLOUTS = 8


def _estimate_inputs(torch, target, length: int) -> tuple[list, list[int]]:
    g = torch.Generator().manual_seed(length)
    texts = [torch.randint(0, target.config.vocab_size, (length,), generator=g) for _ in range(ESTIMATE_ROLLOUTS)]
    return texts, [length // 4] * ESTIMATE_ROLLOUTS


def estimate_peak(length: int, chunk: int | None, hidden: int, vocab: int) -> dict:
    """In this process (a fresh one): the estimate over `ESTIMATE_ROLLOUTS` rollouts of `length` tokens, `chunk`
    columns at a time (None: all at once) -> its peak memory over the RSS before it, in MB."""
    import resource

    import torch

    from pipeline.evaluation.teacher_forced import estimate_acceptance

    torch.set_num_threads(1)
    target = _target(torch, Sizes(**{**FULL.__dict__, "hidden": hidden, "vocab": vocab}))
    drafter = _drafter(torch, target, "eagle3")
    texts, prompts = _estimate_inputs(torch, target, length)
    before = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    estimate_acceptance(target, drafter, texts, prompts, K, chunk_tokens=chunk, sampled=True)
    # VmHWM, this process's own peak RSS (ru_maxrss would carry the parent's from before the exec)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    peak = int(status["VmHWM"].split()[0]) * 1024  # kB
    return {"length": length, "chunk": chunk, "peak_growth_mb": max(0, peak - before) / 2**20,
            "logits_mb": ESTIMATE_ROLLOUTS * length * vocab * 4 / 2**20}


def measure_peak(length: int, chunk: int | None, hidden: int, vocab: int) -> dict:
    """`estimate_peak` in a process of its own (a peak is a process's)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "benchmarks.evaluation", "--estimate-peak", str(length),
            str(chunk or 0), str(hidden), str(vocab)]
    out = subprocess.run(argv, cwd=Path(__file__).resolve().parent.parent, check=True, capture_output=True,
                         text=True, timeout=1800)
    return json.loads(out.stdout)


def estimate_scaling(torch, sizes: Sizes, chunk: int) -> dict:
    from pipeline.evaluation.teacher_forced import estimate_acceptance

    short, long = sizes.estimate_lengths
    target = _target(torch, sizes)
    drafter = _drafter(torch, target, "eagle3")
    inputs = {n: _estimate_inputs(torch, target, n) for n in (short, long)}
    times = _best_interleaved({n: (lambda n=n: estimate_acceptance(target, drafter, *inputs[n], K, sampled=True,
                                                                   chunk_tokens=chunk)) for n in (short, long)},
                              sizes.repeats)
    per_token = {n: times[n] / (ESTIMATE_ROLLOUTS * n) for n in (short, long)}
    peaks = {n: measure_peak(n, chunk, sizes.hidden, sizes.vocab) for n in (short, long)}
    return {"chunk_tokens": chunk, "rollouts": ESTIMATE_ROLLOUTS, "lengths": [short, long],
            "per_token_us": {str(n): v * 1e6 for n, v in per_token.items()},
            "per_token_cost_ratio": per_token[long] / per_token[short],
            "peak_growth_mb": {str(n): p["peak_growth_mb"] for n, p in peaks.items()},
            "full_logits_mb": {str(n): p["logits_mb"] for n, p in peaks.items()},
            "peak_mem_ratio": peaks[long]["peak_growth_mb"] / max(peaks[short]["peak_growth_mb"], 1.0)}


def gpu_throughput(prompts: int = 16, prompt_len: int = 128, new_tokens: int = 128) -> dict | None:
    """On CUDA, bf16: evaluation tokens/s (batched speculative decoding, EAGLE-3, k = 4) against the
    target's own batched greedy `generate` with its KV cache, over the same prompts. Target: Llama-3.2-1B
    shapes built from a config (random weights, so the untrained drafter's tau is near 1 and the figure
    is the evaluation's overhead over plain decoding, not a speedup)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.evaluation.speculative import generate_batch

    if not torch.cuda.is_available():
        return None
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    drafter = _drafter(torch, target, "eagle3").to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, config.vocab_size, (prompt_len,), generator=g) for _ in range(prompts)]

    def timed(fn) -> float:
        fn()  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.no_grad():
        traces: list = []
        spec_s = timed(lambda: traces.__setitem__(slice(None), generate_batch(target, drafter.proposer, batch,
                                                                             new_tokens, K)))
        ids = torch.stack(batch).cuda()  # (B, T)
        plain_s = timed(lambda: target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                pad_token_id=0))
    accepted = [a for t in traces for a in t.accepted_per_round]
    tokens = prompts * new_tokens
    return {"device": torch.cuda.get_device_name(), "target_params": sum(p.numel() for p in target.parameters()),
            "speculative_tokens_per_s": tokens / spec_s, "plain_generate_tokens_per_s": tokens / plain_s,
            "ratio_vs_plain": plain_s / spec_s, "tau": 1 + sum(accepted) / max(len(accepted), 1)}


def run(tiny: bool = False) -> dict:
    import torch

    from pipeline.config import load_config

    sizes = TINY if tiny else FULL
    chunk = load_config().eval.estimate_chunk_tokens
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            cost = cost_ratio(torch, sizes)
            batch = batched_speedup(torch, sizes)
            kinds = drafter_kinds(torch, sizes)
            scaling = estimate_scaling(torch, sizes, chunk)
        tau = tau_estimate(torch, sizes)
    finally:
        torch.set_num_threads(threads)
    return {
        "per_token_cost_ratio_2048_vs_128": max(c["ratio"] for c in cost.values()),
        "batched_speedup": batch["speedup"],
        "tau_estimate_abs_diff": tau["abs_diff"],
        "peagle_eagle3_per_token_k4_ratio": kinds["peagle_eagle3_per_token_k4_ratio"],
        "peagle_eagle3_per_token_k8_ratio": kinds["peagle_eagle3_per_token_k8_ratio"],
        "estimate_per_token_cost_ratio_2048_vs_128": scaling["per_token_cost_ratio"],
        "estimate_peak_mem_ratio_2048_vs_128": scaling["peak_mem_ratio"],
        "estimate_scaling": scaling,
        "drafter_kinds": kinds,
        "cost": cost,
        "batching": batch,
        "tau": tau,
    }


if __name__ == "__main__":
    import sys

    if "--estimate-peak" in sys.argv:
        length, chunk, hidden, vocab = map(int, sys.argv[sys.argv.index("--estimate-peak") + 1 :][:4])
        result = estimate_peak(length, chunk or None, hidden, vocab)
    else:
        result = gpu_throughput() if "--gpu" in sys.argv else run(tiny="--tiny" in sys.argv)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
