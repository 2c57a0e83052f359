"""RL step identifiers: partition keys `step-000123` and the store keys derived from them."""

from __future__ import annotations

import re

_STEP_KEY = re.compile(r"step-([0-9]{6,})")


def step_key(step: int) -> str:
    if step < 0:
        raise ValueError(f"RL step must be >= 0, got {step}")
    return f"step-{step:06d}"


def parse_step_key(key: str) -> int:
    """`step-000123` -> 123; anything else is rejected with the offending key in the message."""
    match = _STEP_KEY.fullmatch(key)
    if not match or step_key(int(match.group(1))) != key:  # one key per step: no extra leading zeros
        raise ValueError(f"partition key {key!r} is not 'step-' followed by the step zero-padded to six digits "
                         "(e.g. step-000001)")
    return int(match.group(1))


def malformed_step_names(names: list[str]) -> list[str]:
    """The names among `names` meant as step directories (they start with 'step') that are not step keys
    (step-12, step-0000001, Step-000001, step-00001a): ignored, so the operator must be told."""
    return [n for n in names if n.lower().startswith("step") and not (_STEP_KEY.fullmatch(n) and
                                                                      step_key(int(n[5:])) == n)]


def rollouts_prefix(run: str, step: int) -> str:
    return f"rollouts/{run}/{step_key(step)}"


def policy_prefix(run: str, step: int) -> str:
    return f"policies/{run}/{step_key(step)}"


def hidden_states_prefix(run: str, step: int) -> str:
    return f"hidden_states/{run}/{step_key(step)}"


def buffer_key(run: str, step: int) -> str:
    return f"buffer/{run}/{step_key(step)}/_manifest.json"


def acceptance_key(run: str, step: int) -> str:
    return f"acceptance/{run}/{step_key(step)}.json"


def drafter_key(run: str, step: int) -> str:
    return f"drafter/{run}/{step_key(step)}.json"
