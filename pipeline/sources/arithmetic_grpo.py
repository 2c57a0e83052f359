"""TRL's GRPO on the real policy: SmolLM2-135M-Instruct learns arithmetic with an exact-answer reward.

Each step's prompts are questions the product generates (sources/arithmetic.py) in the chat
template; the reward is 1.0 for a completion whose last integer is the answer. TRL's own trainer
updates the policy (full fine-tuning, float32, no reference model: beta 0), and every step goes
out through the trainer client as `PublishingGRPOTrainer` publishes TRL's steps (sources/trl.py):
the generation batch, its rewards and the weights that generated it.

Rollout generation is one function, TRL's `rollout_func` (prompts, trainer) -> {"prompt_ids",
"completion_ids", "logprobs"}: `local_rollouts` samples with the trainer's own model in this
process; a fleet serving the policy takes its place by answering the same call.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.data.store import ObjectStore
from pipeline.models import target as target_lib
from pipeline.sources import arithmetic, smollm2
from pipeline.sources.trl import PublishedGRPOStep, StepPublisher, publishing_grpo_trainer

RolloutFunc = Callable[[list, Any], dict]


@dataclass(frozen=True)
class GRPOSettings:
    prompts_per_step: int = 2
    num_generations: int = 4  # a GRPO group: completions per prompt
    max_completion_length: int = 96
    temperature: float = 1.0
    learning_rate: float = 1e-5
    seed: int = 0


def exact_answer_reward(completions: list, answer: list[int], **_: Any) -> list[float]:
    """TRL reward function: 1.0 where the completion's last integer is the question's answer."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [arithmetic.reward(text, a) for text, a in zip(texts, answer, strict=True)]


@dataclass
class RolloutTimer:
    """Seconds spent in each call of a rollout function."""

    seconds: list[float] = field(default_factory=list)

    def wrap(self, rollouts: RolloutFunc) -> RolloutFunc:
        def timed(prompts: list, trainer: Any) -> dict:
            start = time.perf_counter()
            try:
                return rollouts(prompts, trainer)
            finally:
                self.seconds.append(time.perf_counter() - start)
        return timed


def local_rollouts(settings: GRPOSettings) -> RolloutFunc:
    """Sample each prompt's completion with the trainer's current model (TRL hands the prompts of a
    step already repeated once per generation), at the step's temperature, seeded by the step."""

    def generate(prompts: list, trainer: Any) -> dict:
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        prompt_ids = [tokenizer(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)["input_ids"] for p in prompts]
        answers = smollm2.sample_completions(
            model, prompt_ids, tokenizer.eos_token_id, settings.temperature, settings.max_completion_length,
            seed=settings.seed * 100_003 + trainer.state.global_step, batch_size=len(prompt_ids), with_logprobs=True)
        return {"prompt_ids": [a.prompt_ids for a in answers], "completion_ids": [a.answer_ids for a in answers],
                "logprobs": [a.logprobs for a in answers]}

    return generate


def dataset(n: int, seed: int):  # noqa: ANN201 (a datasets.Dataset; TRL's dependency, imported here only)
    from datasets import Dataset

    questions = arithmetic.questions(n, seed)
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q.text}] for q in questions],
                              "answer": [q.answer for q in questions]})


def build_trainer(checkpoint: Path, store: ObjectStore, run: str, steps: int, output_dir: Path,
                  settings: GRPOSettings | None = None, rollouts: RolloutFunc | None = None,
                  on_published: Callable[[PublishedGRPOStep], None] | None = None):  # noqa: ANN201
    """A PublishingGRPOTrainer of the converted checkpoint (a trainable copy) for `steps` steps, its
    rollouts from `rollouts` (default: `local_rollouts`)."""
    from transformers import PrinterCallback
    from trl import GRPOConfig

    s = settings or GRPOSettings()
    policy = target_lib.load_checkpoint(str(checkpoint))
    policy.generation_config.eos_token_id = policy.generation_config.pad_token_id = policy.config.eos_token_id
    tokenizer = smollm2.load_tokenizer(checkpoint)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*rollout_func.*")
    args = GRPOConfig(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=s.prompts_per_step * s.num_generations,
        num_generations=s.num_generations, max_completion_length=s.max_completion_length,
        learning_rate=s.learning_rate, temperature=s.temperature, bf16=False, beta=0.0, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=s.seed, disable_tqdm=True, dataloader_num_workers=0,
    )
    publisher = StepPublisher(store, run, smollm2.MODEL_ID)
    trainer = publishing_grpo_trainer(
        model=policy, reward_funcs=exact_answer_reward, args=args,
        train_dataset=dataset(s.prompts_per_step * steps, s.seed), processing_class=tokenizer,
        rollout_func=rollouts or local_rollouts(s), publisher=publisher, on_published=on_published)
    trainer.remove_callback(PrinterCallback)
    return trainer


def parameter_drift(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> float:
    """||theta - theta_0|| / ||theta_0|| over every parameter: how far the policy has moved."""
    moved = sum(float((p.detach() - reference[n]).double().pow(2).sum()) for n, p in model.named_parameters())
    base = sum(float(t.double().pow(2).sum()) for t in reference.values())
    return (moved / base) ** 0.5
