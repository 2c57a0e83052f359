"""A policy larger than one device, its decoder layers placed in contiguous blocks across a pod's devices.

    devices[0] (home)   embed_tokens, rotary_emb, layers[0:a], norm, lm_head   inputs and outputs live here
    devices[1]          layers[a:b]
    ...
    devices[n-1]        layers[..:L]

A forward runs the layers one device after the other; between blocks the residual stream (B, T, H)
and what every layer reads beside it (rotary phases, masks, positions) are copied to the next
device, and the last block's output back home for the final norm. Each layer runs whole on one
device: the same kernels over the same operands as on a single device, so the hidden states are
bit-identical to a single-device forward on devices of one kind. Everything a caller touches
outside the decoder (embeddings, final norm, lm_head: the teacher's, and a tied lm_head beside its
embeddings) stays on the home device, which is `model.device`.

Why not transformers' tensor-parallel plan (`tp_plan="auto"`): it splits each projection's
reduction across ranks and sums the partial products by all-reduce, a different summation order
(on two gloo ranks, transformers 5.24, float32: hidden states within 6e-7 of a single process, not
equal), and every rank of a tensor-parallel group must run every forward together, which the
data-parallel ranks sharing a step's rollouts do not.

The split is tested exact for the families in SPLIT_FAMILIES, whose decoder layers pass nothing
to one another but the residual stream; any other family is refused by name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from pipeline.models.memory import MemoryBound, available_memory
from pipeline.models.target_checks import TargetMemoryError, check_memory, memory_needed
from pipeline.models.weights import TargetCheckpointError, WeightsLayout

SplitMode = Literal["none", "layers", "auto"]

# model_type -> what makes its layer split exact: layers that share nothing but the residual stream,
# the rotary phases and the mask, all computed once on the home device and copied to each block.
SPLIT_FAMILIES = {
    "llama": "independent decoder layers",
    "mistral": "independent decoder layers (sliding-window mask copied per block)",
    "qwen2": "independent decoder layers (one mask per layer type, copied per block)",
    "qwen3": "independent decoder layers (q/k norms inside each layer)",
}

LAYER_NAME = re.compile(r"^model\.layers\.(\d+)(?:\.|$)")


class UnsplittableFamilyError(TargetCheckpointError):
    """A family whose layers the split cannot place across devices exactly."""


@dataclass(frozen=True)
class Placement:
    """Where each part of a policy lives: devices[0] is home (embeddings, final norm, lm_head)."""

    devices: tuple[str, ...]  # one per block, in layer order
    layer_blocks: tuple[int, ...]  # (L,) the block (index into devices) of each decoder layer
    block_bytes: tuple[int, ...]  # weights each block holds, in the load dtype

    @property
    def split(self) -> bool:
        return len(self.devices) > 1

    @property
    def home(self) -> str:
        return self.devices[0]

    def device_of(self, name: str) -> str:
        """The device of a module or parameter by its qualified name in the causal-LM model."""
        found = LAYER_NAME.match(name)
        return self.devices[self.layer_blocks[int(found.group(1))]] if found else self.home

    def describe(self) -> str:
        """One line for logs: each device's layers and weight bytes."""
        parts = []
        for block, device in enumerate(self.devices):
            layers = [i for i, b in enumerate(self.layer_blocks) if b == block]
            span = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
            parts.append(f"{device}: {span}, {self.block_bytes[block] / 2**30:.2f} GiB")
        return "; ".join(parts)


def whole(device: str, num_layers: int, needed: int) -> Placement:
    """The policy on one device (no split)."""
    return Placement((device,), (0,) * num_layers, (needed,))


def check_splittable(config: PretrainedConfig, where: str) -> None:
    """UnsplittableFamilyError naming the family, unless its layer split is tested exact."""
    if config.model_type not in SPLIT_FAMILIES:
        raise UnsplittableFamilyError(
            f"{where}: model_type {config.model_type!r} cannot be split across devices (no exact layer split "
            f"for this family); split families: {', '.join(sorted(SPLIT_FAMILIES))}; set target.split: none"
        )


def pod_devices(device: str, count: int) -> list[str]:
    """The devices a split policy may span: `count` devices from the process's own (0: its share of the
    visible CUDA devices, `gpu_block`). On the CPU there is one memory, so `count` blocks all on it (the
    split's code path, no memory gained), and one when count is 0; any other kind of device is one."""
    first = torch.device(device)
    if first.type == "cpu":
        return ["cpu"] * max(count, 1)
    if first.type != "cuda":
        return [device]
    index = first.index if first.index is not None else torch.cuda.current_device()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's ranks on this node
    return [f"cuda:{i}" for i in gpu_block(index, count, torch.cuda.device_count(), ranks)]


def gpu_block(index: int, count: int, visible: int, ranks: int) -> list[int]:
    """The GPUs a split spans from cuda:`index`: `count` of them, or with count 0 every visible one from it
    (one rank on the node) or the node's GPUs shared evenly by its `ranks`. Ranks must not share a GPU, so
    with several ranks a rank's device must be the first of its own block."""
    if ranks > 1:
        count = count or max(visible // ranks, 1)
        if index % count:
            raise ValueError(f"{ranks} ranks on this node split the policy across {count} GPUs each: a rank's "
                             f"device must be the first of its own block (cuda:{count} x k), not cuda:{index}")
    count = count or visible - index
    if index + count > visible:
        raise ValueError(f"target.split_devices is {count} from cuda:{index}, but {visible} CUDA devices are visible")
    return list(range(index, index + count))


def wants_split(mode: SplitMode, needed: int, bound: MemoryBound | None) -> bool:
    """Whether the policy is split: `layers` always, `none` never, `auto` only when its weights need more
    than the process's device may allocate (the memory check's figures; no figure, no split)."""
    if mode == "auto":
        return bound is not None and needed > bound.bytes
    return mode == "layers"


def balance(layer_bytes: list[int], home_bytes: int, blocks: int) -> tuple[int, ...]:
    """(L,) the block of each layer: contiguous blocks whose largest load (block 0 holds `home_bytes`
    besides its layers) is the least any contiguous split reaches: a binary search on that load, each
    candidate checked by filling blocks greedily in layer order (exact for contiguous blocks)."""

    def assign(limit: int) -> tuple[int, ...] | None:
        out, block, load = [], 0, home_bytes
        for size in layer_bytes:
            if load + size > limit:  # the block is full: the layer opens the next one
                block, load = block + 1, 0
            if block >= blocks:
                return None
            out.append(block)
            load += size
        return tuple(out)

    low, high = max([home_bytes, *layer_bytes]), home_bytes + sum(layer_bytes)
    while low < high:
        mid = (low + high) // 2
        if assign(mid) is None:
            low = mid + 1
        else:
            high = mid
    return assign(low)


def plan(config: PretrainedConfig, layout: WeightsLayout, where: str, device: str, dtype: torch.dtype,
         mode: SplitMode, count: int) -> Placement:
    """Where the policy loads: whole on `device` (refused by the memory check when it does not fit), or
    its layers balanced across `pod_devices(device, count)`, each device's share checked against it."""
    num_layers = config.num_hidden_layers
    needed = memory_needed(layout, dtype)
    # `auto` splits across GPUs only: blocks on the one CPU would gain no memory.
    splits = mode == "layers" or (mode == "auto" and torch.device(device).type == "cuda")
    devices = pod_devices(device, count) if splits and wants_split(mode, needed, available_memory(device)) \
        else [device]
    blocks = len(devices)
    if blocks == 1:  # whole, or nowhere to split onto: the memory check refuses what does not fit
        check_memory(layout, where, device, dtype)
        return whole(device, num_layers, needed)
    check_splittable(config, where)
    itemsize = torch.empty((), dtype=dtype).element_size()
    layer_bytes, home_bytes = [0] * num_layers, 0
    for name, entry in layout.tensors.items():
        found = LAYER_NAME.match(name)
        if found:
            layer_bytes[int(found.group(1))] += entry.numel * itemsize
        else:
            home_bytes += entry.numel * itemsize
    layer_blocks = balance(layer_bytes, home_bytes, blocks)
    block_bytes = [home_bytes if b == 0 else 0 for b in range(blocks)]
    for layer, block in enumerate(layer_blocks):
        block_bytes[block] += layer_bytes[layer]
    placement = Placement(tuple(devices), layer_blocks, tuple(block_bytes))
    # Tensors stored in another dtype pass through a staging tensor on the CPU, one at a time.
    staging = needed - sum(e.numel for e in layout.tensors.values()) * itemsize
    _check_blocks(placement, where, dtype, staging)
    return placement


def _check_blocks(placement: Placement, where: str, dtype: torch.dtype, staging: int = 0) -> None:
    """TargetMemoryError naming the device and both figures when its blocks need more than it may allocate
    (blocks on one device, as on the CPU, add up; the CPU also holds the `staging` bytes)."""
    per_device: dict[str, int] = {"cpu": staging} if "cpu" in placement.devices else {}
    for device, size in zip(placement.devices, placement.block_bytes, strict=True):
        per_device[device] = per_device.get(device, 0) + size
    for device, needed in per_device.items():
        bound = available_memory(device)
        if bound is not None and needed > bound.bytes:
            raise TargetMemoryError(
                f"{where}: split across {len(placement.devices)} devices, {device} needs {needed} bytes "
                f"({needed / 2**30:.1f} GiB) for its layers in {dtype}, more than the {bound.bytes} bytes "
                f"({bound.bytes / 2**30:.1f} GiB) this process may use ({bound.source}); split across more "
                "devices (target.split_devices), or load in a smaller target.dtype"
            )


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device (nothing kept) and their buffers
    where they are created, so buffers computed at construction (rotary inv_freq) hold the very values
    a single-device build computes. Process-wide while the model is built, as `no_init_weights`'
    patches of torch's init functions are (accelerate's `init_empty_weights` patches the same way)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def allocate(model: PreTrainedModel, placement: Placement) -> None:
    """Every meta parameter replaced by an uninitialised one on its placement's device, buffers moved
    there; a tied parameter stays one parameter (both names are on the home device)."""
    made: dict[int, nn.Parameter] = {}
    for name, module in model.named_modules():
        device = placement.device_of(name)
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                               requires_grad=param.requires_grad)
            module._parameters[key] = made[id(param)]
        for key, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[key] = buffer.to(device)


def _moved(value: Any, device: str) -> Any:
    """Tensors in `value` (nested in tuples, lists, dicts) on `device`; anything else (a KV cache) as is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(_moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


def _inputs_to(device: str):
    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _moved(args, device), _moved(kwargs, device)
    return hook


def connect(model: PreTrainedModel, placement: Placement) -> None:
    """Each decoder layer's inputs copied to its device, and the last layer's output back home for the
    final norm. Registered at load, before any hook a forward adds, so those see the copied inputs.
    A whole policy gets no hooks; either way the model records its placement."""
    model.layer_placement = placement
    if not placement.split:
        return
    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(_inputs_to(placement.devices[placement.layer_blocks[index]]),
                                        with_kwargs=True)
    model.model.norm.register_forward_pre_hook(_inputs_to(placement.home), with_kwargs=True)


def placement_of(model: PreTrainedModel) -> Placement:
    """Where a loaded policy lives: its split, or the whole policy on `model.device`."""
    found = getattr(model, "layer_placement", None)
    if found is not None:
        return found
    needed = sum(p.numel() * p.element_size() for p in model.parameters())
    return whole(str(model.device), model.config.num_hidden_layers, needed)
