"""What the target lends a drafter's training as soft labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Teacher:
    """The target's final norm and lm_head rows of the draft vocabulary: EAGLE-3's soft labels."""

    norm: torch.nn.Module
    head: torch.Tensor  # (draft_vocab, H_t)
