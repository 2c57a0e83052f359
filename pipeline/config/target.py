"""`target`: how the RL policy (the target) loads, and across how many GPUs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.section import Section


class TargetConfig(Section):
    """How the RL policy (the target) loads: its checkpoints are transformers directories of safetensors."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weights dtype of the loaded policy; `auto`: bfloat16 on CUDA, float32 elsewhere."
    )
    cache_dir: str = Field(
        default="", description="Local copies of policies on object storage; `<data_dir>/target-cache` when empty."
    )
    cache_max_gb: float = Field(
        default=64.0, gt=0, description="Size limit of `cache_dir`; least recently used copies are evicted."
    )
    cached_policies: int = Field(
        default=1, ge=0, description="Loaded policies a process keeps, so a step's assets load its policy once."
    )
    split: Literal["none", "layers", "auto"] = Field(
        default="auto",
        description="A policy's decoder layers across the GPUs from the process's own: `auto` when it does "
                    "not fit that GPU (the load's memory check), `layers` always, `none` never "
                    "(pipeline/models/layer_split.py).",
    )
    split_devices: int = Field(
        default=0, ge=0,
        description="GPUs a split policy spans, from the process's own; 0: every visible one from it, or with "
                    "several ranks on the node (torchrun's LOCAL_WORLD_SIZE) an even share each.",
    )

    @property
    def gpus_per_process(self) -> int:
        """GPUs one rank of extraction or evaluation holds: a split's `split_devices` when set, else one (its pod
        requests that many per rank, and rank r starts at cuda:r x that, the first GPU of its block)."""
        return self.split_devices if self.split != "none" and self.split_devices > 1 else 1

    @model_validator(mode="after")
    def _split_has_devices(self) -> TargetConfig:
        if self.split != "none" and self.split_devices == 1:
            raise ValueError(f"target.split_devices is 1: target.split {self.split} needs 0 (the process's share of "
                             "the GPUs) or at least 2; set target.split: none to load on one device")
        return self
