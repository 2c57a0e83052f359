"""The `disk` weight-transfer engine: a running replica loads a safetensors checkpoint directory in place.

    POST /init_weight_transfer_engine  {"init_info": {}}
    POST /pause?mode=keep
    POST /start_weight_update  |  /start_draft_weight_update      the policy, or the speculative drafter
    POST /update_weights       {"update_info": {"path": "/dir/with/safetensors"}}
    POST /finish_weight_update {"weight_version": "..."}
    POST /resume

The checkpoint is read where the replica runs, tensor by tensor (memory bounded by one tensor, not the model),
and handed to the model's own `load_weights`, which maps checkpoint names as at start-up (an EAGLE-3 drafter's
`midlayer.*`, `d2t`; a Llama's q/k/v into its fused projection). vLLM's layerwise reload brackets the session so
that weights a platform repacks after loading (oneDNN's on CPU) are repacked from the new ones.

vLLM's built-in backends move weights between processes (NCCL, CUDA IPC) and need a GPU; this one needs a volume
both sides read, which is how the pipeline stages checkpoints for its replicas anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "disk"


@dataclass
class DiskInitInfo(WeightTransferInitInfo):
    """Nothing to set up: no rendezvous, the checkpoint is on a shared volume."""


@dataclass
class DiskUpdateInfo(WeightTransferUpdateInfo):
    path: str = ""  # a directory of *.safetensors files, as the pipeline stages a checkpoint

    def __post_init__(self) -> None:
        if not self.path or not Path(self.path).is_absolute():
            raise ValueError("update_info.path must be an absolute directory of safetensors files")


def checkpoint_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's safetensors files, one at a time. A link is refused: the path names the
    checkpoint the caller staged, not whatever a link in it points to."""
    if directory.is_symlink() or not directory.is_dir():
        raise ValueError(f"{directory}: not a directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no safetensors file")
    for file in files:
        if file.is_symlink():
            raise ValueError(f"{file}: a link, refused")
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class DiskWeightTransferEngine(WeightTransferEngine[DiskInitInfo, DiskUpdateInfo]):
    init_info_cls = DiskInitInfo
    update_info_cls = DiskUpdateInfo

    def init_transfer_engine(self, init_info: DiskInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        retie_head(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class synchronizes the accelerator after receiving, which raises on a CPU; reading a file
        # is synchronous already.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DiskUpdateInfo) -> None:
        self.model.load_weights(checkpoint_tensors(Path(update_info.path)))

    def shutdown(self) -> None:
        pass


def retie_head(model: torch.nn.Module) -> None:
    """A policy with tied embeddings (SmolLM2, Llama 3.2 1B/3B) has no `lm_head.weight` in its checkpoint: vLLM's
    layerwise reload, finding nothing loaded into the head, puts the head's old tensors back, so the new policy
    would embed with its own weights and score tokens with the old ones. The head is tied to the new embedding
    again, and repacked as at load (the CPU's GEMM keeps a packed copy)."""
    config = getattr(model, "config", None)
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embed is None:
        return
    head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, DiskWeightTransferEngine)
    except ValueError:  # registered already: vLLM may load general plugins more than once in a process
        pass
