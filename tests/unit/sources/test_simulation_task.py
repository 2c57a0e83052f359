"""The simulated source's language: near-deterministic and open contexts, drift, and a policy pre-trained on it."""

from __future__ import annotations

import torch

from pipeline.config import SimulationConfig
from pipeline.models import target as target_lib
from pipeline.sources import simulation
from pipeline.sources.simulation import Task

LANGUAGE = SimulationConfig(vocab_size=32, candidates=16, open_share=0.5, closed_top1=0.95, open_top1=[0.2, 0.6],
                            tail_decay=0.8, drift=0.25)


def test_contexts_are_near_certain_or_open_and_the_favourite_is_the_likeliest() -> None:
    task = Task(LANGUAGE)
    table = task.next_token_probs(0)  # (C, V)
    assert torch.allclose(table.sum(dim=1), torch.ones(task.num_contexts))
    favourite = torch.gather(task.candidates, 1, task.favourite(0)[:, None]).squeeze(1)
    assert torch.equal(table.argmax(dim=1), favourite)
    top1 = table.max(dim=1).values
    closed = torch.isclose(top1, torch.tensor(0.95))
    assert 0.4 < 1 - closed.float().mean() < 0.6  # open_share of the contexts
    assert ((top1[~closed] >= 0.2) & (top1[~closed] <= 0.6)).all()
    assert ((table > 0).sum(dim=1) == 16).all()  # every candidate keeps some probability: the tail
    # a near-certain token leads to an open one, whatever the drift makes the favourite
    assert task.open_tokens[task.candidates[~task.open_tokens]].all()


def test_drift_gives_a_share_of_the_contexts_a_new_favourite_each_step() -> None:
    task = Task(LANGUAGE)
    moved = torch.stack([task.favourite(s) != task.favourite(s - 1) for s in range(1, 11)]).float()  # (10, C)
    assert 0.2 < moved.mean() < 0.3  # drift 0.25 of the contexts a step
    again = Task(LANGUAGE)  # seeded: the same language and drift
    assert torch.equal(again.favourite(5), task.favourite(5))
    assert torch.equal(again.next_token_probs(5), task.next_token_probs(5))


def test_sequences_follow_the_table_and_the_reward_counts_favourites() -> None:
    task = Task(LANGUAGE)
    seqs = task.sample(3, 64, 40, torch.Generator().manual_seed(0))
    targets = task.targets(3, seqs)  # (n, T-1, V)
    drawn = targets.gather(-1, seqs[:, 1:, None]).squeeze(-1)
    assert (drawn > 0).all()  # every token drawn is a candidate of its context
    # the share of favourites is what the table expects of the contexts visited
    expected = targets.max(dim=-1).values[:, 7:].mean()
    assert abs(task.rewards(3, seqs, prompt_len=8).mean() - expected) < 0.05


def test_pre_training_brings_the_policy_to_the_language() -> None:
    cfg = LANGUAGE.model_copy(update={"num_layers": 2, "hidden_size": 32, "num_heads": 2})
    task = Task(cfg)
    model = target_lib.build_target(
        target_lib.tiny_llama_config(cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads), cfg.seed)
    seqs = task.sample(0, 16, 40, torch.Generator().manual_seed(1))
    targets = task.targets(0, seqs)

    def kl() -> float:
        with torch.no_grad():
            logp = model(input_ids=seqs).logits[:, :-1].log_softmax(dim=-1)
        return float((targets * (targets.clamp_min(1e-12).log() - logp)).sum(dim=-1).mean())

    before = kl()
    simulation.pretrain(model, task, 40, 40, torch.Generator().manual_seed(2))
    assert kl() < before / 5
