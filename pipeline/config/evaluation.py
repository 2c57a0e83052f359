"""`eval` and `promotion`: how a step's drafters are measured, at which sampling parameters, and when a new one
becomes the champion."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.section import Section
from pipeline.sampling import SamplingParams


class SamplingConfig(Section):
    """Sampling parameters as vLLM's requests name them."""

    temperature: float = Field(default=1.0, ge=0, le=100, description="0: greedy decoding.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus: the most likely tokens up to this mass.")
    top_k: int = Field(default=0, ge=-1, description="The k most likely tokens; 0 or -1: all.")

    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


class EvalConfig(Section):
    """How the `acceptance` stage measures the step's drafters (its ranks and pod: `launch.evaluation`)."""

    num_speculative_tokens: int = Field(default=4, ge=1, description="k: tokens the drafter proposes per round.")
    max_new_tokens: int = Field(
        default=40, ge=2, description="Tokens generated per held-out prompt: 2 at least, as the first is the "
        "prefill's and only the later ones come from speculative rounds, whose acceptance is measured.",
    )
    num_prompts: int = Field(default=24, ge=1, description="Held-out prompts evaluated per step.")
    estimate_chunk_tokens: int = Field(
        default=512, ge=1, description="Columns of the held-out rollouts the teacher-forced acceptance estimate runs "
        "through the target and the drafter at once: its logits, layers and attention scores are a chunk's, not a "
        "rollout's, so its memory stays bounded by this (and its cost per token flat) whatever the rollouts' length.",
    )
    replay: bool = Field(
        default=True, description="Replay the step's rollouts after it, once without a drafter and once with each of "
        "the baseline, served and co-trained drafters (the same requests and seeds): the measured rollout speedup; "
        "the ledger's saving is the served drafter's measured seconds.",
    )
    replay_runs: int = Field(
        default=3, ge=1, description="Runs of each replay arm, taking turns: each arm's fastest is its figure, every "
        "run's seconds its spread.",
    )
    replay_max_requests: int = Field(
        default=256, ge=1, description="The replay decodes the step's first rollouts, one replica's share of them "
        "(the batch each replica decoded), at most this many.",
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig,
        description="The rollouts' sampling parameters where a step's policy.json does not name them: tau is "
                    "measured at the rollouts' own (and greedily beside them).",
    )
    held_out_fraction: float = Field(
        default=0.125, gt=0, lt=1, description="Share of each step's rollouts kept out of training for evaluation."
    )
    draft_cost_ratio: float = Field(
        default=0.0, ge=0,
        description="c the cost ledger and the `cost` schedule price a drafter forward at, in target forwards: "
                    "the fleet's where the evaluation runs on other hardware (0.078: an H100, docs/storage.md); "
                    "0 = as the evaluation timed it.",
    )

    def rollout_sampling(self, recorded: SamplingParams | None) -> SamplingParams:
        """The parameters a step's taus are measured at: those its trainer recorded, else `eval.sampling`."""
        return recorded or self.sampling.params()


class PromotionConfig(Section):
    policy: Literal["auto", "manual"] = Field(default="auto", description="Who moves the `champion` alias.")
    margin: float = Field(default=0.02, ge=0, description="Promote when new tau > champion tau + margin.")
