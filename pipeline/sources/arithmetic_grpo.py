"""TRL's GRPO on the real policy: SmolLM2-135M-Instruct learns arithmetic with an exact-answer reward.

Each step's prompts are questions the product generates (sources/arithmetic.py) in the chat
template; the reward is 1.0 for a completion whose last integer is the answer. TRL's own trainer
updates the policy (full fine-tuning, float32, no reference model: beta 0), and every step goes
out through the trainer client as `PublishingGRPOTrainer` publishes TRL's steps (sources/trl.py):
the generation batch, its rewards and the weights that generated it.

Rollout generation is one function, TRL's `rollout_func` (prompts, trainer) -> {"prompt_ids",
"completion_ids", "logprobs"}: `local_rollouts` samples with the trainer's own model in this
process; `fleet_rollouts` pushes the trainer's weights to the serving fleet and has it decode them.

`ArithmeticGRPODemo` is the demo's source on this policy (`cli.py demo --source smollm2`): one held
step at a time, its rollouts from the fleet, each step's time by phase (`StepPhases`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from pipeline.data.keys import fleet_prefix
from pipeline.data.rollout_engine import GeneratedRollout, RolloutEngine, RolloutRequest, request_seed
from pipeline.data.store import ObjectStore
from pipeline.models import target as target_lib
from pipeline.sampling import SamplingParams
from pipeline.sources import arithmetic, smollm2
from pipeline.sources.trl import HeldTrainer, PublishedGRPOStep, StepPublisher, publishing_grpo_trainer

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


def chat_prompt_ids(tokenizer: Any, prompts: list) -> list[list[int]]:
    """Each conversation's token ids in the chat template, ready for the assistant's turn."""
    return [tokenizer(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"] for p in prompts]


def local_rollouts(settings: GRPOSettings) -> RolloutFunc:
    """Sample each prompt's completion with the trainer's current model (TRL hands the prompts of a
    step already repeated once per generation), at the step's temperature, seeded by the step."""

    def generate(prompts: list, trainer: Any) -> dict:
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        prompt_ids = chat_prompt_ids(tokenizer, prompts)
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
                  on_published: Callable[[PublishedGRPOStep], None] | None = None,
                  publisher: StepPublisher | None = None):  # noqa: ANN201
    """A PublishingGRPOTrainer of the converted checkpoint (a trainable copy) for `steps` steps, its
    rollouts from `rollouts` (default: `local_rollouts`), its steps through `publisher` (default: each
    step whole to `store`'s `run`)."""
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
    publisher = publisher or StepPublisher(store, run, smollm2.MODEL_ID, sampling=SamplingParams(s.temperature))
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


def fleet_rollouts(engine: RolloutEngine, settings: GRPOSettings, store: ObjectStore, run: str,
                   push_s: dict[int, float] | None = None) -> RolloutFunc:
    """TRL's `rollout_func` on the fleet: the weights the trainer holds now pushed to every replica as the step's
    policy (written under the run's fleet prefix; the seconds into `push_s` by step), then one request per
    completion with its own seed, ending at the end-of-turn token or `max_completion_length`."""
    s = settings
    params = SamplingParams(temperature=s.temperature)

    def generate(prompts: list, trainer: Any) -> dict:
        step, start = trainer.state.global_step + 1, time.perf_counter()  # the optimizer step they train
        tokenizer = trainer.processing_class
        policy = target_lib.save_checkpoint(trainer.accelerator.unwrap_model(trainer.model), store,
                                            f"{fleet_prefix(run)}/policies/step-{step:06d}", tokenizer)
        engine.push_policy(step, policy)
        if push_s is not None:
            push_s[step] = time.perf_counter() - start
        prompt_ids = chat_prompt_ids(tokenizer, prompts)
        requests = [RolloutRequest(ids, s.max_completion_length, params, request_seed(s.seed, step, i),
                                   (tokenizer.eos_token_id,)) for i, ids in enumerate(prompt_ids)]
        done: list[GeneratedRollout | None] = [None] * len(requests)
        for i, rollout in engine.generate(requests):
            done[i] = rollout
        return {"prompt_ids": prompt_ids, "completion_ids": [r.token_ids for r in done],
                "logprobs": [r.logprobs for r in done]}

    return generate


@dataclass(frozen=True)
class StepPhases:
    """Where one GRPO step's seconds went on the trainer's side, as RL papers break a step down."""

    step: int
    weight_push_s: float  # the policy written and loaded by every replica
    generation_s: float  # the rollouts decoded
    publish_s: float  # the step's checkpoint and rollouts through the trainer client
    update_s: float  # the rest of TRL's step: rewards, log-probabilities, backward, optimizer

    def to_json(self) -> dict:
        return {"step": self.step, "weight_push_s": round(self.weight_push_s, 2),
                "generation_s": round(self.generation_s, 2), "publish_s": round(self.publish_s, 2),
                "update_s": round(self.update_s, 2)}


class _TimedPublisher(StepPublisher):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds: dict[int, float] = {}

    def publish(self, step: int, *args: Any, **kwargs: Any) -> tuple[int, ...]:
        start = time.perf_counter()
        try:
            return super().publish(step, *args, **kwargs)
        finally:
            self.seconds[step] = time.perf_counter() - start


class _StepBounds(TrainerCallback):
    """perf_counter() at each optimizer step's begin and end, by step."""

    def __init__(self) -> None:
        self.begin: dict[int, float] = {}
        self.end: dict[int, float] = {}

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 (transformers' signature)
        self.begin[state.global_step + 1] = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.end[state.global_step] = time.perf_counter()


class ArithmeticGRPODemo(HeldTrainer):
    """The demo's source on SmolLM2: TRL's GRPO on the converted checkpoint, one held step at a time, its
    rollouts from `engine` (the fleet) when given, else sampled by the trainer's own model."""

    def __init__(self, checkpoint: Path, store: ObjectStore, run: str, steps: int, output_dir: Path,
                 settings: GRPOSettings | None = None, engine: RolloutEngine | None = None) -> None:
        self.settings = settings or GRPOSettings()
        super().__init__(steps, _TimedPublisher(store, run, smollm2.MODEL_ID,
                                                sampling=SamplingParams(self.settings.temperature)), engine)
        self.checkpoint, self.output_dir = checkpoint, output_dir
        self._bounds = _StepBounds()
        self._push_s: dict[int, float] = {}  # step -> the weight push's seconds (with a fleet)
        self._rollouts = RolloutTimer()  # a call per step, in order: its seconds, the push included
        self._held_s: dict[int, float] = {}

    def build_trainer(self):  # noqa: ANN201
        s, p = self.settings, self.publisher
        rollouts = fleet_rollouts(self.engine, s, p.store, p.run, self._push_s) if self.engine else local_rollouts(s)
        self.trainer = build_trainer(self.checkpoint, p.store, p.run, self.steps, self.output_dir, s,
                                     rollouts=self._rollouts.wrap(rollouts), on_published=self._hold, publisher=p)
        self.trainer.add_callback(self._bounds)
        return self.trainer

    def canary_prompts(self, n: int = 4) -> list[list[int]]:
        """Questions the steps do not train on (another seed), as the fleet receives them: what a deploy before
        the first step checks a drafter on."""
        self.pretrained()
        questions = arithmetic.questions(n, self.settings.seed + 1)
        return chat_prompt_ids(self.trainer.processing_class,
                               [[{"role": "user", "content": q.text}] for q in questions])

    def _hold(self, published: PublishedGRPOStep) -> None:
        start = time.perf_counter()
        super()._hold(published)
        self._held_s[published.step] = time.perf_counter() - start

    def phases(self) -> list[StepPhases]:
        """Each finished step's phases (after `finish`, every step's)."""
        out = []
        for step in sorted(self._bounds.end):
            push = self._push_s.get(step, 0.0)
            generation = self._rollouts.seconds[step - 1] - push
            publish = self.publisher.seconds.get(step, 0.0)
            wall = self._bounds.end[step] - self._bounds.begin[step] - self._held_s.get(step, 0.0)
            out.append(StepPhases(step, push, generation, publish, max(0.0, wall - push - generation - publish)))
        return out
