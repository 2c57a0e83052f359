"""The TRL source's locally built pieces (the GRPO run itself is tests/integration/test_trl.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.data.store import ObjectStore
from pipeline.sources import trl as trl_source


def test_tokenizer_is_built_locally_with_distinct_specials() -> None:
    tok = trl_source.build_tokenizer()

    assert len(tok) == 3 + len(trl_source.LETTERS)
    assert tok.pad_token_id != tok.eos_token_id
    assert tok("c a b")["input_ids"] == [tok.convert_tokens_to_ids(t) for t in "cab"]
    assert tok.decode(tok("c a b")["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == "c a b"


def test_policy_matches_the_tokenizer() -> None:
    tok = trl_source.build_tokenizer()
    model = trl_source.build_policy(tok, hidden_size=16, num_layers=1, num_heads=2)

    assert model.config.vocab_size == len(tok)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_prompts_have_very_different_lengths_and_are_reproducible() -> None:
    prompts = trl_source.prompts(40, seed=3)

    assert prompts == trl_source.prompts(40, seed=3)
    lengths = {len(p.split()) for p in prompts}
    assert min(lengths) >= 2
    assert max(lengths) <= 12
    assert len(lengths) > 5


@pytest.mark.parametrize(("completion", "reward"), [("a e i", 1.0), ("a b", 0.5), ("b c", 0.0), ("", 0.0)])
def test_vowel_reward(completion: str, reward: float) -> None:
    assert trl_source.vowel_reward([completion]) == [reward]


def test_publish_every_must_be_positive(store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="publish_every must be >= 1"):
        trl_source.StepPublisher(store, "r", "m", publish_every=0)


def test_a_step_goes_out_in_parts_by_completion_length_then_commits(store: ObjectStore, tmp_path: Path) -> None:
    """What the GRPO trainer's publisher writes for one generation batch (the GRPO run: the integration test)."""
    from pipeline.client import Rollout, publish_checkpoint
    from pipeline.data import parts as parts_lib
    from pipeline.data.rollouts import is_committed, read_rollouts

    tok = trl_source.build_tokenizer()
    model = trl_source.build_policy(tok, hidden_size=16, num_layers=1, num_heads=2)
    lengths = [1, 8, 2, 7, 3, 8]  # completion lengths of a batch, in TRL's order
    batch = [Rollout(f"s000001-p0000-g{i:02d}", [4, 5] + [6] * n, [0, 0] + [1] * n, 0.5, 0)
             for i, n in enumerate(lengths)]
    publisher = trl_source.StepPublisher(store, "r", "m", parts=4)
    staged = publish_checkpoint(model, tmp_path / "staging")

    parts = publisher.publish(1, batch, staged, 0, len(tok))

    # Slices of the decoding (8 tokens in 4): lengths 1-2 end in the first, 3 in the second, 7-8 in the last.
    assert parts == (0, 1, 3)
    assert is_committed(store, "r", 1)
    assert parts_lib.committed_part_numbers(store, "r", 1) == [0, 1, 3]
    manifests = {m.part: m.rows for m in parts_lib.published_parts(store, "r", 1)}
    assert manifests == {0: 2, 1: 1, 3: 3}
    assert [sum(r.loss_mask) for r in read_rollouts(store, "r", 1)] == [1, 2, 3, 8, 7, 8]
    # One part: the step whole, as before.
    whole = trl_source.StepPublisher(store, "r", "m")
    second = [Rollout(r.sample_id.replace("s000001", "s000002"), r.input_ids, r.loss_mask, r.reward, 1) for r in batch]
    assert whole.publish(2, second, staged, 1, len(tok)) == ()
    assert parts_lib.committed_part_numbers(store, "r", 2) == []
    with pytest.raises(ValueError, match="parts must be >= 1"):
        trl_source.StepPublisher(store, "r", "m", parts=0)


def test_parts_go_out_over_the_rollout_window_as_an_engine_finishes_them(store: ObjectStore, tmp_path: Path) -> None:
    """TRL decodes a batch at once; with a window the publisher releases part p of P at (p+1)/P of it."""
    from pipeline.client import publish_checkpoint
    from pipeline.data import parts as parts_lib
    from pipeline.data.rollouts import Rollout

    tok = trl_source.build_tokenizer()
    model = trl_source.build_policy(tok, hidden_size=16, num_layers=1, num_heads=2)
    batch = [Rollout(f"s000001-p0000-g{i:02d}", [4, 5] + [6] * n, [0, 0] + [1] * n, 0.5, 0)
             for i, n in enumerate([2, 4, 6, 8])]  # one completion ending in each quarter of the decoding
    publisher = trl_source.StepPublisher(store, "r", "m", parts=4)
    staged = publish_checkpoint(model, tmp_path / "staging")
    window = 1.2
    started = time.time()
    publisher.window_end = time.monotonic() + window

    assert publisher.publish(1, batch, staged, 0, len(tok)) == (0, 1, 2, 3)

    released = {m.part: m.published_at - started for m in parts_lib.published_parts(store, "r", 1)}
    for part in range(4):  # never before its slice of the window ends
        assert released[part] >= window * (part + 1) / 4 - 0.05, released
    assert released[0] < released[1] < released[2] < released[3]
