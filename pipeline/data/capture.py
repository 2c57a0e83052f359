"""The capture plan of one RL step: which rollouts' hidden states are stored, and which of their tokens.

Decided from the rollouts alone, before any forward pass, and stored with the step:

    capture/<run>/step-000123.json     the plan (CapturePlan.to_json)

Which rollouts: the held-out ones never (evaluation reads them); of the others at most
`capture.max_samples`, and at most `capture.max_tokens` stored tokens, chosen by sample id
alone (the same plan on every rerun) and stratified, so that long and short rollouts, and
high and low rewards, keep their share of the step:

    strata     length quartile x reward above/below the step's median (8 strata)
    order      each stratum in the order of its ids' hashes; a stratum's i-th of n is
               ranked at (i + 0.5) / n, so every prefix of the merged order holds each
               stratum in proportion to its size
    budget     the merged order is taken while it fits both budgets, exactly

Which tokens: only the sample's training window (`window_bounds`, the window drafter training
reads: at most `train.window_tokens` tokens, the response end inside), with its offset in the
rollout. A forward pass runs over the tokens up to the window's end only: causal attention
makes those states the states of the whole rollout's forward.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pipeline.data.held_out import is_held_out
from pipeline.data.keys import capture_plan_key

if TYPE_CHECKING:
    from pipeline.data.rollouts import Rollout
    from pipeline.data.store import ObjectStore

SCHEMA_VERSION = 1
LENGTH_STRATA = 4  # length quartiles
REWARD_STRATA = 2  # at or below / above the step's median reward


class CapturePlanError(ValueError):
    """A stored capture plan that cannot be read; the message names the field."""


def window_bounds(loss_mask: torch.Tensor, window_tokens: int) -> tuple[int, int]:
    """[start, end) of the training window of one sample: at most `window_tokens` tokens starting at
    the response start; when the response end does not fit, the window moves so that it is inside.

    A window of a window is itself: a sample stored as its window trains as the whole sample did."""
    full_len = int(loss_mask.shape[0])
    span = min(full_len, window_tokens)
    response = torch.nonzero(loss_mask).flatten()
    if response.numel() == 0:
        return full_len - span, full_len
    resp_start, resp_end = int(response[0]), int(response[-1]) + 1
    start = max(0, min(resp_start, full_len - span))
    if resp_end - start > span:
        start = resp_end - span
    return start, start + span


@dataclass(frozen=True)
class CapturedSample:
    """One rollout the step stores: its tokens [start, end) of its `tokens`."""

    sample_id: str
    start: int  # position offset of the stored window in the rollout
    end: int
    tokens: int  # the rollout's length

    @property
    def stored(self) -> int:
        return self.end - self.start

    def to_json(self) -> list:
        return [self.sample_id, self.start, self.end, self.tokens]

    @classmethod
    def from_json(cls, value: object) -> CapturedSample:
        if not (isinstance(value, list) and len(value) == 4 and isinstance(value[0], str)
                and all(isinstance(v, int) for v in value[1:]) and 0 <= value[1] < value[2] <= value[3]):
            raise CapturePlanError(f"capture plan sample {value!r} is not [sample_id, start, end, tokens]")
        return cls(*value)


@dataclass(frozen=True)
class CapturePlan:
    step: int
    window_tokens: int
    max_samples: int  # 0: no limit
    max_tokens: int  # stored tokens; 0: no limit
    published: int  # rollouts the trainer published
    published_tokens: int
    held_out: int  # rollouts kept for evaluation, never captured
    samples: tuple[CapturedSample, ...]  # in the rollouts' order
    schema_version: int = SCHEMA_VERSION

    @property
    def captured(self) -> int:
        return len(self.samples)

    @property
    def stored_tokens(self) -> int:
        return sum(s.stored for s in self.samples)

    @property
    def forwarded_tokens(self) -> int:
        """Tokens a forward pass runs over: each captured rollout up to its window's end."""
        return sum(s.end for s in self.samples)

    def bounds(self) -> dict[str, tuple[int, int]]:
        return {s.sample_id: (s.start, s.end) for s in self.samples}

    def summary(self) -> dict[str, int]:
        """What an operator reads in the asset's metadata."""
        return {"rollouts_published": self.published, "rollouts_held_out": self.held_out,
                "rollouts_captured": self.captured, "tokens_published": self.published_tokens,
                "tokens_forwarded": self.forwarded_tokens, "tokens_stored": self.stored_tokens}

    def to_json(self) -> dict:
        return {"schema_version": self.schema_version, "step": self.step, "window_tokens": self.window_tokens,
                "max_samples": self.max_samples, "max_tokens": self.max_tokens, "published": self.published,
                "published_tokens": self.published_tokens, "held_out": self.held_out,
                "samples": [s.to_json() for s in self.samples]}

    @classmethod
    def from_json(cls, data: object) -> CapturePlan:
        if not isinstance(data, dict):
            raise CapturePlanError("capture plan is not a JSON object")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise CapturePlanError(f"capture plan schema_version {data.get('schema_version')!r}, "
                                   f"expected {SCHEMA_VERSION}")
        fields = ("step", "window_tokens", "max_samples", "max_tokens", "published", "published_tokens", "held_out")
        for name in fields:
            if not isinstance(data.get(name), int):
                raise CapturePlanError(f"capture plan field {name} is missing or not an integer")
        if not isinstance(data.get("samples"), list):
            raise CapturePlanError("capture plan field samples is missing or not a list")
        return cls(**{name: data[name] for name in fields},
                   samples=tuple(CapturedSample.from_json(s) for s in data["samples"]))


def _id_hash(sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=8).digest(), "big")


def _strata(candidates: list[Rollout]) -> list[int]:
    """Stratum of each candidate: its length quartile x whether its reward is above the median."""
    lengths = sorted(len(r.input_ids) for r in candidates)
    rewards = sorted(r.reward for r in candidates)
    median_reward = rewards[(len(rewards) - 1) // 2]
    cuts = [lengths[min(len(lengths) - 1, (q * len(lengths)) // LENGTH_STRATA)] for q in range(1, LENGTH_STRATA)]
    return [sum(len(r.input_ids) >= c for c in cuts) * REWARD_STRATA + int(r.reward > median_reward)
            for r in candidates]


def stratified_order(candidates: list[Rollout]) -> list[int]:
    """Indices into `candidates` in capture order: any prefix holds each stratum in proportion."""
    by_stratum: dict[int, list[int]] = {}
    for i, stratum in enumerate(_strata(candidates)):
        by_stratum.setdefault(stratum, []).append(i)
    ranked: list[tuple[float, int, int]] = []
    for members in by_stratum.values():
        members.sort(key=lambda i: (_id_hash(candidates[i].sample_id), candidates[i].sample_id))
        n = len(members)
        ranked += [((k + 0.5) / n, _id_hash(candidates[i].sample_id), i) for k, i in enumerate(members)]
    return [i for _, _, i in sorted(ranked)]


def plan_capture(rollouts: list[Rollout], step: int, *, held_out_fraction: float, window_tokens: int,
                 max_samples: int = 0, max_tokens: int = 0) -> CapturePlan:
    """The step's capture plan (see the module doc); 0 for a budget means no limit."""
    if window_tokens < 2 or max_samples < 0 or max_tokens < 0:
        raise ValueError("window_tokens must be >= 2, max_samples and max_tokens >= 0")
    candidates = [r for r in rollouts if not is_held_out(r.sample_id, held_out_fraction)]
    windows = [window_bounds(torch.tensor(r.loss_mask), window_tokens) for r in candidates]
    chosen: set[int] = set()
    stored = 0
    for i in stratified_order(candidates) if candidates else []:
        if max_samples and len(chosen) == max_samples:
            break
        span = windows[i][1] - windows[i][0]
        if max_tokens and stored + span > max_tokens:
            break  # stopping here (not skipping to a shorter one) keeps the long tail's share
        chosen.add(i)
        stored += span
    return CapturePlan(
        step=step, window_tokens=window_tokens, max_samples=max_samples, max_tokens=max_tokens,
        published=len(rollouts), published_tokens=sum(len(r.input_ids) for r in rollouts),
        held_out=len(rollouts) - len(candidates),
        samples=tuple(CapturedSample(candidates[i].sample_id, *windows[i], len(candidates[i].input_ids))
                      for i in sorted(chosen)),
    )



def write_plan(store: ObjectStore, run: str, plan: CapturePlan) -> None:
    store.write_json(capture_plan_key(run, plan.step), plan.to_json())


def read_plan(store: ObjectStore, run: str, step: int) -> CapturePlan | None:
    """The step's stored plan; None for a step captured before plans were stored."""
    key = capture_plan_key(run, step)
    return CapturePlan.from_json(store.read_json(key)) if store.exists(key) else None
