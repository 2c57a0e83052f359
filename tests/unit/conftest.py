"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest
from transformers import LlamaForCausalLM

from tests.support.eagle3 import eagle3_target


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    """The EAGLE-3 tests' four-layer target, one per module; a module whose tests need other shapes (or another
    model) defines its own `target`."""
    return eagle3_target()
