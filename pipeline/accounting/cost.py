"""What speculative decoding saves in rollout time: the cost model every saving figure comes from.

One speculative round of one sequence costs `f` drafter forwards and one target forward (the
target verifies the pending token and the k proposals in one pass), and yields `tau` tokens on
average:

    f        drafter forwards per round: k for an autoregressive drafter (EAGLE, EAGLE-3),
             1 for a parallel drafter (P-EAGLE proposes all k tokens in one forward)
    c        one drafter forward's time relative to one target decoding forward
    t        seconds of one target decoding forward, per generated token without a drafter

    seconds per generated token   plain: t            speculative: t * (1 + c * f) / tau
    speedup                       tau / (1 + c * f)
    saved seconds for N tokens    N * t * (1 - (1 + c * f) / tau)

A drafter whose tau is below 1 + c * f slows decoding down: its saving is negative, and the
ledger shows it as such rather than clipping it to zero. Verifying k + 1 positions costs about
one decoding forward while decoding is memory-bound, which is what rollout batches are; `t` and
`c` are measured on the same hardware and batch as the taus they are combined with (the
evaluation's own timings here, the fleet's vLLM counters in production).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class DecodingCost:
    """The timings the saving of a drafter rests on."""

    target_s_per_token: float  # t: one target decoding forward per generated token, without a drafter
    draft_cost_ratio: float  # c: one drafter forward / one target decoding forward
    drafter_forwards_per_round: int  # f: k (autoregressive) or 1 (parallel drafting)

    def __post_init__(self) -> None:
        if self.target_s_per_token <= 0 or self.draft_cost_ratio < 0 or self.drafter_forwards_per_round < 1:
            raise ValueError(f"a decoding cost needs t > 0, c >= 0 and f >= 1, got {self}")

    @property
    def round_cost(self) -> float:
        """One round in target forwards: 1 + c * f."""
        return 1.0 + self.draft_cost_ratio * self.drafter_forwards_per_round

    def speedup(self, tau: float) -> float:
        return tau / self.round_cost

    def seconds_per_token(self, tau: float) -> float:
        return self.target_s_per_token * self.round_cost / tau

    def saved_seconds(self, tau: float, tokens: int) -> float:
        """Rollout seconds `tokens` generated at `tau` save against plain decoding (negative: lost)."""
        return tokens * (self.target_s_per_token - self.seconds_per_token(tau))

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "target_s_per_token": self.target_s_per_token,
                "draft_cost_ratio": self.draft_cost_ratio,
                "drafter_forwards_per_round": self.drafter_forwards_per_round}

    @classmethod
    def from_json(cls, doc: dict) -> DecodingCost:
        if doc.get("schema_version", 1) != SCHEMA_VERSION:
            raise ValueError(f"decoding cost schema_version {doc.get('schema_version')} is not {SCHEMA_VERSION}")
        return cls(float(doc["target_s_per_token"]), float(doc["draft_cost_ratio"]),
                   int(doc["drafter_forwards_per_round"]))
