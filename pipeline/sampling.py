"""How a step's rollouts were sampled: the request parameters every tau of the step is measured at.

A drafter's acceptance depends on how the target samples: vLLM verifies a draft token at
temperature > 0 with the target's probability of it, so a drafter that matches the target's
argmax every time still loses most of its drafts where the target's distribution is flat. The
tau that prices a drafter is the one at the rollouts' own parameters, so they travel with the
step: the trainer names them in policy.json and every acceptance record says which it used.

    policy.json  {..., "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0}}   (optional)

The names and meanings are vLLM's `SamplingParams`: `temperature` 0 is greedy decoding (vLLM
treats anything below 1e-5 as 0), `top_p` in (0, 1] keeps the smallest set of most likely
tokens whose probability reaches it, `top_k` keeps the k most likely (0 or -1: every token).

The sampler computes in float32, so `temperature` and `top_p` are checked as the float32 they become there:
a `top_p` of 1e-300 is a valid float64 and 0 in float32, where no token would reach it.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Literal, get_args

GREEDY_EPSILON = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it decodes greedily
MAX_TEMPERATURE = 100.0
FIELDS = ("temperature", "top_p", "top_k")

# How the drafter chooses its tokens, vLLM's `draft_sample_method`: "greedy" proposes the drafter's argmax (the
# target accepts it with its own probability of it); "probabilistic" samples the drafter's distribution at the
# request's parameters (the target accepts with min(1, p / q)).
DraftSampleMethod = Literal["greedy", "probabilistic"]
DRAFT_SAMPLE_METHODS: tuple[str, ...] = get_args(DraftSampleMethod)


class SamplingError(ValueError):
    """Sampling parameters this pipeline cannot decode with; the message names where they came from and the field."""


def check(doc: Any, where: str) -> None:
    """A `sampling` object as policy.json or a request holds it: known keys, finite numbers in range."""
    if not isinstance(doc, dict):
        raise SamplingError(f"{where}: sampling must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise SamplingError(f"{where}: sampling has unknown key(s) {', '.join(map(repr, unknown[:5]))} "
                            f"(known: {', '.join(FIELDS)})")
    temperature, top_p = (as_float32(doc.get(name, 1.0)) for name in ("temperature", "top_p"))
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is None:
            raise SamplingError(f"{where}: field sampling.{name} must be a finite number (in float32, as the "
                                "sampler uses it)")
    top_k = doc.get("top_k", 0)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not -1 <= top_k < 2**31:
        raise SamplingError(f"{where}: field sampling.top_k must be an integer >= -1 (0 or -1: off)")
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise SamplingError(f"{where}: field sampling.temperature must be in [0, {MAX_TEMPERATURE:g}]")
    if not 0 < top_p <= 1:
        raise SamplingError(f"{where}: field sampling.top_p must be in (0, 1] in float32, as the sampler uses it "
                            "(below about 1.4e-45 it is 0 there)")


def as_float32(value: Any) -> float | None:
    """`value` rounded to the float32 the sampler computes with; None when it is no finite number there: not a
    number, a bool, or beyond float32's range (an integer of hundreds of digits included, which float() and
    math.isfinite refuse with OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        rounded = struct.unpack("<f", struct.pack("<f", float(value)))[0]
    except OverflowError:
        return None
    return rounded if math.isfinite(rounded) else None


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k

    def __post_init__(self) -> None:
        check(self.to_json(), "sampling parameters")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def label(self) -> str:
        """How reports name them: `greedy`, `T=1.0`, `T=0.7 top_p=0.9 top_k=50`."""
        if self.greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        if self.top_p < 1.0:
            parts.append(f"top_p={self.top_p:g}")
        if self.top_k > 0:
            parts.append(f"top_k={self.top_k}")
        return " ".join(parts)

    def to_json(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> SamplingParams:
        """Parameters read from a document another party wrote; SamplingError naming `where` and the field."""
        check(doc, where)
        return cls(float(doc.get("temperature", 1.0)), float(doc.get("top_p", 1.0)), int(doc.get("top_k", 0)))


GREEDY = SamplingParams(temperature=0.0)
