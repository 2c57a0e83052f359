"""Source B of hidden states: the step's policy runs forward over the step's rollouts."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from pipeline.config import DrafterConfig, PipelineConfig
from pipeline.data import rollouts as rollouts_lib
from pipeline.data import shards
from pipeline.data.keys import step_key
from pipeline.data.rollouts import Rollout
from pipeline.data.shards import HiddenSample, Manifest
from pipeline.data.store import ObjectStore
from pipeline.models import target as target_lib
from pipeline.models.eagle3 import default_aux_layer_ids
from pipeline.sources import vllm_connector as vllm_hidden_states


def training_rollouts(rollouts: list[Rollout], held_out_fraction: float) -> list[Rollout]:
    return [r for r in rollouts if not rollouts_lib.is_held_out(r.sample_id, held_out_fraction)]


def held_out_rollouts(rollouts: list[Rollout], held_out_fraction: float) -> list[Rollout]:
    return [r for r in rollouts if rollouts_lib.is_held_out(r.sample_id, held_out_fraction)]


def aux_layer_ids(drafter: DrafterConfig, num_layers: int) -> list[int]:
    return list(drafter.aux_layer_ids or default_aux_layer_ids(num_layers))


def stored_layer_ids(drafter: DrafterConfig, num_layers: int) -> list[int] | None:
    """Layers the drafter kind trains on: EAGLE-3 its aux layers plus the last one (for the soft
    labels); EAGLE-1/2 only the post-norm last layer (None)."""
    return [*aux_layer_ids(drafter, num_layers), num_layers] if drafter.kind == "eagle3" else None


@torch.no_grad()
def compute_hidden_states(
    model, rollouts: list[Rollout], step: int, device: str = "cpu", batch_size: int = 32,
    layer_ids: list[int] | None = None,
) -> list[HiddenSample]:
    """bf16 features, one (T, n_layers, H) tensor per rollout: the requested layers (vLLM ids,
    pre-norm), or the post-norm last layer when `layer_ids` is None.

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
            out = target_lib.forward(model, ids, layer_ids)
            features = out.features[:, :, None] if layer_ids is None else out.layers  # (B, T, n_layers, H)
            features = features.to(torch.bfloat16).cpu()
            for r, feat in zip(chunk, features, strict=True):
                samples[r.sample_id] = HiddenSample(
                    sample_id=r.sample_id, step=step,
                    input_ids=torch.tensor(r.input_ids, dtype=torch.int64),
                    loss_mask=torch.tensor(r.loss_mask, dtype=torch.int64),
                    hidden=feat.clone(),  # (T, n_layers, H)
                )
    return [samples[r.sample_id] for r in rollouts]  # keep the rollouts' order


def extract_hidden_states(store: ObjectStore, cfg: PipelineConfig, step: int) -> Manifest:
    """The hidden states of the step's training rollouts, from a forward pass here (source B) or
    from vLLM's connector files (source A), written as shards + manifest."""
    rollouts = rollouts_lib.read_rollouts(store, cfg.run, step)
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    model = target_lib.load_policy(store, pointer.checkpoint_uri, cfg.device, target_lib.load_settings(cfg))
    train = training_rollouts(rollouts, cfg.eval.held_out_fraction)
    num_layers = model.config.num_hidden_layers
    layer_ids = stored_layer_ids(cfg.drafter, num_layers)
    if cfg.hidden_states.source == "vllm":
        samples = _from_vllm(cfg, step, train, model, layer_ids)
    else:
        samples = compute_hidden_states(model, train, step, cfg.device, layer_ids=layer_ids)
    return shards.write_hidden_states(
        store, cfg.run, step, samples,
        hidden_size=model.config.hidden_size,
        # vLLM ids. EAGLE-1/2 reads id L after the final norm (what vLLM's `eagle` method
        # hands its drafter); EAGLE-3 reads raw residual streams.
        layer_ids=layer_ids or [num_layers],
        compression=cfg.storage.compression,
        target={"model_id": pointer.model_id, "policy_version": str(pointer.policy_version),
                "checkpoint_uri": pointer.checkpoint_uri, "source": cfg.hidden_states.source,
                "final_norm": "applied" if layer_ids is None else "not applied"},
    )


@torch.no_grad()
def _from_vllm(cfg: PipelineConfig, step: int, rollouts: list[Rollout], model, layer_ids: list[int] | None):
    directory = Path(cfg.hidden_states.vllm_path.format(step=step_key(step)))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no vLLM hidden-state files (*.safetensors) in {directory}")
    num_layers = model.config.num_hidden_layers
    samples, _unmatched = vllm_hidden_states.join_to_rollouts(
        files, rollouts, step, cfg.hidden_states.vllm_layer_ids, layer_ids or [num_layers]
    )
    if layer_ids is None:  # EAGLE-1/2 reads the last layer after the target's final norm
        samples = [replace(s, hidden=model.model.norm(s.hidden.float()).to(torch.bfloat16)) for s in samples]
    return samples
