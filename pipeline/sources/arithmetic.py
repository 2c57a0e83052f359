"""Arithmetic questions with a checkable answer, and the exact-answer reward GRPO trains on.

A question is a chat turn ("What is 17 + 25? Answer with the number."); the reward is 1.0 when the
last integer in the completion is the right answer and 0.0 otherwise, so a completion that works
the sum out before stating it is paid as much as a bare number, and one that states a wrong
number last is not.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

INTEGER = re.compile(r"-?\d[\d,]*")


@dataclass(frozen=True)
class Question:
    text: str
    answer: int


def questions(n: int, seed: int, max_operand: int = 50) -> list[Question]:
    """`n` questions over + - * with operands in [0, max_operand] (products of operands up to 12),
    reproducible from `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        op = rng.choice("+-*")
        if op == "*":
            a, b = rng.randint(2, 12), rng.randint(2, 12)
        else:
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(Question(f"What is {a} {op} {b}? Answer with the number.", answer))
    return out


def final_integer(text: str) -> int | None:
    """The last integer written in `text` (thousands separators allowed), None when there is none."""
    found = INTEGER.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def reward(completion: str, answer: int) -> float:
    return 1.0 if final_integer(completion) == answer else 0.0
