"""The built-in simulated RL source: a stand-in for an RL trainer, writing real steps.

The "task" is a synthetic language whose preferences drift over RL steps:

* Each context (the current token; with `context_order` > 1, plus a phase computed from the
  tokens before it) has a fixed set of `candidates` plausible next tokens. At step s one of them
  is the favourite, the others share the rest of the probability, each `tail_decay` of the one
  before (a real model's long tail of plausible tokens).
* Tokens are of two kinds, as in a real model's answers: after a near-certain one (a share
  1 - `open_share` of the vocabulary) the favourite has `closed_top1` and every candidate is an
  open token; after an open one the favourite has a level of `open_top1`. The per-token entropy
  and top-1 probability that result bound a drafter's acceptance under sampling; the defaults are
  a real model's (docs/operating.md, the demo's target and language).
* Every RL step, a share `drift` of the contexts gets a new favourite: what the
  reward asks for changes, so the policy changes, so a drafter trained on early steps
  goes stale (the effect this product exists to fix).

The policy is a tiny Llama built from a config, deep and narrow so that a drafter forward
costs a small share of its forward (as a drafter layer does of a deployment's policy), and
pre-trained on step 0's task (cached on disk; its next-token distributions follow the task's).
Each RL step applies reward-weighted regression (RWR: each sequence's loss weighted by
exp(reward / beta)) on sequences from the step's task, then samples rollouts from the updated
policy and writes them, with the policy checkpoint, in exactly the layout an external trainer
uses (see `pipeline/data/rollouts.py`).

Response lengths are lognormal (`response_len_sigma`; median `response_len_median` of the
longest, capped at `response_len`), as a reasoning step's are: most rollouts finish early
and a long tail holds the step. With `parts_per_step` > 1 the step is published in parts as
its rollouts finish (`pipeline/data/parts.py`): part i holds the rollouts whose length falls in
the i-th slice of the longest, and goes out once they have finished and the step's rollout window
has reached the slice's end (the longest rollout ends with the window). Then the step is committed.

Who decodes the rollouts: with a fleet (`engine`, injected where the source is composed: the step's
policy is pushed to every replica first, then each rollout is a request with its own seed and its
length as max_tokens), the fleet; without one (`fleet.driver: none`), the source itself, the batch
together, one token per forward.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaForCausalLM

from pipeline.config import SimulationConfig
from pipeline.data import parts as parts_lib
from pipeline.data.keys import policy_prefix
from pipeline.data.rollout_engine import RolloutEngine, RolloutRequest, request_seed
from pipeline.data.rollouts import PolicyPointer, Rollout, TargetLimits, write_rollouts
from pipeline.data.store import ObjectStore
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.sampling import SamplingParams

PHASES = 3
RWR_BETA = 0.1
BATCH = 6  # sequences per pre-training and RL iteration
PRETRAIN_LR = 1e-2
RL_LR = 5e-3
LANGUAGE = 3  # the version of the language and its pre-training, in the pre-trained target's cache key


class Task:
    """The drifting synthetic language. All randomness is seeded: same config, same task."""

    def __init__(self, cfg: SimulationConfig) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        self.phases = PHASES if cfg.context_order > 1 else 1
        self.num_contexts = cfg.vocab_size * self.phases
        self.open_tokens = torch.zeros(cfg.vocab_size, dtype=torch.bool)  # (V,) the tokens whose contexts are open
        self.open_tokens[torch.randperm(cfg.vocab_size, generator=g)[: round(cfg.open_share * cfg.vocab_size)]] = True
        self.candidates = torch.stack([self._candidates(c, g) for c in range(self.num_contexts)])  # (C, K)
        self.probs = candidate_probs(cfg, self.open_tokens.repeat_interleave(self.phases), g)  # (C, K) favourite first
        self._favourites = [torch.zeros(self.num_contexts, dtype=torch.int64)]
        self._drift_gen = torch.Generator().manual_seed(cfg.seed + 1)

    def _candidates(self, context: int, g: torch.Generator) -> torch.Tensor:
        """(K,) distinct candidate tokens of a context. A near-deterministic context's are open tokens while there are
        enough of them: a near-certain token leads to an open choice, as in text, never into a loop of near-certain
        tokens that would hold a sequence for dozens of tokens whatever favourites the drift gives them."""
        order = torch.randperm(self.cfg.vocab_size, generator=g)
        if not self.open_tokens[context // self.phases]:
            order = torch.cat([order[self.open_tokens[order]], order[~self.open_tokens[order]]])
        return order[: self.cfg.candidates]

    def favourite(self, step: int) -> torch.Tensor:
        """(C,) index into `candidates` of each context's favourite at `step`."""
        while len(self._favourites) <= step:
            prev = self._favourites[-1]
            moved = torch.rand(self.num_contexts, generator=self._drift_gen) < self.cfg.drift
            shift = torch.randint(1, self.cfg.candidates, (self.num_contexts,), generator=self._drift_gen)
            self._favourites.append(torch.where(moved, (prev + shift) % self.cfg.candidates, prev))
        return self._favourites[step]

    def next_token_probs(self, step: int) -> torch.Tensor:
        """(C, V) next-token distribution of every context at `step`."""
        fav = self.favourite(step)
        order = (fav[:, None] + torch.arange(self.cfg.candidates)) % self.cfg.candidates  # favourite first
        table = torch.zeros(self.num_contexts, self.cfg.vocab_size)
        table.scatter_(1, torch.gather(self.candidates, 1, order), self.probs)
        return table

    def context_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) tokens -> (B, T) context id that decides the token after each position."""
        order = self.cfg.context_order
        padded = F.pad(tokens, (order - 1, 0))
        phase = torch.zeros_like(tokens)
        for lag in range(1, order):
            phase = phase + padded[:, order - 1 - lag : padded.shape[1] - lag]
        return tokens * self.phases + phase % self.phases

    def sample(self, step: int, n: int, length: int, g: torch.Generator) -> torch.Tensor:
        """(n, length) sequences drawn from the step's task, all n a token at a time."""
        table = self.next_token_probs(step)
        seqs = torch.empty(n, length, dtype=torch.int64)
        seqs[:, 0] = torch.randint(self.cfg.vocab_size, (n,), generator=g)
        for t in range(1, length):
            window = seqs[:, max(0, t - self.cfg.context_order) : t]
            ctx = self.context_ids(window)[:, -1]  # the last token's context alone
            seqs[:, t] = torch.multinomial(table[ctx], 1, generator=g)[:, 0]
        return seqs

    def targets(self, step: int, seqs: torch.Tensor) -> torch.Tensor:
        """(n, T) sequences -> (n, T-1, V) the step's next-token distribution after each position but the last."""
        return self.next_token_probs(step)[self.context_ids(seqs)[:, :-1]]

    def rewards(self, step: int, seqs: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """(n,) share of response tokens that are the step's favourite for their context."""
        fav_tokens = torch.gather(self.candidates, 1, self.favourite(step)[:, None]).squeeze(1)  # (C,)
        wanted = fav_tokens[self.context_ids(seqs)[:, :-1]]  # (n, T-1) favourite next token
        hits = (seqs[:, 1:] == wanted)[:, prompt_len - 1 :]
        return hits.float().mean(dim=1)


def candidate_probs(cfg: SimulationConfig, is_open: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """(C, K) each context's next-token probabilities over its candidates, favourite first: `closed_top1` for a
    near-deterministic context, for an open one (is_open (C,)) a level of `open_top1`'s range; each candidate after
    the favourite takes `tail_decay` of the one before. The levels are evenly spaced over the range (strata, not
    independent draws), so that a few dozen contexts already spread over it as the range says; which context gets
    which is drawn with `g`."""
    low, high = cfg.open_top1
    num_open = int(is_open.sum())
    top1 = torch.full(is_open.shape, cfg.closed_top1)  # (C,)
    levels = low + (high - low) * (torch.arange(num_open) + 0.5) / max(1, num_open)  # (open,)
    top1[is_open] = levels[torch.randperm(num_open, generator=g)]
    rest = cfg.tail_decay ** torch.arange(cfg.candidates - 1, dtype=torch.float32)
    rest = rest / rest.sum()  # (K-1,)
    return torch.cat([top1[:, None], (1 - top1)[:, None] * rest], dim=1)


@dataclass(frozen=True)
class _Batch:
    """A batch of the policy's fine-tuning: sequences of the task, the task's next-token distribution after each of
    their positions, and each sequence's weight."""

    tokens: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, T-1, V)
    weights: torch.Tensor  # (B,)


def _finetune(model: LlamaForCausalLM, batches: Callable[[int], _Batch], iters: int, lr: float) -> None:
    """Weighted cross-entropy against the task's next-token distributions: the expected NLL of the next token
    given each position's context, which the sampled token's NLL estimates with far more noise. The learning rate
    warms up over the first tenth of the iterations, then decays to zero (cosine): few iterations at a high rate."""
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    warmup = max(1, iters // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * i / iters)))
    for i in range(iters):
        batch = batches(i)
        logp = model(input_ids=batch.tokens).logits[:, :-1].log_softmax(dim=-1)  # (B, T-1, V)
        ce = -(batch.targets * logp).sum(dim=-1).mean(dim=1)  # (B,)
        loss = (batch.weights * ce).sum() / batch.weights.sum()
        optim.zero_grad()
        loss.backward()
        optim.step()
        schedule.step()
    model.eval()


def pretrain(model: LlamaForCausalLM, task: Task, iters: int, seq_len: int, g: torch.Generator) -> None:
    """`model` fitted to step 0's language in `iters` iterations of BATCH sequences; every iteration's sequences
    are drawn at once, so the task's per-token loop runs once, over all of them."""
    pool = task.sample(0, iters * BATCH, seq_len, g)  # (iters * B, T)

    def batch(i: int) -> _Batch:
        seqs = pool[i * BATCH : (i + 1) * BATCH]
        return _Batch(seqs, task.targets(0, seqs), torch.ones(BATCH))

    _finetune(model, batch, iters, lr=PRETRAIN_LR)


@dataclass
class _Prepared:
    """An RL update computed ahead, in a background thread: its policy and generator once done."""

    step: int
    thread: threading.Thread | None = None
    result: tuple[LlamaForCausalLM, torch.Generator] | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class GeneratedStep:
    """A simulated step's policy (written) and rollouts (not yet)."""

    step: int
    pointer: PolicyPointer
    rollouts: list[Rollout]
    limits: TargetLimits


OnPart = Callable[[GeneratedStep, int, list[Rollout]], None]


class SimulatedRL:
    """Writes RL steps 1, 2, ... of a simulated run into the store (the external-trainer layout)."""

    def __init__(self, cfg: SimulationConfig, store: ObjectStore, run: str, cache_dir: Path,
                 engine: RolloutEngine | None = None) -> None:
        self.cfg, self.store, self.run, self.engine = cfg, store, run, engine
        self.task = Task(cfg)
        self.cache_dir = cache_dir
        self.seq_len = cfg.prompt_len + cfg.response_len
        self._prepared: _Prepared | None = None

    def _cache_path(self) -> Path:
        # Only what shapes pre-training goes into the key: tuning RL knobs keeps the cache. LANGUAGE names how the
        # config becomes a language and a pre-training: a change to either gives the cache a new key.
        pretrain = self.cfg.model_dump(
            exclude={"drift", "rl_iters", "rollouts_per_step", "temperature", "step_period_s", "response_len_median",
                     "response_len_sigma", "parts_per_step"}) | {"language": LANGUAGE}
        digest = hashlib.sha256(json.dumps(pretrain, sort_keys=True).encode()).hexdigest()[:12]
        return self.cache_dir / f"pretrained-target-{digest}"

    def pretrained(self) -> LlamaForCausalLM:
        """The step-0 policy, pre-trained once per simulation config and cached."""
        path = self._cache_path()
        if (path / "model.safetensors").exists():
            return target_lib.load_checkpoint(path.as_uri())
        cfg = self.cfg
        model = target_lib.build_target(
            target_lib.tiny_llama_config(cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads), cfg.seed
        )
        pretrain(model, self.task, cfg.pretrain_iters, self.seq_len, torch.Generator().manual_seed(cfg.seed))
        path.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
        return model

    def policy(self, step: int) -> LlamaForCausalLM:
        if step == 0:
            return self.pretrained()
        # A model of its own (not the process's shared policy): run_step fine-tunes it in place.
        return target_lib.load_checkpoint(self.store.uri(policy_prefix(self.run, step)), store=self.store)

    def run_step(self, step: int, period_s: float = 0.0, prepare_next: bool = False) -> PolicyPointer:
        """The policy of step (the RL update of step-1's toward step's task), then step's rollouts written:
        whole, or in `parts_per_step` parts as they finish, the decoding paced to end at
        `ROLLOUT_SHARE_OF_PERIOD` of `period_s` after the step began (0: as fast as it runs). With `prepare_next`,
        the update toward step+1 is computed while step's rollouts decode (`generate_step`)."""
        window_end = time.monotonic() + period_s * ROLLOUT_SHARE_OF_PERIOD
        if self.cfg.parts_per_step == 1:
            generated = self.generate_step(step, prepare_next=prepare_next)
            write_rollouts(self.store, self.run, step, generated.rollouts, generated.pointer)
            return generated.pointer
        generated = self.generate_step(step, self._write_part, window_end, prepare_next)
        parts_lib.commit_parts(self.store, self.run, step)
        return generated.pointer

    def generate_step(self, step: int, on_part: OnPart | None = None, window_end: float = 0.0,
                      prepare_next: bool = False) -> GeneratedStep:
        """The RL update of step (its checkpoint written: the step's pointer) and its rollouts; `on_part` is
        handed each part as the decoding finishes it, paced to end at `window_end` (time.monotonic()).

        With `prepare_next`, the update toward step+1 runs in a background thread while step's rollouts decode,
        on a copy of step's policy, as a trainer's update follows its rollouts: it reads the task, not the
        rollouts, so it may start with them, and step+1 then begins with its policy ready (the same weights and
        generator state as computing it then: the same rollouts). Its checkpoint is written when step+1 begins."""
        if step < 1:
            raise ValueError(f"simulated RL steps start at 1, got {step}")
        model, g = self._take_prepared(step) or self._rl_update(step, self.policy(step - 1))
        checkpoint_uri = target_lib.save_checkpoint(model, self.store, policy_prefix(self.run, step))
        pointer = PolicyPointer(policy_version=step, checkpoint_uri=checkpoint_uri,
                                model_id=target_forward.model_id(model),
                                sampling=SamplingParams(temperature=self.cfg.temperature))
        if prepare_next:
            self._prepare(step + 1, copy.deepcopy(model))
        generated = GeneratedStep(step, pointer, [], TargetLimits.of(model.config))
        finished = None if on_part is None else (lambda part, rows: on_part(generated, part, rows))
        if self.engine is not None:  # every replica serves the step's policy before its first request
            self.engine.push_policy(step, checkpoint_uri)
        generated.rollouts.extend(self.generate_rollouts(model, step, g, finished, window_end))
        return generated

    def _rl_update(self, step: int, model: LlamaForCausalLM) -> tuple[LlamaForCausalLM, torch.Generator]:
        """`model` (step-1's policy) updated in place by RWR toward step's task; the step's generator, which
        then samples its rollouts."""
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1000 + step)

        pool = self.task.sample(step, cfg.rl_iters * BATCH, self.seq_len, g)  # (iters * B, T)

        def rwr_batch(i: int) -> _Batch:
            seqs = pool[i * BATCH : (i + 1) * BATCH]
            reward = self.task.rewards(step, seqs, cfg.prompt_len)
            return _Batch(seqs, self.task.targets(step, seqs), torch.exp((reward - reward.max()) / RWR_BETA))

        _finetune(model, rwr_batch, cfg.rl_iters, lr=RL_LR)
        return model, g

    def _prepare(self, step: int, model: LlamaForCausalLM) -> None:
        """Start the update toward `step` from `model` (a copy of step-1's policy) in a background thread."""
        prepared = _Prepared(step)

        def update() -> None:
            try:
                prepared.result = self._rl_update(step, model)
            except BaseException as exc:  # noqa: BLE001 - raised where the step takes its policy
                prepared.error = exc

        prepared.thread = threading.Thread(target=update, name=f"rl-update-{step}", daemon=True)
        prepared.thread.start()
        self._prepared = prepared

    def _take_prepared(self, step: int) -> tuple[LlamaForCausalLM, torch.Generator] | None:
        """The update toward `step` a previous step started, once it is done; None when none was started."""
        prepared, self._prepared = self._prepared, None
        if prepared is None or prepared.step != step:
            return None
        prepared.thread.join()
        if prepared.error is not None:
            raise RuntimeError(f"the RL update toward step {step} failed") from prepared.error
        return prepared.result

    def _write_part(self, generated: GeneratedStep, part: int, rows: list[Rollout]) -> None:
        parts_lib.write_part(self.store, self.run, generated.step, part, rows, generated.pointer,
                             self.cfg.rollouts_per_step, generated.limits, time.time())

    def publish_parts(self, generated: GeneratedStep, only: set[int] | None = None) -> list[int]:
        """Write the step's parts at once (`only`: these parts alone); returns the parts written (an empty slice
        of the decoding is no part)."""
        written = []
        for part, finished in enumerate(finish_parts(generated.rollouts, self.cfg.parts_per_step)):
            if finished and (only is None or part in only):
                self._write_part(generated, part, finished)
                written.append(part)
        return written

    def response_lengths(self, n: int, g: torch.Generator) -> list[int]:
        """n response lengths: lognormal around the median share of `response_len`, capped at it."""
        cfg = self.cfg
        if cfg.response_len_sigma == 0:
            return [cfg.response_len] * n
        median = math.log(cfg.response_len_median * cfg.response_len)
        normal = torch.randn(n, generator=g, dtype=torch.float64)
        return [max(1, min(cfg.response_len, round(math.exp(median + cfg.response_len_sigma * float(z)))))
                for z in normal]

    def _rollout(self, step: int, i: int, seq: torch.Tensor) -> Rollout:
        """Rollout i of `step`: seq (1, P + T) its prompt and response."""
        prompt_len = self.cfg.prompt_len
        reward = float(self.task.rewards(step, seq, prompt_len)[0])
        mask = [0] * prompt_len + [1] * (seq.shape[1] - prompt_len)
        return Rollout(f"s{step:06d}-{i:05d}", seq[0].tolist(), mask, reward, step)

    def generate_rollouts(self, model: LlamaForCausalLM, step: int, g: torch.Generator,
                          on_part: Callable[[int, list[Rollout]], None] | None = None,
                          window_end: float = 0.0) -> list[Rollout]:
        """The step's rollouts, by the fleet when the source has one, else decoded here together; with `on_part`,
        each part (`finish_parts`) is handed over once its rollouts have finished and the rollout window (which
        ends at `window_end`, time.monotonic()) has reached the part's slice."""
        cfg = self.cfg
        prompts = self.task.sample(step, cfg.rollouts_per_step, cfg.prompt_len, g)  # (N, P)
        lengths = self.response_lengths(cfg.rollouts_per_step, g)
        if self.engine is not None:
            return self._fleet_rollouts(step, prompts, lengths, on_part, window_end)
        return self._decoded_rollouts(model, step, g, prompts, lengths, on_part, window_end)

    def _fleet_rollouts(self, step: int, prompts: torch.Tensor, lengths: list[int],
                        on_part: Callable[[int, list[Rollout]], None] | None, window_end: float) -> list[Rollout]:
        """Each rollout one request to the fleet (its length as max_tokens, its own seed); part p goes out once its
        rollouts have come back and the window has reached its slice, the parts in order."""
        cfg = self.cfg
        longest, parts = max(lengths), cfg.parts_per_step
        params = SamplingParams(temperature=cfg.temperature)
        requests = [RolloutRequest(prompts[i].tolist(), n, params, request_seed(self.cfg.seed, step, i))
                    for i, n in enumerate(lengths)]
        members = [part_of(n, longest, parts) for n in lengths]
        waiting = [members.count(p) for p in range(parts)]
        rollouts: list[Rollout | None] = [None] * len(lengths)
        started, published = time.monotonic(), 0
        for i, generated in self.engine.generate(requests):
            if len(generated.token_ids) != lengths[i]:
                raise RuntimeError(f"the fleet returned {len(generated.token_ids)} tokens for rollout {i} of step "
                                   f"{step}, asked {lengths[i]}")
            rollouts[i] = self._rollout(step, i, torch.cat([prompts[i], torch.tensor(generated.token_ids)])[None])
            waiting[members[i]] -= 1
            while on_part is not None and published < parts and waiting[published] == 0:
                wait = started + (published + 1) / parts * max(0.0, window_end - started) - time.monotonic()
                if wait > 0:
                    time.sleep(wait)  # the rollout engine's pace: the longest rollout ends with the window
                done = [rollouts[j] for j, p in enumerate(members) if p == published]
                if done:
                    on_part(published, done)
                published += 1
        return rollouts

    @torch.no_grad()
    def _decoded_rollouts(self, model: LlamaForCausalLM, step: int, g: torch.Generator, prompts: torch.Tensor,
                          lengths: list[int], on_part: Callable[[int, list[Rollout]], None] | None,
                          window_end: float) -> list[Rollout]:
        """The rollouts decoded here, together, one token per forward, paced to end at `window_end`."""
        cfg = self.cfg
        longest, parts = max(lengths), cfg.parts_per_step
        closing: dict[int, list[int]] = {}  # decode step -> the parts it closes
        for p in range(parts):
            closing.setdefault(math.ceil((p + 1) / parts * longest), []).append(p)
        seqs, started = prompts, time.monotonic()
        rollouts: list[Rollout | None] = [None] * len(lengths)
        # The key/value cache: one new column per forward rather than the whole sequence again (the same tokens,
        # at a twentieth of the CPU the source takes from the pipeline it stands beside).
        cache = DynamicCache()
        logits = model(input_ids=seqs, cache=cache, use_cache=True).logits[:, -1]  # (N, V) after the prompts
        for t in range(1, longest + 1):  # sampling with our generator keeps steps reproducible
            seqs = torch.cat([seqs, torch.multinomial((logits / cfg.temperature).softmax(-1), 1, generator=g)], dim=1)
            if t < longest:
                logits = model(input_ids=seqs[:, -1:], cache=cache, use_cache=True).logits[:, -1]  # (N, V)
            for i in [i for i, length in enumerate(lengths) if length == t]:  # each response ends at its length
                rollouts[i] = self._rollout(step, i, seqs[i : i + 1])  # (1, P + t)
            if on_part is None or t not in closing:
                continue
            wait = started + t / longest * max(0.0, window_end - started) - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the rollout engine's pace: the longest rollout ends with the window
            for part in closing[t]:
                done = [r for r in rollouts if r is not None and part_of(sum(r.loss_mask), longest, parts) == part]
                if done:
                    on_part(part, done)
        return rollouts


ROLLOUT_SHARE_OF_PERIOD = 0.85  # a reasoning RL step's rollouts; the rest of its period is the trainer's update


def part_of(length: int, longest: int, parts: int) -> int:
    """The slice of the decoding (of `parts` equal ones) in which a response of `length` tokens ends."""
    return max(0, math.ceil(length / longest * parts) - 1)


def finish_parts(rollouts: list[Rollout], parts: int) -> list[list[Rollout]]:
    """The rollouts finished in each of `parts` equal slices of the decoding: a response ends at the decode step
    of its length (the longest at the last). Empty slices stay empty."""
    longest = max(sum(r.loss_mask) for r in rollouts)
    slices: list[list[Rollout]] = [[] for _ in range(parts)]
    for r in rollouts:
        slices[part_of(sum(r.loss_mask), longest, parts)].append(r)
    return slices
