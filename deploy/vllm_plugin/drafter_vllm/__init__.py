"""The drafter pipeline's vLLM plugin, loaded by vLLM in each of its processes (entry point group
`vllm.general_plugins`) before the platform registers its kernels:

* `disk`: a weight-transfer engine that loads a safetensors checkpoint directory into the running model, the
  policy's or (after /start_draft_weight_update) the drafter's: how the pipeline updates a replica in place
  when the checkpoint is on a volume the replica reads (`disk_engine`).
* On a CPU without triton-cpu, vLLM's C++ stand-in for the rejection sampler's `expand_kernel` loses every
  float output (the per-token temperature and top-p): `cpu_sampling` puts a dtype-preserving version in its
  place, so drafts are verified at the request's real temperature.
* `CpuHiddenStatesConnector`: vLLM's hidden-states connector (the `extract_hidden_states` method's writer),
  runnable on a CPU; named by module path in `--kv-transfer-config`, so nothing registers it here
  (`hidden_states_connector`).

The two registered here are safe to load more than once, as vLLM requires of general plugins.
"""

from __future__ import annotations


def register() -> None:
    from drafter_vllm import cpu_sampling, disk_engine

    disk_engine.register()
    cpu_sampling.register()
