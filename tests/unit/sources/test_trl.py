"""The TRL source's locally built pieces (the GRPO run itself is tests/integration/test_trl.py)."""

from __future__ import annotations

import pytest

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


def test_publish_every_must_be_positive(tmp_path) -> None:  # noqa: ANN001
    from pipeline.data.store import ObjectStore

    with pytest.raises(ValueError, match="publish_every must be >= 1"):
        trl_source.StepPublisher(ObjectStore(tmp_path.as_uri()), "r", "m", publish_every=0)
