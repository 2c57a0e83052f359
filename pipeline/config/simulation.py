"""`simulation`: the built-in simulated RL source, its task family and its pace."""

from __future__ import annotations

from pydantic import Field, model_validator

from pipeline.config.section import Section


class SimulationConfig(Section):
    """The built-in simulated RL source (embedded default rollout source)."""

    vocab_size: int = Field(default=64, ge=8, description="Target vocabulary size.")
    hidden_size: int = Field(default=32, ge=8, description="Target hidden size.")
    num_layers: int = Field(default=24, ge=1, description="Target decoder layers.")
    num_heads: int = Field(default=4, ge=1, description="Target attention heads.")
    context_order: int = Field(default=1, ge=1, description="Tokens of context the task's rule reads.")
    candidates: int = Field(default=32, ge=2, description="Plausible next tokens per context.")
    drift: float = Field(default=0.15, ge=0, le=1, description="Share of contexts whose favourite changes per step.")
    open_share: float = Field(
        default=0.86, ge=0, le=1,
        description="Share of the tokens whose next token is open (the favourite at a level of `open_top1`); the "
                    "others' is near-certain (`closed_top1`) and an open token.")
    closed_top1: float = Field(default=0.99, gt=0, lt=1,
                               description="The favourite's probability after a near-deterministic token.")
    open_top1: list[float] = Field(
        default=[0.08, 0.85], min_length=2, max_length=2,
        description="The favourite's probability after an open token: levels evenly spaced over this range.")
    tail_decay: float = Field(
        default=0.94, gt=0, le=1,
        description="Each candidate after the favourite takes this share of the one before: the closer to 1, the "
                    "flatter the tail and the higher the per-token entropy.")
    pretrain_iters: int = Field(default=100, ge=0, description="Pre-training iterations of the target (cached).")
    rl_iters: int = Field(default=20, ge=0, description="Reward-weighted fine-tuning iterations per RL step.")
    rollouts_per_step: int = Field(default=96, ge=2, description="Rollouts generated per RL step.")
    prompt_len: int = Field(default=8, ge=2, description="Prompt tokens per rollout.")
    response_len: int = Field(default=112, ge=1, description="Response tokens per rollout: the longest one when "
                              "`response_len_sigma` > 0.")
    response_len_median: float = Field(
        default=0.4, gt=0, le=1,
        description="Median response length as a share of `response_len` (lognormal lengths).")
    response_len_sigma: float = Field(
        default=0.5, ge=0, le=3,
        description="Sigma of the lognormal response lengths, capped at `response_len`; 0: every response is "
                    "`response_len` long. A reasoning RL step's lengths are long-tailed.")
    parts_per_step: int = Field(
        default=8, ge=1, le=64,
        description="The step is published in this many parts as its rollouts finish (by length) over its step "
                    "period, then committed; 1: published whole.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature of rollouts.")
    seed: int = Field(default=1234, description="Seed of the task family and the target.")
    step_period_s: float = Field(
        default=18.0, ge=0,
        description="The demo's source publishes one RL step per this many seconds at most (0: as fast as it runs), "
                    "without waiting for the pipeline: its rollouts over the first 85% of the period, then the "
                    "update.",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> SimulationConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError("simulation.hidden_size must be divisible by simulation.num_heads")
        if self.candidates > self.vocab_size:
            raise ValueError("simulation.candidates must not exceed simulation.vocab_size")
        low, high = self.open_top1
        # the second candidate takes (1 - r) / (1 - r^(K-1)) of the rest (K-1 candidates, decaying by r)
        r, others = self.tail_decay, self.candidates - 1
        second = 1 / others if r == 1 else (1 - r) / (1 - r**others)
        least = second / (1 + second)
        if not least <= low <= high < 1 or self.closed_top1 < least:
            raise ValueError(f"simulation.open_top1 must be a range [low, high] with {least:.3f} <= low <= high < 1, "
                             f"and closed_top1 at least {least:.3f}: below it, with {self.candidates} candidates, "
                             f"the favourite is not the most likely token")
        return self
