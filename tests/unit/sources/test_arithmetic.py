"""Arithmetic questions carry their answer; the exact-answer reward pays only the answer stated last."""

from __future__ import annotations

import re

import pytest

from pipeline.sources import arithmetic
from pipeline.sources.arithmetic_grpo import exact_answer_reward


def test_questions_are_reproducible_and_answered() -> None:
    questions = arithmetic.questions(200, seed=3)
    assert questions == arithmetic.questions(200, seed=3)
    assert questions[:50] == arithmetic.questions(50, seed=3)  # a longer list starts with the shorter one
    assert questions != arithmetic.questions(200, seed=4)
    for q in questions:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\? Answer with the number\.", q.text).groups()
        assert q.answer == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert {q.text.split()[3] for q in questions} == {"+", "-", "*"}


@pytest.mark.parametrize(("text", "answer", "paid"), [
    ("42", 42, 1.0),
    ("12 + 30 = 42.", 42, 1.0),
    ("The answer is 1,024", 1024, 1.0),
    ("5 - 9 = -4", -4, 1.0),
    ("42, or maybe 41", 42, 0.0),  # the answer stated last is 41
    ("forty-two", 42, 0.0),
    ("", 42, 0.0),
])
def test_reward_reads_the_last_integer(text: str, answer: int, paid: float) -> None:
    assert arithmetic.reward(text, answer) == paid


def test_trl_reward_reads_conversational_completions() -> None:
    completions = [[{"role": "assistant", "content": "7 * 6 = 42"}], [{"role": "assistant", "content": "41"}]]
    assert exact_answer_reward(completions, answer=[42, 42]) == [1.0, 0.0]
    assert exact_answer_reward(["42", "x"], answer=[42, 42]) == [1.0, 0.0]
