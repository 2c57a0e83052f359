"""Which target layers a drafter reads, and so which layers a step's hidden states store: plain
functions of the drafter config and the target's depth, without torch (the Dagster run process
checks a step's layout with them and imports no model code)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import DrafterConfig


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default (2, L//2, L-3) from 7 layers on (below that it repeats a layer, as at L=6:
    (2, 3, 3)); for shallower targets, three distinct ids spread over [0, L]."""
    if num_layers >= 7:
        return (2, num_layers // 2, num_layers - 3)
    if num_layers < 2:
        raise ValueError("EAGLE-3 needs a target with at least 2 layers")
    return (0, round(num_layers / 2), num_layers)


def eagle3_stored_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The target layers (vLLM ids) an EAGLE-3 drafter's hidden states hold, each once: the aux
    layers, then the last layer L for the soft labels. An id the list repeats (L among the aux
    ids of a small target, or vLLM's (2, 3, 3) at L=6) is stored at its first place only."""
    return list(dict.fromkeys([*aux_layer_ids, num_layers]))


def aux_layer_ids(cfg: DrafterConfig, num_layers: int) -> list[int]:
    """EAGLE-3's aux layers: the configured ones, or vLLM's default for a target of `num_layers`."""
    return list(cfg.aux_layer_ids or default_aux_layer_ids(num_layers))


def stored_layer_ids(cfg: DrafterConfig, num_layers: int) -> list[int] | None:
    """Layers a drafter of `cfg` trains on, each stored once: EAGLE-3 and P-EAGLE their aux layers plus
    the last one (for the soft labels); EAGLE-1/2 only the post-norm last layer (None)."""
    if cfg.kind == "eagle":
        return None
    return eagle3_stored_layer_ids(aux_layer_ids(cfg, num_layers), num_layers)
