"""What differs between the drafter kinds, in one place: building, attaching to a target,
and the features and soft labels each one trains on."""

from __future__ import annotations

import torch

from pipeline.config import DrafterConfig
from pipeline.data.shards import HiddenSample
from pipeline.models.eagle import EagleConfig, EagleDrafter
from pipeline.models.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    default_aux_layer_ids,
    draft_vocab,
    read_positions,
    stored_layer_ids,
)
from pipeline.training.dataset import Sample
from pipeline.training.loop import Teacher

Drafter = EagleDrafter | Eagle3Drafter


def fresh_drafter(cfg: DrafterConfig, target, token_counts: torch.Tensor, seed: int) -> Drafter:
    """A new drafter shaped after the target; EAGLE-3's draft vocab from the buffer's token counts."""
    torch.manual_seed(seed)
    tc = target.config
    if cfg.kind == "eagle":
        return EagleDrafter(EagleConfig.from_target(tc, cfg.intermediate_size))
    base = EagleConfig.from_target(tc, cfg.intermediate_size)
    size = cfg.draft_vocab_size or min(32000, tc.vocab_size)
    if size > tc.vocab_size:
        raise ValueError(f"drafter.draft_vocab_size {size} exceeds the target vocab {tc.vocab_size}")
    model = Eagle3Drafter(Eagle3Config(
        vocab_size=tc.vocab_size, draft_vocab_size=size, hidden_size=tc.hidden_size,
        target_hidden_size=tc.hidden_size, intermediate_size=base.intermediate_size,
        num_attention_heads=base.num_attention_heads, num_key_value_heads=base.num_key_value_heads,
        aux_layer_ids=tuple(cfg.aux_layer_ids or default_aux_layer_ids(tc.num_hidden_layers)),
        rms_norm_eps=base.rms_norm_eps, rope_theta=base.rope_theta,
        max_position_embeddings=max(base.max_position_embeddings, tc.max_position_embeddings),
        norm_before_residual=cfg.norm_before_residual, fc_norm=cfg.fc_norm, norm_output=cfg.norm_output,
    ))
    model.set_vocab(*draft_vocab(token_counts, size))
    model.use_target(target, init_lm_head=True)
    return model


def attach_target(drafter: Drafter, target) -> None:
    """Share the current target's embeddings (and, for EAGLE-1/2, its lm_head)."""
    if isinstance(drafter, Eagle3Drafter):
        drafter.use_target(target, init_lm_head=False)
    else:
        drafter.use_target_heads(target)


def teacher(drafter: Drafter, target) -> Teacher | None:
    """EAGLE-3's soft labels come from the target's norm and lm_head rows of the draft vocab."""
    if not isinstance(drafter, Eagle3Drafter):
        return None
    # In the drafter's dtype: a target loaded in bf16 (target.dtype auto on CUDA) meets fp32 drafter states.
    head = target.get_output_embeddings().weight[drafter.draft_to_target].detach().to(drafter.lm_head.weight.dtype)
    return Teacher(norm=target.model.norm.requires_grad_(False), head=head)


def training_sample(drafter: Drafter, sample: HiddenSample, num_layers: int) -> Sample:
    """(input_ids, features (T, D), loss_mask): EAGLE-3 reads its layers [aux..., L] (a layer stored
    once may be read twice), EAGLE-1/2 the last."""
    if isinstance(drafter, Eagle3Drafter):
        positions = read_positions(drafter.config.aux_layer_ids, num_layers)
        return sample.input_ids, sample.hidden[:, positions].flatten(1), sample.loss_mask
    return sample.input_ids, sample.hidden[:, -1, :], sample.loss_mask


def check_layers(drafter: Drafter, layer_ids: list[int], num_layers: int, where: str) -> None:
    """Stored shards must hold what the drafter reads (a kind switch mid-run would not)."""
    wanted = (stored_layer_ids(drafter.config.aux_layer_ids, num_layers) if isinstance(drafter, Eagle3Drafter)
              else [num_layers])
    if list(layer_ids) != wanted:
        raise ValueError(f"{where}: hidden states hold layers {list(layer_ids)}, this drafter needs {wanted}; "
                         "re-materialize hidden_states for the buffer's steps")
