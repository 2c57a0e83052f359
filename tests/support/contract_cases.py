"""Rollouts that break the contract, shared by the pipeline's reader tests and the trainer client's
tests: whatever the pipeline refuses to read, the client must refuse to write."""

from __future__ import annotations

import functools

import pytest

from pipeline.data.rollouts import Rollout, TargetLimits

BAD = functools.partial(pytest.mark.reliability, "bad_input")
LIMITS = TargetLimits(vocab_size=50, max_positions=8)


def ok(sample_id: str = "a", **changes) -> Rollout:
    fields = {"sample_id": sample_id, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "reward": 1.0,
              "policy_version": 3, **changes}
    return Rollout(**fields)


# (rollouts, sample, field, message); the pipeline reads them with LIMITS.
BAD_ROLLOUTS = [
    pytest.param([ok(input_ids=[1, 2, 3], loss_mask=[0, 1])], "a", "loss_mask", "2 values for 3 input_ids",
                 id="mask-length", marks=BAD("loss mask and token ids of different lengths (rollouts)")),
    pytest.param([ok("a"), ok("a")], "a", "sample_id", "duplicate within the step",
                 id="duplicate-ids", marks=BAD("duplicate sample ids (rollouts)")),
    pytest.param([], None, None, "no rollouts (empty step)", id="empty", marks=BAD("empty step (rollouts)")),
    pytest.param([ok(input_ids=[1], loss_mask=[1])], "a", "input_ids", "fewer than 2", id="one-token",
                 marks=BAD("rollout of a single token")),
    pytest.param([ok(loss_mask=[0, 2, 1])], "a", "loss_mask", "value 2 at position 1 is not 0/1", id="mask-2",
                 marks=BAD("loss mask value other than 0/1 (rollouts)")),
    pytest.param([ok(loss_mask=[0, 0, 0])], "a", "loss_mask", "all zeros", id="mask-zero",
                 marks=BAD("loss mask all zero (rollouts)")),
    pytest.param([ok(input_ids=[1, -2, 3])], "a", "input_ids", "negative token id -2", id="negative-id",
                 marks=BAD("negative token id (rollouts)")),
    pytest.param([ok("b"), ok("c", input_ids=[1, 50, 3])], "c", "input_ids",
                 "token id 50 at position 1 is not below the vocabulary size 50", id="id-at-vocab",
                 marks=BAD("token id at the vocabulary size (rollouts)")),
    pytest.param([ok(input_ids=list(range(9)), loss_mask=[0] * 8 + [1])], "a", "input_ids",
                 "9 tokens, more than the target's 8 positions", id="too-long",
                 marks=BAD("sequence longer than the target's max positions (rollouts)")),
    pytest.param([ok(reward=float("nan"))], "a", "reward", "finite number", id="nan-reward",
                 marks=BAD("NaN reward (rollouts)")),
    pytest.param([ok(policy_version=-1)], "a", "policy_version", "-1 is outside", id="negative-version",
                 marks=BAD("negative policy_version (rollouts)")),
    pytest.param([ok(sample_id="")], "", "sample_id", "non-empty string", id="empty-sample-id",
                 marks=BAD("empty sample id (rollouts)")),
]

# What only a Python caller can hand over (Parquet's types cannot hold it): the client refuses it.
BAD_CALLER_ROLLOUTS = [
    pytest.param([ok(policy_version=True)], "a", "policy_version", "got True", id="bool-version",
                 marks=BAD("boolean policy_version (client)")),
    pytest.param([ok(policy_version=2.5)], "a", "policy_version", "got 2.5", id="fractional-version",
                 marks=BAD("fractional policy_version (client)")),
    pytest.param([ok(reward=None)], "a", "reward", "got None", id="null-reward",
                 marks=BAD("null reward (client)")),
    pytest.param([ok(reward=10**400)], "a", "reward", "got a 1329-bit integer", id="reward-400-digits",
                 marks=BAD("reward of 400 digits (client): refused naming the sample and field, never OverflowError")),
    pytest.param([ok(input_ids=[1, 2.0, 3])], "a", "input_ids", "position 1 holds 2.0", id="float-token",
                 marks=BAD("token id that is not an integer (client)")),
]


def refused_by_the_client(params: list) -> list:
    """The same cases as rows of their own: the client's refusal is a second place the input is stopped."""
    out = []
    for p in params:
        marks = [BAD(m.args[1].replace("(rollouts)", "(client, before writing)")) if m.name == "reliability" else m
                 for m in p.marks]
        out.append(pytest.param(*p.values, id=p.id, marks=marks))
    return out
