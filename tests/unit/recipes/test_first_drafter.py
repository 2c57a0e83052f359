"""The first-drafter recipe on a tiny target: the draft vocabulary sized from the data, the drafter started from
the target's layer, a learning curve measured as it trains, the drafter exported as vLLM loads it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.models.checkpoint import load_drafter
from pipeline.sources.smollm2 import Answer
from recipes import first_drafter
from tests.support.eagle3 import V, eagle3_target


def _answers(n: int, seed: int) -> list[Answer]:
    """A little language: each answer counts up from its prompt's last token, so the next token is learnable."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(0, V, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g).tolist()
        length = int(torch.randint(6, 12, (1,), generator=g))
        out.append(Answer(prompt, [(prompt[-1] + 1 + i) % V for i in range(length)]))
    return out


def test_data_vocab_covers_the_share_of_answer_tokens() -> None:
    counts = torch.tensor([5, 0, 3, 1, 1])
    assert first_drafter.data_vocab_size(counts, coverage=0.8) == 2
    assert first_drafter.data_vocab_size(counts, coverage=0.85) == 3
    assert first_drafter.data_vocab_size(counts, coverage=1.0) == 4


def test_an_arm_trains_along_its_curve_and_exports(tmp_path: Path) -> None:
    target = eagle3_target().requires_grad_(False)
    train, held = _answers(48, 0), _answers(4, 1)
    counts = first_drafter.token_counts(train, V)
    arm = first_drafter.Arm("tiny", lr=1e-2)
    probe = first_drafter.build_drafter(arm, target, counts)
    samples = first_drafter.training_samples(target, probe, train)
    held_out = first_drafter.held_out_set(target, probe.decode_layer_ids, held)
    assert held_out.rounds == sum(len(a.answer_ids) - 1 for a in held)
    assert 1.0 <= held_out.oracle_tau <= 5.0

    curve = first_drafter.train_arm(arm, target, samples, counts, held_out, max_tokens=3000, eval_every=500,
                                    minutes=60, out=tmp_path, log=lambda _: None)
    tokens = [p.tokens for p in curve.points]
    assert tokens[0] == 0
    assert tokens == sorted(set(tokens))
    assert len(tokens) >= 4
    assert all(1.0 <= p.tau <= 5.0 and 1.0 <= p.tau_probabilistic <= 5.0 for p in curve.points)
    assert curve.points[-1].tau > curve.points[0].tau  # it learns the counting language
    assert curve.draft_vocab_size == first_drafter.data_vocab_size(counts)
    saved = json.loads((tmp_path / "tiny" / "curve.json").read_text())
    assert [p["tokens"] for p in saved["points"]] == tokens
    loaded = load_drafter(tmp_path / "tiny" / "drafter", target.config.num_hidden_layers)
    assert loaded.config.draft_vocab_size == curve.draft_vocab_size
