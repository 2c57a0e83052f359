"""The real policy's first drafter: an EAGLE-3 trained offline on SmolLM2's own sampled answers.

Users bring a drafter trained offline for their base model (SpecForge, speculators); co-training then
keeps it fresh. This recipe gives SmolLM2-135M-Instruct (pipeline/sources/smollm2.py) one, and
measures its learning curve:

    python -m recipes.first_drafter sample [--answers 2048] [--engine vllm]   the answers, sampled once, cached
    python -m recipes.first_drafter train [--arm first] [--minutes 20] [--arm ...]

* **Data**: arithmetic questions (sources/arithmetic.py; seed 0 for training, seed 1 held out) in
  the chat template, each answered by the base policy sampling its full distribution at the
  rollouts' temperature (1.0), at most 96 tokens (`smollm2.AnswerCache`, under
  `.data/cache/smollm2-answers/`).
* **Features**: the target's forward over each answer (sources/extract.py's `iter_hidden_states`,
  the layers EAGLE-3 stores), held in memory in bf16; the loss on answer tokens only.
* **Training**: the pipeline's loop (training/loop.py) with the soft labels of the target's head.
* **The curve**: every `--eval-every` trained positions, tau at k=4 at the rollouts' temperature by
  vLLM's rule for greedy drafts (a draft is accepted with the target's probability of it, chained),
  computed exactly from the target's probabilities at every round start of the held-out answers,
  and for vLLM's probabilistic drafting (sampled drafts accepted with min(1, p/q), one sampled
  chain per start) (evaluation/expected_acceptance.py), against the positions trained and the
  training seconds (evaluations excluded).

An arm is one way to start and train the drafter; `ARMS` holds the ablation's: the draft vocabulary
(32,000 as the default config, or sized from the answers' token counts), the decoder layer (random,
or the target's last layer: `Eagle3Drafter.init_layer_from_target`), the head (the target's rows of
the draft vocabulary, or random), the learning rate, and the window (all of a sample, or its last
64 positions: the answer and the end of its prompt, so that fewer positions are spent on the
system prompt every answer shares).

    .data/first-drafter/<arm>/curve.json     the arm's points and settings
    .data/first-drafter/<arm>/drafter/       the trained drafter, as vLLM loads it
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from pipeline.config import PROJECT_ROOT, DrafterConfig, OptimConfig, TrainConfig
from pipeline.data.rollouts import Rollout
from pipeline.data.shard_format import HiddenSample
from pipeline.evaluation.expected_acceptance import (
    TargetPrefix,
    drafter_chain,
    eagle3_sampled_chain,
    round_starts,
    target_argmax_chain,
    target_prefix,
)
from pipeline.models import drafter as drafters
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.models.checkpoint import save_drafter
from pipeline.models.eagle3 import Eagle3Drafter
from pipeline.sources import arithmetic, smollm2
from pipeline.sources.extract import iter_hidden_states
from pipeline.training.dataset import InMemoryDataset, Sample
from pipeline.training.loop import IterationMetrics, train_drafter

K = 4
TEMPERATURE = 1.0  # the rollouts' (TRL's GRPO default)
MAX_NEW_TOKENS = 96
TRAIN_SEED, HELD_OUT_SEED = 0, 1
DEFAULT_VOCAB = 32000  # drafter.draft_vocab_size's default
VOCAB_COVERAGE = 0.999  # a data-sized draft vocabulary holds the most frequent tokens up to this share of answer tokens
DEFAULT_OUT = smollm2.DEFAULT_DATA / "first-drafter"


@dataclass(frozen=True)
class Arm:
    name: str
    vocab: Literal["default", "data"] = "data"
    layer: Literal["random", "target"] = "target"
    head: Literal["target", "random"] = "target"
    lr: float = 3e-3
    window: int = 512  # train.window_tokens: a sample's last positions trained on (the answer's end first)


ARMS = {arm.name: arm for arm in (
    Arm("first"),
    Arm("default-vocab", vocab="default"),
    Arm("random-layer", layer="random"),
    Arm("random-head", head="random"),
    Arm("lr-1e-3", lr=1e-3),
    Arm("lr-1e-2", lr=1e-2),
    Arm("product-default", vocab="default", layer="random"),
    Arm("window-64", window=64),
)}


@dataclass(frozen=True)
class CurvePoint:
    tokens: int  # answer and prompt positions trained so far
    train_s: float  # training seconds so far, evaluations excluded
    loss: float
    tau: float  # expected tokens per target forward at k=4, T=TEMPERATURE, greedy drafts
    per_position: list[float]
    tau_probabilistic: float  # the same with vLLM's probabilistic drafting


@dataclass
class Curve:
    arm: Arm
    draft_vocab_size: int
    train_answers: int
    held_out_rounds: int
    oracle_tau: float  # on the same held-out rounds
    points: list[CurvePoint] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass(frozen=True)
class HeldOut:
    """The held-out answers with what evaluation reuses: each one's token ids, its round starts and the
    target's forward over it (they do not change while the drafter trains)."""

    sequences: list[torch.Tensor]  # (N,) each
    starts: list[torch.Tensor]  # (S,) each
    prefixes: list[TargetPrefix]
    oracle_tau: float  # the oracle greedy drafter's (the target's own argmax chain): what greedy drafts can reach

    @property
    def rounds(self) -> int:
        return sum(len(s) for s in self.starts)


Sampler = Callable[[list[str], int], list[smollm2.Answer]]  # (questions, seed) -> their answers


def torch_sampler(model, tokenizer, chunk: int) -> Sampler:
    return lambda questions, seed: smollm2.sample_answers(model, tokenizer, questions, TEMPERATURE, MAX_NEW_TOKENS,
                                                          seed, batch_size=chunk)


@contextmanager
def vllm_sampler(checkpoint: Path, tokenizer, data: Path, log) -> Iterator[Sampler]:
    """Answers sampled by a vLLM replica of the policy (`make vllm`), every question of a chunk in flight at once:
    on 2 cores several times the torch loop's rate. Each request has its own seed, so a chunk's answers do not
    depend on how vLLM batches them."""
    from ops.local_stack import free_port
    from pipeline.serving.drivers import ReplicaSpec, VllmDriver, VllmServer, call
    from pipeline.serving.gates import wait_healthy

    driver = VllmDriver(VllmServer(PROJECT_ROOT / ".venv-vllm" / "bin" / "python"), "eagle3", K,
                        data / "first-drafter" / "replica", dev_mode=False)
    replica = ReplicaSpec("sampler", "127.0.0.1", free_port())
    log("starting a vLLM replica of the policy to sample the answers")
    driver.restart(replica, str(checkpoint), "")
    try:
        wait_healthy(replica, 300, lambda: driver.alive(replica))
        eos = tokenizer.eos_token_id

        def answer(prompt: list[int], seed: int) -> smollm2.Answer:
            doc = json.loads(call(replica, "/v1/completions", {
                "model": replica.served_model_name, "prompt": prompt, "max_tokens": MAX_NEW_TOKENS,
                "temperature": TEMPERATURE, "top_p": 1.0, "top_k": -1, "seed": seed, "stop_token_ids": [eos],
                "return_token_ids": True}, timeout=600))
            choice = doc["choices"][0]
            ids = list(choice["token_ids"])
            if choice["finish_reason"] == "stop" and (not ids or ids[-1] != eos):
                ids.append(eos)  # an answer that ended keeps its end-of-turn token, as the torch sampler's
            return smollm2.Answer(prompt, ids)

        def sample(questions: list[str], seed: int) -> list[smollm2.Answer]:
            prompts = [smollm2.chat_prompt_ids(tokenizer, q) for q in questions]
            with ThreadPoolExecutor(len(prompts)) as pool:
                return list(pool.map(answer, prompts, [seed * 1_000 + i for i in range(len(prompts))]))

        yield sample
    finally:
        driver.stop(replica)


@contextmanager
def on_demand(start: Callable[[], AbstractContextManager[Sampler]]) -> Iterator[Sampler]:
    """A sampler whose engine (`start()`, e.g. `vllm_sampler`) starts at its first call and stops on exit: when
    every answer asked for is cached, none starts."""
    with ExitStack() as stack:
        engine: list[Sampler] = []

        def sample(questions: list[str], seed: int) -> list[smollm2.Answer]:
            if not engine:
                engine.append(stack.enter_context(start()))
            return engine[0](questions, seed)

        yield sample


def cached_answers(sample: Sampler, engine: str, seed: int, n: int, data: Path, log) -> list[smollm2.Answer]:
    """The answers to the first `n` questions of `seed` that `engine` sampled (cached, or sampled by `sample` and
    cached), those of at least 2 tokens."""
    record = smollm2.gguf_import.read_import(smollm2.checkpoint_dir(data))
    cache = smollm2.AnswerCache(data / "cache" / "smollm2-answers", record.source_sha256, TEMPERATURE,
                                MAX_NEW_TOKENS, seed, engine=engine)
    start = time.perf_counter()
    questions = [q.text for q in arithmetic.questions(n, seed)]
    answers = cache.answers(sample, questions, on_chunk=lambda done, total: log(
        f"answers (seed {seed}, {engine}): chunk {done}/{total}, {time.perf_counter() - start:.0f} s"))
    return [a for a in answers if len(a.answer_ids) >= 2]


def token_counts(answers: list[smollm2.Answer], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for a in answers:
        counts += torch.bincount(torch.tensor(a.answer_ids), minlength=vocab_size)
    return counts


def data_vocab_size(counts: torch.Tensor, coverage: float = VOCAB_COVERAGE) -> int:
    """The fewest most-frequent tokens that cover `coverage` of the answer tokens."""
    ordered = torch.sort(counts, descending=True).values.double()
    share = ordered.cumsum(0) / ordered.sum()
    return int((share < coverage).sum()) + 1


def build_drafter(arm: Arm, target, counts: torch.Tensor) -> Eagle3Drafter:
    size = DEFAULT_VOCAB if arm.vocab == "default" else data_vocab_size(counts)
    drafter = drafters.fresh_drafter(DrafterConfig(kind="eagle3", draft_vocab_size=size), target, counts, seed=0)
    if arm.layer == "target":
        drafter.init_layer_from_target(target)
    if arm.head == "random":
        torch.nn.init.normal_(drafter.lm_head.weight, std=0.02)
    return drafter


def answer_rollouts(answers: list[smollm2.Answer]) -> list[Rollout]:
    """Each answer as a rollout (its prompt, then the answer as the response), sample ids `a0`, `a1`, ...: what a
    source of hidden states reads."""
    return [Rollout.from_prompt_and_response(f"a{i}", a.prompt_ids, a.answer_ids, 0.0, 0)
            for i, a in enumerate(answers)]


def forward_hidden_states(target, drafter: Eagle3Drafter, rollouts: list[Rollout]) -> Iterator[HiddenSample]:
    """The target's forward over `rollouts` (sources/extract.py), the layers `drafter` reads, batch by batch
    (longest first, not in the rollouts' order)."""
    return iter_hidden_states(target, rollouts, 0, tokens_per_batch=4096,
                              layer_ids=drafter.stored_layer_ids(target.config.num_hidden_layers))


def samples_from(drafter: Eagle3Drafter, num_layers: int, hidden: Iterable[HiddenSample]) -> list[Sample]:
    """`drafter`'s training samples of hidden-state records, from whichever source, in their order."""
    return [drafter.training_sample(h, num_layers) for h in hidden]


def training_samples(target, drafter: Eagle3Drafter, answers: list[smollm2.Answer]) -> list[Sample]:
    hidden = forward_hidden_states(target, drafter, answer_rollouts(answers))
    return samples_from(drafter, target.config.num_hidden_layers, hidden)


@torch.no_grad()
def held_out_set(target, layer_ids: list[int], answers: list[smollm2.Answer]) -> HeldOut:
    sequences, starts, prefixes, oracle = [], [], [], []
    for a in answers:
        sequence = torch.tensor(a.ids)
        s = round_starts(len(a.prompt_ids), len(sequence))
        if len(s):
            sequences.append(sequence)
            starts.append(s)
            prefixes.append(target_prefix(target, sequence, layer_ids))
            oracle += target_argmax_chain(target, sequence, s, K, TEMPERATURE).tau().tolist()
    return HeldOut(sequences, starts, prefixes, sum(oracle) / len(oracle))


@torch.no_grad()
def expected_tau(target, drafter, held_out: HeldOut, method: Literal["greedy", "probabilistic"] = "greedy",
                 temperature: float = TEMPERATURE) -> tuple[float, list[float]]:
    """Mean over every round start of the held-out answers: tau and the per-position acceptance, with
    vLLM's greedy drafting (exact) or its probabilistic drafting (one sampled chain per start, seeded)."""
    was_training = drafter.training
    drafter.eval()
    generator = torch.Generator().manual_seed(0)
    cumulative = torch.zeros(K, dtype=torch.float64)
    for sequence, starts, prefix in zip(held_out.sequences, held_out.starts, held_out.prefixes, strict=True):
        if method == "greedy":
            chain = drafter_chain(target, drafter, sequence, starts, K, temperature, prefix=prefix)
        else:
            chain = eagle3_sampled_chain(target, drafter, sequence, starts, K, temperature, generator, prefix=prefix)
        cumulative += torch.cumprod(chain.accept.double(), dim=1).sum(0)
    drafter.train(was_training)
    per_position = (cumulative / held_out.rounds).tolist()
    return 1 + sum(per_position), per_position


def train_config(arm: Arm, max_tokens: int) -> TrainConfig:
    """How an arm trains: `max_tokens` positions (the schedule's span), batches of 16 answers, seed 0."""
    return TrainConfig(epochs=1000, max_tokens=max_tokens, log_every=1, batch_size_per_gpu=16,
                       window_tokens=arm.window, optim=OptimConfig(lr=arm.lr, lr_warmup_steps=10), dtype="fp32",
                       seed=0)


def train_arm(arm: Arm, target, samples: list[Sample], counts: torch.Tensor, held_out: HeldOut, max_tokens: int,
              eval_every: int, minutes: float, out: Path, log) -> Curve:
    """Train one arm's drafter on `samples` (every arm reads the same target layers), measuring as it goes."""
    drafter = build_drafter(arm, target, counts)
    curve = Curve(arm, drafter.config.draft_vocab_size, len(samples), held_out.rounds, held_out.oracle_tau)
    curve.points.append(_point(target, drafter, held_out, 0, 0.0, float("nan")))
    log(f"{arm.name}: draft vocab {curve.draft_vocab_size}, {len(samples)} answers, tau at 0 tokens "
        f"{curve.points[0].tau:.3f}")
    cfg = train_config(arm, max_tokens)
    evaluated = {"tokens": 0, "eval_s": 0.0}
    start = time.perf_counter()

    def on_logged(metrics: IterationMetrics, tokens: int) -> None:
        if tokens - evaluated["tokens"] < eval_every:
            return
        train_s = time.perf_counter() - start - evaluated["eval_s"]
        eval_start = time.perf_counter()
        point = _point(target, drafter, held_out, tokens, train_s, metrics.loss)
        evaluated["eval_s"] += time.perf_counter() - eval_start
        evaluated["tokens"] = tokens
        curve.points.append(point)
        log(f"{arm.name}: {tokens} tokens, {train_s:.0f} s: loss {metrics.loss:.3f}, tau {point.tau:.3f} "
            f"({' '.join(f'{p:.2f}' for p in point.per_position)}), probabilistic {point.tau_probabilistic:.3f}")
        (out / arm.name).mkdir(parents=True, exist_ok=True)
        (out / arm.name / "curve.json").write_text(curve.to_json())
        if train_s > minutes * 60:
            raise _TimeUp

    try:
        result = train_drafter(drafter, InMemoryDataset(samples), cfg, teacher=drafter.teacher(target),
                               on_logged=on_logged)
        if curve.points[-1].tokens < result.tokens:  # the schedule ended between two evaluations
            curve.points.append(_point(target, drafter, held_out, result.tokens,
                                       time.perf_counter() - start - evaluated["eval_s"], result.loss))
    except _TimeUp:
        pass
    drafter.eval()
    save_drafter(drafter, out / arm.name / "drafter", target_forward.TargetMetadata.of(target.config))
    (out / arm.name / "curve.json").write_text(curve.to_json())
    return curve


def _point(target, drafter, held_out: HeldOut, tokens: int, train_s: float, loss: float) -> CurvePoint:
    tau, per_position = expected_tau(target, drafter, held_out, "greedy")
    sampled, _ = expected_tau(target, drafter, held_out, "probabilistic")
    return CurvePoint(tokens, train_s, loss, tau, per_position, sampled)


class _TimeUp(Exception):
    """The arm's training time is spent: raised from the loop's hook, ends the training."""


# What `make demo MODEL=smollm2` and `make bench` train when the first drafter is absent: the docs' recipe, its
# answers sampled by vLLM, 7 minutes of training on 2 cores, the curve measured every 100k positions (each
# measurement takes about a minute on 2 cores).
FIRST_DRAFTER = ("--engine", "vllm", "--answers", "1024", "--held-out", "32", "--minutes", "7",
                 "--max-tokens", "450000", "--eval-every", "100000")


class FirstDrafterError(RuntimeError):
    pass


def ensure_first_drafter(data: Path, drafter_dir: Path) -> Path:
    """`drafter_dir` (`<out>/first/drafter`), trained by this recipe in a process of its own when absent; its
    progress is the recipe's log, line by line."""
    if drafter_dir.is_dir():
        return drafter_dir
    if drafter_dir.parent.name != "first" or drafter_dir.name != "drafter":
        raise FirstDrafterError(f"no first drafter at {drafter_dir}; the recipe writes <out>/first/drafter: "
                                "python -m recipes.first_drafter train --engine vllm --out <out>")
    command = [sys.executable, "-m", "recipes.first_drafter", "train", *FIRST_DRAFTER, "--data", str(data),
               "--out", str(drafter_dir.parent.parent)]
    if subprocess.run(command, cwd=PROJECT_ROOT, check=False).returncode != 0 or not drafter_dir.is_dir():
        raise FirstDrafterError(f"the first drafter's recipe failed ({' '.join(command[1:])})")
    return drafter_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.first_drafter", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sample = commands.add_parser("sample", help="sample and cache the training and held-out answers")
    train = commands.add_parser("train", help="train arms of the ablation and write their learning curves")
    for p in (sample, train):
        p.add_argument("--answers", type=int, default=2048, help="training answers")
        p.add_argument("--held-out", type=int, default=32, help="held-out answers")
        p.add_argument("--data", type=Path, default=smollm2.DEFAULT_DATA)
        p.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                       help="what samples the answers: the policy here, or a vLLM replica of it (make vllm)")
    train.add_argument("--arm", action="append", choices=sorted(ARMS), help="arms to train (default: first)")
    train.add_argument("--minutes", type=float, default=20.0, help="training minutes per arm, evaluations excluded")
    train.add_argument("--max-tokens", type=int, default=2_000_000, help="positions the schedule spans")
    train.add_argument("--eval-every", type=int, default=20_000, help="positions between evaluations")
    train.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        sys.stdout.write(f"[{time.strftime('%H:%M:%S')}] {line}\n")
        sys.stdout.flush()

    directory = smollm2.prepare(args.data)
    target = target_lib.load_checkpoint(str(directory)).requires_grad_(False)
    tokenizer = smollm2.load_tokenizer(directory)
    with (on_demand(lambda: vllm_sampler(directory, tokenizer, args.data, log)) if args.engine == "vllm"
          else nullcontext(torch_sampler(target, tokenizer, smollm2.AnswerCache.chunk))) as sample:
        held_out = cached_answers(sample, args.engine, HELD_OUT_SEED, args.held_out, args.data, log)
        train = cached_answers(sample, args.engine, TRAIN_SEED, args.answers, args.data, log)
    tokens = sum(len(a.answer_ids) for a in train)
    log(f"{len(train)} training answers ({tokens} answer tokens), {len(held_out)} held out")
    if args.command == "sample":
        return
    names = args.arm or ["first"]
    counts = token_counts(train, target.config.vocab_size)
    samples = training_samples(target, build_drafter(ARMS[names[0]], target, counts), train)
    evaluation = held_out_set(target, _decode_layer_ids(target), held_out)
    log(f"features of {len(samples)} answers and {len(evaluation.sequences)} held out "
        f"({evaluation.rounds} rounds; the oracle greedy drafter's tau there {evaluation.oracle_tau:.3f})")
    for name in names:
        train_arm(ARMS[name], target, samples, counts, evaluation, args.max_tokens, args.eval_every, args.minutes,
                  args.out, log)


def _decode_layer_ids(target) -> list[int]:
    return list(drafters.aux_layer_ids(DrafterConfig(kind="eagle3"), target.config.num_hidden_layers))


if __name__ == "__main__":
    main()
