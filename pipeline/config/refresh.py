"""`refresh`: the same-step refresh, a drafter fine-tuned on a step's first parts for the step's tail."""

from __future__ import annotations

from pydantic import Field

from pipeline.config.section import Section


class RefreshConfig(Section):
    """Same-step refresh: a drafter fine-tuned on a step's first parts serves the step's tail."""

    enabled: bool = Field(default=True, description="Run a refresh when a step's parts qualify (with a fleet "
                          "and drafter training on; otherwise the refresh sensor says why it skips).")
    min_share: float = Field(
        default=0.5, gt=0, le=1,
        description="A step's parts qualify once they hold this share of its expected rollouts.")
    min_tokens: int = Field(
        default=0, ge=0, description="... or this many response tokens (0: the share alone decides).")
    max_tokens: int = Field(
        default=20000, ge=64,
        description="Trained positions of a refresh (windowed tokens): a budget of seconds, not minutes.")
    margin: float = Field(
        default=0.05, ge=0,
        description="Deploy the refreshed drafter when its tau on the parts' held-out rollouts beats the "
                    "champion's by more than this.")
    lr: float = Field(default=0.001, gt=0, description="Learning rate of the refresh's fine-tuning.")
    check_prompts: int = Field(
        default=8, ge=1,
        description="Held-out prompts of the qualifying parts the refresh's check decodes with the refreshed "
                    "drafter and the champion (at most eval.num_prompts): a go/no-go at refresh.margin, on the "
                    "refresh's latency path.")
