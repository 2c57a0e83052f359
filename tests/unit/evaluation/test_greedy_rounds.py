"""The product's count of greedy rounds along an emitted text equals what its own speculative decoder counts
decoding the same prompt: the count the deploy's agreement gate holds vLLM's counters to."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from pipeline.evaluation.greedy_rounds import RoundCount, greedy_rounds
from pipeline.evaluation.speculative import generate_batch, greedy_generate
from tests.support.eagle3 import V, drafter_for, fit_first_step

K, MAX_NEW = 3, 40


def test_rounds_along_the_greedy_text_are_the_decoders_rounds(target: LlamaForCausalLM) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (int(n),), generator=g) for n in torch.randint(3, 9, (6,), generator=g)]
    texts = [torch.cat([p, torch.tensor(greedy_generate(target, p, MAX_NEW))]) for p in prompts]
    drafter = fit_first_step(drafter_for(target, seed=1), target, texts, steps=120)
    decoded, counted = RoundCount(0, 0), RoundCount(0, 0)
    for prompt, text in zip(prompts, texts, strict=True):
        trace = generate_batch(target, drafter.proposer, [prompt], MAX_NEW, K)[0]
        assert trace.tokens == text[len(prompt):].tolist()
        decoded += RoundCount(len(trace.accepted_per_round), sum(trace.accepted_per_round))
        counted += greedy_rounds(target, drafter, text, len(prompt), K)
    assert decoded.rounds * 0.2 < decoded.accepted < decoded.rounds * K * 0.9  # rounds of every length
    assert counted == decoded


def test_an_answer_the_prefill_emitted_whole_has_no_round(target: LlamaForCausalLM) -> None:
    drafter = drafter_for(target, seed=1).eval()
    drafter.attach(target)
    assert greedy_rounds(target, drafter, torch.tensor([1, 2, 3]), 2, K) == RoundCount(0, 0)
    assert RoundCount(0, 0).tau is None
