"""TRL's GRPOTrainer as an RL source: every published GRPO step goes through the trainer client.

What a step carries is TRL's own generation batch: each prompt's token ids and each completion's
token ids as TRL generated them (no padding: TRL left-pads prompts and right-pads completions
only inside its tensors; a completion keeps its EOS and ends there, or runs to the length limit
when truncated), a loss mask of 1 on the completion tokens (0 on tool output TRL inserted), the
reward TRL computed for each completion (the weighted sum of its reward functions), the policy
version (TRL's global step when the completions were generated) and the checkpoint of the
weights that generated them.

A thin subclass, not a TrainerCallback: a callback's arguments (args, state, control, model,
processing_class, ...) carry no generation batch, and by `on_step_end` the optimizer has
already changed the weights that generated it. `PublishingGRPOTrainer` records what TRL's
`_generate` and `_calculate_rewards` return and publishes at the end of
`_generate_and_score_completions`, when the batch is scored and the weights are still the
generating ones. The RL step number is TRL's step that trains on the batch (global_step + 1).

The demo task (`GRPODemo`) is built here from nothing on a hub: a tokenizer of 16 letters
with <pad>/<eos> specials, a tiny Llama policy from a config, prompts of 2 to 12 letters, and a
reward function that pays for vowels in the completion, which GRPO raises within a few steps.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline.client import (
    StagedCheckpoint,
    commit_rollouts_parts,
    publish_checkpoint,
    publish_rollouts_part,
    publish_step,
)
from pipeline.data.keys import fleet_prefix
from pipeline.data.rollout_engine import GeneratedRollout, RolloutEngine, RolloutRequest, request_seed
from pipeline.data.rollouts import Rollout
from pipeline.data.store import ObjectStore
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.sampling import SamplingParams
from pipeline.sources.simulation import ROLLOUT_SHARE_OF_PERIOD, finish_parts

LETTERS = "abcdefghijklmnop"
VOWELS = frozenset("aeio")
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


@dataclass(frozen=True)
class Generation:
    """What GRPOTrainer generated for one batch of prompts, kept until the batch is scored."""

    prompt_ids: list
    completion_ids: list
    tool_mask: list | None  # None: no tool calls, every completion token is the policy's


@dataclass(frozen=True)
class PublishedGRPOStep:
    """What one publication held, as TRL computed it."""

    step: int
    policy_version: int
    mean_reward: float  # TRL's logged `reward` of the step: the mean over its completions
    rollouts: list[Rollout] = field(repr=False)
    skipped_unscorable: int = 0  # completions every reward function returned None for (no reward to publish)
    parts: tuple[int, ...] = ()  # the parts it went out in, shortest completions first; (): published whole


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level over single letters: "a b c" -> 3 ids; <pad> and <eos> are distinct specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *LETTERS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def build_policy(tokenizer: PreTrainedTokenizerFast, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                 seed: int = 0, max_positions: int = 128) -> LlamaForCausalLM:
    """A tiny Llama from a config with the tokenizer's vocabulary and special tokens."""
    config = target_lib.tiny_llama_config(len(tokenizer), hidden_size, num_layers, num_heads)
    config.max_position_embeddings = max_positions
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = target_lib.build_target(config, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def prompts(n: int, seed: int, min_len: int = 2, max_len: int = 12) -> list[str]:
    """Random letter strings of very different lengths ("c k a", "p b n e o d f ...")."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]


def vowel_reward(completions: list[str], **_: Any) -> list[float]:
    """Share of the completion's letters that are vowels; an empty completion (EOS at once) earns 0."""
    rewards = []
    for text in completions:
        letters = text.split()
        rewards.append(sum(t in VOWELS for t in letters) / len(letters) if letters else 0.0)
    return rewards


class StepPublisher:
    """Where a trainer's steps go: the store, the run, how often to publish, and in how many parts (1: whole).

    `window_end` (time.monotonic(); 0: none) paces the parts: TRL decodes a batch at once, where a rollout
    engine serving thousands of completions finishes them over minutes, shortest first. Part p of P is
    released at (p+1)/P of the window, as its slice of the decoding would end, so a step's head is
    published while its tail is still being generated (what the same-step refresh serves)."""

    def __init__(self, store: ObjectStore, run: str, model_id: str, publish_every: int = 1, parts: int = 1,
                 sampling: SamplingParams | None = None) -> None:
        if publish_every < 1:
            raise ValueError(f"publish_every must be >= 1, got {publish_every}")
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        self.store, self.run, self.model_id, self.publish_every = store, run, model_id, publish_every
        self.parts, self.sampling = parts, sampling  # how the trainer samples its completions, recorded per step
        self.window_end = 0.0
        self.published: list[PublishedGRPOStep] = []

    def publish(self, step: int, rollouts: list[Rollout], staged: StagedCheckpoint, policy_version: int,
                tokenizer_vocab_size: int) -> tuple[int, ...]:
        """The step whole, or in parts as a rollout engine finishes its completions (shortest first, the
        simulated source's `finish_parts`, paced to `window_end`), then committed; returns the parts
        written (() when whole)."""
        if self.parts == 1 or not rollouts:
            publish_step(self.store, self.run, step, rollouts, staged, policy_version=policy_version,
                         model_id=self.model_id, sampling=self.sampling, tokenizer_vocab_size=tokenizer_vocab_size)
            return ()
        written = []
        start = time.monotonic()
        window = max(0.0, self.window_end - start)
        for part, rows in enumerate(finish_parts(rollouts, self.parts)):
            time.sleep(max(0.0, start + window * (part + 1) / self.parts - time.monotonic()))
            if rows:  # an empty slice of the decoding is no part
                publish_rollouts_part(self.store, self.run, step, part, rows, staged, policy_version=policy_version,
                                      model_id=self.model_id, expected_rollouts=len(rollouts),
                                      sampling=self.sampling, tokenizer_vocab_size=tokenizer_vocab_size)
                written.append(part)
        commit_rollouts_parts(self.store, self.run, step)
        return tuple(written)


def _grpo_trainer_class():  # TRL is imported on first use: the pipeline runs without it
    from accelerate.utils import gather_object
    from trl import GRPOTrainer

    class PublishingGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that publishes every `publisher.publish_every`-th step's generation batch."""

        def __init__(self, *args: Any, publisher: StepPublisher,
                     on_published: Callable[[PublishedGRPOStep], None] | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.publisher, self.on_published = publisher, on_published
            self._generated: Generation | None = None
            self._rewards_per_func: torch.Tensor | None = None

        def _generate(self, prompts: list):  # noqa: ANN202 (TRL's own signature)
            result = super()._generate(prompts)
            prompt_ids, completion_ids, tool_mask = result[:3]  # TRL's tuple opens with these three
            self._generated = Generation(prompt_ids, completion_ids, tool_mask)
            return result

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # noqa: ANN001, ANN202
            self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            return self._rewards_per_func

        def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
            output = super()._generate_and_score_completions(inputs)
            step = self.state.global_step + 1  # the optimizer step this batch trains
            if self.model.training and step % self.publisher.publish_every == 0:
                published = self._publish(step)
                if published is not None and self.on_published is not None:
                    self.on_published(published)
            return output

        def _publish(self, step: int) -> PublishedGRPOStep | None:
            """Gathered over processes (TRL's rewards already are), written by the main process."""
            generated = self._generated
            prompt_ids, completion_ids = gather_object(generated.prompt_ids), gather_object(generated.completion_ids)
            tool_mask = gather_object(generated.tool_mask) if generated.tool_mask is not None else None
            weights = self.reward_weights.to(self._rewards_per_func.device)
            per_func = self._rewards_per_func
            rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)  # as TRL logs `reward`
            unscorable = torch.isnan(per_func).all(dim=1)
            if not self.accelerator.is_main_process:
                return None
            version = self.state.global_step
            group = self.num_generations
            rollouts = []
            for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
                if unscorable[i]:
                    continue
                mask = [0] * len(prompt) + (list(tool_mask[i]) if tool_mask is not None else [1] * len(completion))
                rollouts.append(Rollout(f"s{step:06d}-p{i // group:04d}-g{i % group:02d}", [*prompt, *completion],
                                        mask, float(rewards[i]), version))
            scored = rewards[~unscorable]
            published = PublishedGRPOStep(step, version, float(scored.mean()) if len(scored) else float("nan"),
                                          rollouts, int(unscorable.sum()))
            p = self.publisher
            with tempfile.TemporaryDirectory() as staging:
                staged = publish_checkpoint(self.accelerator.unwrap_model(self.model), staging,
                                            tokenizer=self.processing_class)
                parts = p.publish(step, rollouts, staged, version, len(self._tokenizer))
            published = replace(published, parts=parts)
            p.published.append(published)
            return published

    return PublishingGRPOTrainer


def publishing_grpo_trainer(*args: Any, **kwargs: Any):  # noqa: ANN201
    """A PublishingGRPOTrainer (TRL's GRPOTrainer arguments plus `publisher` and `on_published`)."""
    return _grpo_trainer_class()(*args, **kwargs)


@dataclass(frozen=True)
class GRPODemoSettings:
    prompts_per_step: int = 8
    num_generations: int = 8  # a GRPO group: completions per prompt
    max_completion_length: int = 32  # most end on EOS, as in RL: the tail is the longest, not a truncated bulk
    learning_rate: float = 3e-3
    temperature: float = 1.0
    seed: int = 0
    parts_per_step: int = 4  # each step published in parts by completion length, then committed (1: whole)


class HeldTrainer:
    """A PublishingGRPOTrainer one step at a time: `run_step(k)` lets TRL train until it has published step k
    and holds it there, so the pipeline processes each step before the next. TRL runs in its own thread; the
    two never compute at once. Subclasses build the trainer (`build_trainer`, with `on_published=self._hold`)."""

    def __init__(self, steps: int, publisher: StepPublisher, engine: RolloutEngine | None = None) -> None:
        self.steps, self.publisher, self.engine = steps, publisher, engine
        self._resume = threading.Semaphore(0)
        self._published = threading.Semaphore(0)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.trainer = None

    def build_trainer(self):  # noqa: ANN201
        raise NotImplementedError

    def pretrained(self) -> torch.nn.Module:
        """The step-0 policy and its trainer."""
        if self.trainer is None:
            self.build_trainer()
        return self.trainer.model

    def _hold(self, _: PublishedGRPOStep) -> None:
        self._published.release()
        self._resume.acquire()

    def _train(self) -> None:
        try:
            self.trainer.train()
        except BaseException as exc:  # noqa: BLE001 (handed to the demo's thread, which raises it)
            self._error = exc
        finally:
            self._published.release()

    def run_step(self, step: int, period_s: float = 0.0) -> PublishedGRPOStep:
        """Let TRL train until step `step` is published, its parts paced over `period_s` (less the commit's
        share; 0: at once) as the simulated source paces its decoding; TRL waits there until the next call
        or `finish`."""
        self.pretrained()
        self.publisher.window_end = time.monotonic() + period_s * ROLLOUT_SHARE_OF_PERIOD if period_s else 0.0
        if self._thread is None:
            self._thread = threading.Thread(target=self._train, name="trl-grpo", daemon=True)
            self._thread.start()
        else:
            self._resume.release()
        self._published.acquire()
        if self._error is not None:
            raise RuntimeError(f"TRL GRPO training failed before publishing step {step}") from self._error
        last = self.publisher.published[-1] if self.publisher.published else None
        if last is None or last.step != step:
            raise RuntimeError(f"TRL published step {last.step if last else 'none'}, expected {step}")
        return last

    def finish(self) -> list[dict[str, float]]:
        """Let TRL finish its last optimizer step; returns its log history."""
        if self._thread is not None:
            self._resume.release()
            self._thread.join()
            if self._error is not None:
                raise RuntimeError("TRL GRPO training failed") from self._error
        return list(self.trainer.state.log_history) if self.trainer else []


class GRPODemo(HeldTrainer):
    """Real GRPO with TRL on CPU on a tiny policy built from nothing, one step at a time for the demo.

    With an `engine` (the fleet), TRL's completions come from it through TRL's `rollout_func`: the trainer's
    current weights go to every replica as the step's policy, then each completion is a request with its own
    seed, ending at EOS or `max_completion_length`. The fleet cannot suppress tokens (TRL's own generation
    suppresses <pad> and <unk>; vLLM would take `allowed_token_ids`, which the stand-in does not serve), so a
    completion from the fleet may hold them; TRL masks completions by length, not by pad id."""

    def __init__(self, store: ObjectStore, run: str, steps: int, output_dir: Path,
                 settings: GRPODemoSettings | None = None, engine: RolloutEngine | None = None) -> None:
        self.settings = s = settings or GRPODemoSettings()
        self.tokenizer = build_tokenizer()
        self.policy = build_policy(self.tokenizer, seed=s.seed)
        publisher = StepPublisher(store, run, target_forward.model_id(self.policy), parts=s.parts_per_step,
                                  sampling=SamplingParams(temperature=s.temperature))
        super().__init__(steps, publisher, engine)
        self.output_dir = output_dir

    def build_trainer(self):  # noqa: ANN201
        from datasets import Dataset
        from transformers import PrinterCallback
        from trl import GRPOConfig

        s = self.settings
        # TRL 1.16 still calls transformers' gradient_checkpointing names, deprecated in transformers 5.
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        args = GRPOConfig(
            output_dir=str(self.output_dir), max_steps=self.steps, per_device_train_batch_size=
            s.prompts_per_step * s.num_generations, num_generations=s.num_generations,
            max_completion_length=s.max_completion_length, learning_rate=s.learning_rate, temperature=s.temperature,
            # float32 compute (GRPOConfig defaults to bf16 autocast): the published fp32 checkpoint then
            # reproduces the logits TRL sampled from, not only to bf16 precision.
            bf16=False,
            beta=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=s.seed,
            disable_tqdm=True, dataloader_num_workers=0,
            # <pad> and <unk> are never sampled: a pad id inside a completion would be indistinguishable
            # from padding, and no real model emits either.
            generation_kwargs={"suppress_tokens": [self.tokenizer.pad_token_id, self.tokenizer.unk_token_id]},
        )
        dataset = Dataset.from_dict({"prompt": prompts(s.prompts_per_step * self.steps, s.seed)})
        self.trainer = publishing_grpo_trainer(
            model=self.policy, reward_funcs=vowel_reward, args=args, train_dataset=dataset,
            processing_class=self.tokenizer, publisher=self.publisher, on_published=self._hold,
            rollout_func=self._fleet_rollouts if self.engine is not None else None)
        self.trainer.remove_callback(PrinterCallback)  # the demo prints its own line per step
        return self.trainer

    def _fleet_rollouts(self, prompts: list, trainer: Any) -> dict[str, list]:
        """TRL's `rollout_func` on the fleet: the weights TRL holds now pushed as the step's policy, then one
        request per completion (TRL repeats each prompt once per generation), tokenized as TRL tokenizes."""
        s, publisher = self.settings, self.publisher
        step = trainer.state.global_step + 1  # the optimizer step these completions train
        policy = target_lib.save_checkpoint(trainer.accelerator.unwrap_model(trainer.model), publisher.store,
                                            f"{fleet_prefix(publisher.run)}/policies/step-{step:06d}",
                                            trainer.processing_class)
        self.engine.push_policy(step, policy)
        prompt_ids = [list(ids) for ids in trainer._tokenize_prompts(prompts)[0]]
        params = SamplingParams(temperature=s.temperature)
        requests = [RolloutRequest(ids, s.max_completion_length, params, request_seed(s.seed, step, i),
                                   (self.tokenizer.eos_token_id,)) for i, ids in enumerate(prompt_ids)]
        done: list[GeneratedRollout | None] = [None] * len(requests)
        for i, rollout in self.engine.generate(requests):
            done[i] = rollout
        return {"prompt_ids": prompt_ids, "completion_ids": [r.token_ids for r in done],
                "logprobs": [r.logprobs for r in done]}
