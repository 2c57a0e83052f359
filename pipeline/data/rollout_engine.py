"""What an RL source asks of a rollout engine (the serving fleet), as callables injected where the source is
composed (the demo, the Dagster resources): a source runs on whichever engine it is given.

    push_policy(step, checkpoint_uri)   the step's policy on every replica, before the step's first request,
                                        as an asynchronous trainer pushes its weights to vLLM
    generate(requests)                  the requests decoded concurrently over the replicas, each with its own
                                        sampling parameters and seed; (index, rollout) pairs in the order
                                        they finish

A rollout decoded by any policy but the one pushed last is an error the generator raises, never a rollout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pipeline.sampling import SamplingParams


@dataclass(frozen=True)
class RolloutRequest:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    stop_token_ids: tuple[int, ...] = ()  # a generated stop token ends the completion (and is part of it)


@dataclass(frozen=True)
class GeneratedRollout:
    token_ids: list[int]  # the completion, without the prompt
    logprobs: list[float]  # each token's raw log-probability under the policy
    finish_reason: str  # "length" or "stop"


@dataclass(frozen=True)
class RolloutEngine:
    push_policy: Callable[[int, str], None]
    generate: Callable[[list[RolloutRequest]], Iterator[tuple[int, GeneratedRollout]]]


def request_seed(seed: int, step: int, index: int) -> int:
    """Rollout `index` of `step`'s request seed: the same rollout on any replica, in any batch, for a source
    seeded `seed`."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{index}".encode()).digest()[:7], "big")
