"""A few steps of TRL's GRPO on SmolLM2-135M-Instruct, timed by phase, each step published through the
trainer client (pipeline/sources/arithmetic_grpo.py):

    python -m recipes.grpo_smollm2 [--steps 4] [--update full|lora-proxy]

Per step: the wall time, its rollout generation, its publication (checkpoint and rollouts written
through the client) and the rest (rewards, log-probabilities, the policy update), the mean reward,
TRL's entropy, and how far the weights have moved from the base policy. A step's mean reward is
over its own few prompts, so it swings with their difficulty; the held-out reward (the same
questions, `--eval-samples` answers each at the rollouts' temperature, before the first step and
after the last) says whether the policy got better at the task. `--update lora-proxy`
freezes every weight matrix and trains only the norms: the backward still runs through every layer
for the input gradients, as LoRA's does, so its update time bounds what LoRA could save.

    .data/grpo-smollm2/<update>/steps.json    the figures
    .data/grpo-smollm2/<update>/store/        what the trainer published
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import TrainerCallback

from pipeline.data.store import ObjectStore
from pipeline.sources import arithmetic, arithmetic_grpo, smollm2

DEFAULT_OUT = smollm2.DEFAULT_DATA / "grpo-smollm2"
HELD_OUT_SEED = 1  # the training prompts are arithmetic.questions(..., settings.seed)


@dataclass(frozen=True)
class StepFigures:
    step: int
    wall_s: float
    generation_s: float
    publish_s: float
    update_s: float  # the rest: rewards, log-probabilities, backward, optimizer
    reward: float
    entropy: float
    completion_tokens: float  # mean per completion
    drift: float  # ||theta - theta_0|| / ||theta_0|| after the step


class _StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.begin: list[float] = []
        self.end: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 (transformers' signature)
        self.begin.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.end.append(time.perf_counter())


def held_out_reward(model, tokenizer, questions: list[arithmetic.Question], samples: int, seed: int,
                    settings: arithmetic_grpo.GRPOSettings) -> float:
    """Mean exact-answer reward of `samples` answers per question, sampled at the rollouts' temperature."""
    repeated = [q for q in questions for _ in range(samples)]
    answers = smollm2.sample_answers(model, tokenizer, [q.text for q in repeated], settings.temperature,
                                     settings.max_completion_length, seed, batch_size=len(repeated))
    rewards = [arithmetic.reward(tokenizer.decode(a.answer_ids, skip_special_tokens=True), q.answer)
               for a, q in zip(answers, repeated, strict=True)]
    return sum(rewards) / len(rewards)


def run(steps: int, update: str, out: Path, settings: arithmetic_grpo.GRPOSettings, eval_questions: int,
        eval_samples: int) -> tuple[list[StepFigures], tuple[float, float]]:
    checkpoint = smollm2.prepare()
    out = out / update
    shutil.rmtree(out, ignore_errors=True)
    store = ObjectStore((out / "store").resolve().as_uri())
    timer = arithmetic_grpo.RolloutTimer()
    trainer = arithmetic_grpo.build_trainer(checkpoint, store, "grpo", steps, out / "trl", settings,
                                            rollouts=timer.wrap(arithmetic_grpo.local_rollouts(settings)))
    model = trainer.model
    if update == "lora-proxy":
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("norm.weight"))
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    publish_s: list[float] = []
    publish = trainer.publisher.publish

    def timed_publish(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return publish(*args, **kwargs)
        finally:
            publish_s.append(time.perf_counter() - start)

    trainer.publisher.publish = timed_publish
    clock = _StepClock()
    drift: list[float] = []

    class _Drift(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            drift.append(arithmetic_grpo.parameter_drift(model, reference))

    trainer.add_callback(clock)
    trainer.add_callback(_Drift())
    questions = arithmetic.questions(eval_questions, seed=HELD_OUT_SEED)
    tokenizer = trainer.processing_class
    before = held_out_reward(model, tokenizer, questions, eval_samples, 0, settings) if eval_questions else float("nan")
    trainer.train()
    after = held_out_reward(model, tokenizer, questions, eval_samples, 0, settings) if eval_questions else float("nan")
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    figures = []
    for i in range(steps):
        wall = clock.end[i] - clock.begin[i]
        figures.append(StepFigures(i + 1, wall, timer.seconds[i], publish_s[i], wall - timer.seconds[i] - publish_s[i],
                                   logs[i]["reward"], logs[i].get("entropy", float("nan")),
                                   logs[i].get("completions/mean_length", float("nan")), drift[i]))
    (out / "steps.json").write_text(json.dumps({
        "settings": asdict(settings), "update": update, "steps": [asdict(f) for f in figures],
        "held_out_reward": {"questions": eval_questions, "samples": eval_samples, "before": before, "after": after},
    }, indent=2))
    return figures, (before, after)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.grpo_smollm2", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--update", choices=["full", "lora-proxy"], default="full")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--eval-questions", type=int, default=8, help="held-out questions (0: no held-out reward)")
    parser.add_argument("--eval-samples", type=int, default=4, help="answers per held-out question")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    settings = arithmetic_grpo.GRPOSettings(prompts_per_step=args.prompts, num_generations=args.generations,
                                            learning_rate=args.lr)
    figures, (before, after) = run(args.steps, args.update, args.out, settings, args.eval_questions,
                                   args.eval_samples)
    sys.stdout.write("step  wall s  gen s  publish s  update s  reward  entropy  tokens  drift\n")
    for f in figures:
        sys.stdout.write(f"{f.step:4d} {f.wall_s:7.1f} {f.generation_s:6.1f} {f.publish_s:10.1f} {f.update_s:9.1f} "
                         f"{f.reward:7.3f} {f.entropy:8.3f} {f.completion_tokens:7.1f} {f.drift:.2e}\n")
    sys.stdout.write(f"held-out reward: {before:.3f} before the first step, {after:.3f} after the last\n")


if __name__ == "__main__":
    main()
