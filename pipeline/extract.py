"""Source B of hidden states: the step's policy runs forward over the step's rollouts."""

from __future__ import annotations

from collections import defaultdict

import torch

from pipeline import rollouts as rollouts_lib
from pipeline import shards
from pipeline import target as target_lib
from pipeline.rollouts import Rollout
from pipeline.shards import HiddenSample, Manifest
from pipeline.store import ObjectStore


def training_rollouts(rollouts: list[Rollout], held_out_fraction: float) -> list[Rollout]:
    return [r for r in rollouts if not rollouts_lib.is_held_out(r.sample_id, held_out_fraction)]


def held_out_rollouts(rollouts: list[Rollout], held_out_fraction: float) -> list[Rollout]:
    return [r for r in rollouts if rollouts_lib.is_held_out(r.sample_id, held_out_fraction)]


@torch.no_grad()
def compute_hidden_states(
    model, rollouts: list[Rollout], step: int, device: str = "cpu", batch_size: int = 32
) -> list[HiddenSample]:
    """Post-norm last-layer features, bf16, one (T, 1, H) tensor per rollout.

    Rollouts are grouped by length so that batches need no padding (padding would
    change nothing for causal attention, but costs compute and needs masks).
    """
    by_length: dict[int, list[Rollout]] = defaultdict(list)
    for r in rollouts:
        by_length[len(r.input_ids)].append(r)
    samples: dict[str, HiddenSample] = {}
    for group in by_length.values():
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            ids = torch.tensor([r.input_ids for r in chunk], dtype=torch.int64, device=device)  # (B, T)
            features = target_lib.forward(model, ids).features.to(torch.bfloat16).cpu()  # (B, T, H)
            for r, feat in zip(chunk, features, strict=True):
                samples[r.sample_id] = HiddenSample(
                    sample_id=r.sample_id, step=step,
                    input_ids=torch.tensor(r.input_ids, dtype=torch.int64),
                    loss_mask=torch.tensor(r.loss_mask, dtype=torch.int64),
                    hidden=feat[:, None, :].clone(),  # (T, 1, H)
                )
    return [samples[r.sample_id] for r in rollouts]  # keep the rollouts' order


def extract_hidden_states(
    store: ObjectStore, run: str, step: int, held_out_fraction: float, device: str = "cpu"
) -> Manifest:
    """Read the step's rollouts and policy, write the training rollouts' hidden states."""
    rollouts = rollouts_lib.read_rollouts(store, run, step)
    pointer = rollouts_lib.read_policy_pointer(store, run, step)
    model = target_lib.load_checkpoint(target_lib.resolve_uri(store, pointer.checkpoint_uri), device)
    train = training_rollouts(rollouts, held_out_fraction)
    samples = compute_hidden_states(model, train, step, device)
    num_layers = model.config.num_hidden_layers
    return shards.write_hidden_states(
        store, run, step, samples,
        hidden_size=model.config.hidden_size,
        # vLLM convention: id L is the last layer; here after the final norm (what an
        # EAGLE-1/2 drafter and vLLM's `eagle` method consume).
        layer_ids=[num_layers],
        target={"model_id": pointer.model_id, "policy_version": str(pointer.policy_version),
                "checkpoint_uri": pointer.checkpoint_uri, "final_norm": "applied"},
    )
