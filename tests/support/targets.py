"""Tiny Llama targets, built from a seed: the shapes are each test's own, the construction is shared."""

from __future__ import annotations

from transformers import LlamaForCausalLM

from pipeline.models import target as target_lib


def tiny_target(vocab: int, hidden: int, layers: int, heads: int, seed: int = 0) -> LlamaForCausalLM:
    return target_lib.build_target(target_lib.tiny_llama_config(vocab, hidden, layers, heads), seed=seed)
