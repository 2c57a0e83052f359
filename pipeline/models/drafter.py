"""The drafter interface every kind implements, and what `drafter.kind` maps to.

EAGLE-1/2 (`EagleDrafter`), EAGLE-3 (`Eagle3Drafter`) and P-EAGLE (`PEagleDrafter`) differ in
what they read from the target, what they learn from and how they are stored; each says so
through the same methods, so code outside pipeline/models/ never asks which kind it holds. Before
a drafter exists (a new one, or the layers extraction stores for it), its kind is read here and
nowhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from pipeline.models.eagle import CommittedPairs, DraftChooser, EagleConfig, EagleDrafter
from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter, draft_vocab
from pipeline.models.layers import aux_layer_ids, stored_layer_ids  # noqa: F401 - part of this interface
from pipeline.models.peagle import PEagleConfig, PEagleDrafter
from pipeline.models.teacher import Teacher
from pipeline.models.ttt import UnrollPrefix

if TYPE_CHECKING:  # extraction reads the kind here and runs without pydantic on a bare GPU image
    from pipeline.config import DrafterConfig
    from pipeline.data.shard_format import HiddenSample

__all__ = ["CommittedPairs", "DraftChooser", "Drafter", "Proposer", "Teacher", "check_layers", "fresh_drafter",
           "stored_layer_ids", "warm_start_from"]


class Proposer(Protocol):
    """A drafter at decoding time: keeps its own key/value cache over the rows of a batch."""

    layer_ids: list[int] | None  # target layers (vLLM ids) it reads; None = the post-norm last layer
    forwards: int  # drafter forward passes so far (EAGLE: k per proposal; P-EAGLE: 1)

    def propose(self, pairs: CommittedPairs, k: int, chooser: DraftChooser | None = None) -> torch.Tensor:
        """The pairs committed since the last call (the prompts' on the first) -> (B, k) proposed tokens, each
        the drafter's argmax, or the chooser's pick from the drafter's logits."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep the decoding state of `rows` (B',) only, in that order: the requests that left a batch drop out."""
        ...

    def add_rows(self, n: int) -> None:
        """n more rows after the others, nothing of them held: requests joining a batch, whose pairs (their
        prompts') come with the next proposal."""
        ...


class Drafter(Protocol):
    """What every drafter kind does, by the same names. Implementations are `torch.nn.Module`s."""

    kind: str  # the `drafter.kind` of the config that builds it: "eagle" (EAGLE-1/2), "eagle3" or "peagle"
    decode_layer_ids: list[int] | None  # target layers read at decoding time; None = post-norm last layer
    target_hidden_size: int  # width of the target's hidden states it reads (its checkpoint must match the target's)

    def attach(self, target: nn.Module) -> None:
        """Share the current target's (frozen) embeddings, and lm_head where the kind uses the target's."""
        ...

    def stored_layer_ids(self, num_layers: int) -> list[int]:
        """The target layers (vLLM ids) stored hidden states must hold for this drafter to train on."""
        ...

    def training_sample(
        self, sample: HiddenSample, num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A stored sample of a target of `num_layers` layers -> (input_ids (T,), features (T, D), loss_mask (T,))."""
        ...

    def teacher(self, target: nn.Module) -> Teacher | None:
        """What the target lends the loss as soft labels; None when the drafter's own head serves."""
        ...

    def trainable_state_dict(self) -> dict[str, torch.Tensor]: ...

    def checkpoint_config(self) -> dict:
        """config.json of the exported checkpoint, as serving engines read it."""
        ...

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """model.safetensors of the exported checkpoint."""
        ...

    def proposer(self) -> Proposer:
        """A fresh proposer (empty cache) for one batch of speculative decoding."""
        ...

    def draft_unrolled(
        self, features: torch.Tensor, step_ids: list[torch.Tensor], position_ids: torch.Tensor,
        attention_mask: torch.Tensor, prefix: UnrollPrefix | None = None,
    ) -> torch.Tensor:
        """Teacher-forced drafts at every position at once, step j reading step_ids[j] (B, N)
        -> (len(step_ids), B, N) target token ids. With `prefix` (extended by the call), the N positions are one
        chunk after the earlier chunks' and attention_mask (B, 1, N, P + N) covers them all: the drafts equal
        those of one call over the whole sequence."""
        ...


def _eagle3_config(cfg: DrafterConfig, tc, size: int) -> Eagle3Config:
    base = EagleConfig.from_target(tc, cfg.intermediate_size)
    return Eagle3Config(
        vocab_size=tc.vocab_size, draft_vocab_size=size, hidden_size=tc.hidden_size,
        target_hidden_size=tc.hidden_size, intermediate_size=base.intermediate_size,
        num_attention_heads=base.num_attention_heads, num_key_value_heads=base.num_key_value_heads,
        aux_layer_ids=tuple(aux_layer_ids(cfg, tc.num_hidden_layers)),
        rms_norm_eps=base.rms_norm_eps, rope_theta=base.rope_theta, rope_scaling=base.rope_scaling,
        max_position_embeddings=max(base.max_position_embeddings, tc.max_position_embeddings),
        norm_before_residual=cfg.norm_before_residual, fc_norm=cfg.fc_norm, norm_output=cfg.norm_output,
    )


def peagle_config(cfg: DrafterConfig, eagle3: Eagle3Config, t2d: torch.Tensor) -> PEagleConfig:
    """P-EAGLE's config over EAGLE-3's; the mask token, unless set, is the highest target id outside
    the draft vocabulary (a token the drafter never proposes), or the last id when the vocabularies are one."""
    outside = (~t2d).nonzero().flatten()
    mask_token = cfg.mask_token_id if cfg.mask_token_id is not None else \
        int(outside[-1]) if outside.numel() else eagle3.vocab_size - 1
    fields = {f: getattr(eagle3, f) for f in Eagle3Config.__dataclass_fields__}
    return PEagleConfig(**fields, num_hidden_layers=cfg.num_layers, mask_token_id=mask_token,
                        num_depths=cfg.num_depths, down_sample_ratio=cfg.down_sample_ratio,
                        down_sample_ratio_min=cfg.down_sample_ratio_min)


def fresh_drafter(cfg: DrafterConfig, target: nn.Module, token_counts: torch.Tensor, seed: int) -> Drafter:
    """A new drafter shaped after the target; EAGLE-3's and P-EAGLE's draft vocab from the buffer's token counts."""
    torch.manual_seed(seed)
    tc = target.config
    if cfg.kind == "eagle":
        return EagleDrafter(EagleConfig.from_target(tc, cfg.intermediate_size))
    size = cfg.draft_vocab_size or min(32000, tc.vocab_size)
    if size > tc.vocab_size:
        raise ValueError(f"drafter.draft_vocab_size {size} exceeds the target vocab {tc.vocab_size}")
    d2t, t2d = draft_vocab(token_counts, size)
    config = _eagle3_config(cfg, tc, size)
    model = Eagle3Drafter(config) if cfg.kind == "eagle3" else PEagleDrafter(peagle_config(cfg, config, t2d))
    model.set_vocab(d2t, t2d)
    model.attach(target)
    model.init_lm_head(target)
    return model


def warm_start_from(drafter: Drafter, cfg: DrafterConfig) -> Drafter | None:
    """`drafter` as a start for the configured kind: itself when the kinds agree; a P-EAGLE drafter
    built on an EAGLE-3 one (same target); None when nothing carries over."""
    if drafter.kind == cfg.kind:
        return drafter
    if cfg.kind == "peagle" and isinstance(drafter, Eagle3Drafter):
        return PEagleDrafter.from_eagle3(drafter, peagle_config(cfg, drafter.config, drafter.t2d))
    return None


def check_layers(drafter: Drafter, layer_ids: list[int], num_layers: int, where: str) -> None:
    """Stored shards must hold what the drafter reads (a kind switch mid-run would not)."""
    wanted = drafter.stored_layer_ids(num_layers)
    if list(layer_ids) != wanted:
        raise ValueError(f"{where}: hidden states hold layers {list(layer_ids)}, this drafter needs {wanted}; "
                         "re-materialize hidden_states for the buffer's steps")
