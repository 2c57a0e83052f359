"""Source A of hidden states: the files vLLM's hidden-state connector writes.

vLLM (>= 0.18) serving with `--speculative-config '{"method": "extract_hidden_states", ...
"eagle_aux_hidden_state_layer_ids": [...]}'` and the `ExampleHiddenStatesConnector` writes,
for every request, `<shared_storage_path>/<req_id>.safetensors`:

    token_ids      (T,)                 int64, the prompt's tokens only
    hidden_states  (T, num_layers, H)   model dtype, layers in the requested order

and holds `<file>.lock`; readers take a shared flock on it while reading. Only prompt
tokens are saved, so each rollout is sent whole as the prompt with `max_tokens: 1`
(`request_hidden_states`). Run vLLM with prefix caching off, or lengths can disagree.

Files are joined to the step's rollouts by their token ids; a file whose tokens match a
rollout only up to a different length is refused with a message naming both.
"""

from __future__ import annotations

import fcntl
import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pipeline.data.rollouts import Rollout
from pipeline.data.shards import HiddenSample


class ConnectorFileError(ValueError):
    """A connector file that cannot be used; the message names the file."""


@contextmanager
def _shared_lock(path: Path) -> Iterator[None]:
    lock = path.with_name(path.name + ".lock")
    if not lock.exists():  # the writer has released and removed it, or never made one
        yield
        return
    with lock.open("rb") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_connector_file(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """-> token_ids (T,) int64 and hidden_states (T, num_layers, H), read under a shared flock."""
    with _shared_lock(path):
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError) as exc:
            raise ConnectorFileError(f"{path}: not a readable safetensors file ({exc})") from None
    missing = {"token_ids", "hidden_states"} - set(tensors)
    if missing:
        raise ConnectorFileError(f"{path}: missing tensor(s) {', '.join(sorted(missing))}")
    token_ids, hidden = tensors["token_ids"], tensors["hidden_states"]
    if token_ids.dim() != 1 or hidden.dim() != 3:
        raise ConnectorFileError(
            f"{path}: token_ids {tuple(token_ids.shape)} / hidden_states {tuple(hidden.shape)}, "
            "expected (T,) and (T, num_layers, H)"
        )
    if hidden.shape[0] != token_ids.shape[0]:
        raise ConnectorFileError(f"{path}: {token_ids.shape[0]} token ids but {hidden.shape[0]} hidden-state rows")
    return token_ids.to(torch.int64), hidden


def join_to_rollouts(
    files: list[Path],
    rollouts: list[Rollout],
    step: int,
    requested_layer_ids: list[int],
    wanted_layer_ids: list[int],
) -> tuple[list[HiddenSample], list[Path]]:
    """Samples for the rollouts the files cover, with the wanted layers picked from the requested
    ones; also the files that match no rollout of this step."""
    missing = [i for i in wanted_layer_ids if i not in requested_layer_ids]
    if missing:
        raise ConnectorFileError(f"layers {missing} were not requested from vLLM (requested {requested_layer_ids})")
    pick = [requested_layer_ids.index(i) for i in wanted_layer_ids]
    by_tokens = {tuple(r.input_ids): r for r in rollouts}
    samples, unmatched = {}, []
    for path in sorted(files):
        token_ids, hidden = read_connector_file(path)
        if hidden.shape[1] != len(requested_layer_ids):
            raise ConnectorFileError(
                f"{path}: {hidden.shape[1]} layers, but {len(requested_layer_ids)} were requested"
            )
        rollout = by_tokens.get(tuple(token_ids.tolist()))
        if rollout is None:
            _refuse_length_mismatch(path, token_ids, rollouts)
            unmatched.append(path)
            continue
        samples[rollout.sample_id] = HiddenSample(
            sample_id=rollout.sample_id, step=step, input_ids=token_ids,
            loss_mask=torch.tensor(rollout.loss_mask, dtype=torch.int64),
            hidden=hidden[:, pick, :].to(torch.bfloat16).contiguous(),
        )
    return [samples[r.sample_id] for r in rollouts if r.sample_id in samples], unmatched


def _refuse_length_mismatch(path: Path, token_ids: torch.Tensor, rollouts: list[Rollout]) -> None:
    tokens = token_ids.tolist()
    for r in rollouts:
        n = min(len(tokens), len(r.input_ids))
        if n > 1 and tokens[:n] == r.input_ids[:n]:
            raise ConnectorFileError(
                f"{path}: its {len(tokens)} tokens match rollout {r.sample_id!r} ({len(r.input_ids)} tokens) "
                "only up to the shorter length; is prefix caching on in vLLM?"
            )


def request_hidden_states(
    base_url: str, model: str, input_ids: list[int], api_key: str | None = None, timeout_s: float = 300.0
) -> str:
    """Ask a running vLLM server for the hidden states of a whole rollout; returns the file path."""
    body = json.dumps({"model": model, "prompt": input_ids, "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{base_url.rstrip('/')}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        payload = json.loads(response.read())
    try:
        return payload["kv_transfer_params"]["hidden_states_path"]
    except (KeyError, TypeError):
        raise ConnectorFileError(
            f"{base_url}: the response has no kv_transfer_params.hidden_states_path; is vLLM running with "
            "the extract_hidden_states method and the hidden-states connector?"
        ) from None
