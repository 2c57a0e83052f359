"""Source B of hidden states: the step's policy runs forward over the step's rollouts."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from queue import Empty, Full, Queue
from typing import TYPE_CHECKING

import torch

from pipeline.data import capture, shards
from pipeline.data import rollouts as rollouts_lib
from pipeline.data.keys import step_key
from pipeline.data.rollouts import Rollout, TargetLimits
from pipeline.data.run_layout import TargetLayout
from pipeline.data.shard_format import HiddenSample, Manifest, ShardError
from pipeline.data.store import ObjectStore
from pipeline.launch.rendezvous import private_dir
from pipeline.models import target as target_lib
from pipeline.models import target_forward
from pipeline.models.layers import stored_layer_ids
from pipeline.ranks import SINGLE, Ranks
from pipeline.sources import vllm_connector as vllm_hidden_states

if TYPE_CHECKING:  # the forward path also runs without pydantic (benchmarks/extraction.py on a bare GPU image)
    from pipeline.config import PipelineConfig


def plan_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Forward batches as indices into `lengths`: longest first, each batch as many samples as fit
    `tokens_per_batch` once padded to its longest (a longer sample forms a batch alone).

        lengths  [5, 3, 8, 2, 7], tokens_per_batch 16
        sorted   8(#2) 7(#4) 5(#0) 3(#1) 2(#3)
        batches  [2, 4]     2 x 8 = 16 padded tokens (a third sample: 3 x 8 = 24)
                 [0, 1, 3]  3 x 5 = 15

    Sorting keeps padding small: a batch's samples differ in length only as much as neighbours
    in the sorted order do.
    """
    if tokens_per_batch < 1:
        raise ValueError(f"tokens_per_batch must be >= 1, got {tokens_per_batch}")
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= tokens_per_batch:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@dataclass(frozen=True)
class _Batch:
    rollouts: list[Rollout]
    features: torch.Tensor  # (B, n_layers, T, H) bf16 on the host: layer-major, so each layer of a sample is contiguous
    copied: torch.cuda.Event | None = None  # from a GPU: recorded when `features` holds the copy

    def ready(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.features


@torch.no_grad()
def _forward_batches(model, rollouts: list[Rollout], lengths: list[int], plan: list[list[int]], device: str,
                     layer_ids: list[int] | None) -> Iterator[_Batch]:
    # From a GPU, each batch's copy to the host runs on its own stream, beside the next batch's forward.
    copy_stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None
    for batch in plan:
        chunk = [rollouts[i] for i in batch]
        ids = torch.zeros(len(chunk), lengths[batch[0]], dtype=torch.int64)  # (B, T), right-padded with 0
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.tensor(rollouts[i].input_ids[: lengths[i]], dtype=torch.int64)
        layers = target_forward.layer_states(model, ids.to(device), layer_ids)  # n x (B, T, H)
        features = torch.stack([x.to(torch.bfloat16) for x in layers], dim=1)  # (B, n, T, H)
        del layers
        if copy_stream is None:
            yield _Batch(chunk, features)
            continue
        # Pinned: the copy runs at PCIe speed, and torch's pinned-memory cache hands a batch's block
        # to a later batch once the writer has let go of its samples (no fresh pages to fault in).
        host = torch.empty(features.shape, dtype=features.dtype, pin_memory=True)
        copy_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(copy_stream):
            host.copy_(features, non_blocking=True)
            features.record_stream(copy_stream)  # its memory is not reused before the copy is done
        copied = torch.cuda.Event()
        copied.record(copy_stream)
        yield _Batch(chunk, host, copied)


def _queued_ahead(batches: Iterator[_Batch]) -> Iterator[_Batch]:
    """`batches`, each yielded once the next one is queued on the GPU: its forward runs there while
    the caller writes this batch's samples. No thread: a GPU runs queued work on its own, and a
    producer thread here was measured to cost a quarter of the forward's throughput on an H100."""
    pending = None
    for batch in batches:
        if pending is not None:
            yield pending
        pending = batch
    if pending is not None:
        yield pending


def _computed_ahead(batches: Iterator[_Batch]) -> Iterator[_Batch]:
    """`batches`, computed one ahead on a thread (a CPU forward runs where it is called): the next
    forward runs while the caller writes this batch's samples (at most three batches exist:
    written, queued, computing)."""
    queue: Queue = Queue(maxsize=1)
    stop = threading.Event()

    def produce() -> None:
        try:
            for batch in batches:
                while not stop.is_set():
                    with suppress(Full):
                        queue.put(batch, timeout=0.1)
                        break
                if stop.is_set():
                    return
            queue.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            queue.put(exc)

    thread = threading.Thread(target=produce, name="extract-forward", daemon=True)
    thread.start()
    try:
        while (item := queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        with suppress(Empty):
            queue.get_nowait()  # unblock a producer waiting to put
        thread.join()


def iter_hidden_states(
    model, rollouts: list[Rollout], step: int, *, tokens_per_batch: int, device: str = "cpu",
    layer_ids: list[int] | None = None, windows: dict[str, tuple[int, int]] | None = None,
) -> Iterator[HiddenSample]:
    """bf16 features of each rollout, (T, n_layers, H): the requested layers (vLLM ids, pre-norm),
    or the post-norm last layer when `layer_ids` is None; batch by batch (`plan_batches`), so that
    a caller that writes them as they come holds a few batches, never the step.

    With `windows` (sample id -> [start, end), a capture plan's), a rollout runs forward up to its
    window's end only and only the window is kept, with `start` as its position offset.

    Batches are right-padded and run without an attention mask: causal attention never lets a
    token see the padding after it, and positions count from 0 in every row, so each sample's
    states are those of a forward of it alone (tests/unit/sources/test_extract.py).
    """
    bounds = [windows[r.sample_id] if windows else (0, len(r.input_ids)) for r in rollouts]
    lengths = [end for _, end in bounds]
    plan = plan_batches(lengths, tokens_per_batch)
    ahead = _queued_ahead if torch.device(device).type == "cuda" else _computed_ahead
    by_id = {r.sample_id: window for r, window in zip(rollouts, bounds, strict=True)}
    for batch in ahead(_forward_batches(model, rollouts, lengths, plan, device, layer_ids)):
        for r, feat in zip(batch.rollouts, batch.ready(), strict=True):
            start, end = by_id[r.sample_id]
            yield HiddenSample(
                sample_id=r.sample_id, step=step,
                input_ids=torch.tensor(r.input_ids[start:end], dtype=torch.int64),
                loss_mask=torch.tensor(r.loss_mask[start:end], dtype=torch.int64),
                hidden=feat[:, start:end].permute(1, 0, 2),  # (T, n_layers, H) view of the batch
                position_offset=start,
            )


def extract_hidden_states(store: ObjectStore, cfg: PipelineConfig, step: int, ranks: Ranks = SINGLE) -> Manifest | None:
    """The hidden states of the step's capture plan (capture.py: which training rollouts, each one's
    training window), from a forward pass (source B) or from vLLM's connector files (source A: files
    another system's vLLM wrote, or those of a capture replica this stage starts, `vllm_capture`),
    written as shards + manifest; the plan is stored first. Returns the manifest (None on ranks but 0).

    Source B on `ranks`: the captured rollouts, longest window end first, are cut into shards
    (`shards.shard_cuts`) and each rank forwards and writes every world_size-th shard, batch by batch
    (`iter_hidden_states` over the shard's rollouts), as its samples are computed; rank 0 commits the
    manifest. A shard's batches are cut from its own samples, so its bytes are the same whichever rank
    and however many ranks compute it."""
    pointer = rollouts_lib.read_policy_pointer(store, cfg.run, step)
    digest = rollouts_lib.committed_digest(store, cfg.run, step)  # before the read: a republish later is seen
    device = ranks.device(cfg.device, cfg.target.gpus_per_process)
    model = target_lib.load_policy(store, pointer.checkpoint_uri, device, target_lib.load_settings(cfg))
    # Token ids and lengths are checked against the policy that reads them, before its forward pass.
    rollouts = rollouts_lib.read_rollouts(store, cfg.run, step, TargetLimits.of(model.config))
    plan = capture.plan_capture(rollouts, step, held_out_fraction=cfg.eval.held_out_fraction,
                                window_tokens=cfg.train.window_tokens, max_samples=cfg.capture.max_samples,
                                max_tokens=cfg.capture.max_tokens)
    if ranks.is_main:
        capture.write_plan(store, cfg.run, plan)  # deterministic: a rerun writes the same plan
    windows = plan.bounds()
    train = [r for r in rollouts if r.sample_id in windows]
    num_layers = model.config.num_hidden_layers
    layer_ids = stored_layer_ids(cfg.drafter, num_layers)
    stored = layer_ids or [num_layers]  # vLLM ids. EAGLE-1/2 reads id L after the final norm (what vLLM's
    # `eagle` method hands its drafter); EAGLE-3 reads raw residual streams.
    target = {"model_id": pointer.model_id, "policy_version": str(pointer.policy_version),
              "checkpoint_uri": pointer.checkpoint_uri, "source": cfg.hidden_states.source,
              "final_norm": "applied" if layer_ids is None else "not applied", "rollouts_digest": digest}
    layout = TargetLayout.from_config(model.config.to_dict(), stored)
    lease_s, lease_wait_s = cfg.storage.step_lease_s, cfg.storage.step_lease_wait_s
    if cfg.hidden_states.source != "forward":  # one rank (config/pipeline.py): the connector's files are read here
        if cfg.hidden_states.source == "capture":
            samples, ingest = _from_capture_replica(store, cfg, step, pointer.checkpoint_uri, rollouts, train,
                                                    windows, model, layer_ids)
        else:
            directory = Path(cfg.hidden_states.vllm_path.format(step=step_key(step)))
            samples, ingest = _from_vllm(cfg, step, directory, cfg.hidden_states.vllm_layer_ids, rollouts, windows,
                                         model, layer_ids)
        return shards.write_hidden_states(
            store, cfg.run, step, samples, hidden_size=model.config.hidden_size, layer_ids=stored,
            compression=cfg.shard_compression, target=target, layout=layout, ingest=ingest, lease_s=lease_s,
            lease_wait_s=lease_wait_s)
    if not train:
        raise ShardError(f"step {step}: no samples to write (empty step)")
    ordered = sorted(train, key=lambda r: -windows[r.sample_id][1])  # the order plan_batches forwards them in
    cuts = shards.shard_cuts([end - start for start, end in (windows[r.sample_id] for r in ordered)],
                             len(stored) * model.config.hidden_size * 2, cfg.hidden_states.samples_per_shard)

    def forward(part: list[Rollout]) -> Callable[[], Iterator[HiddenSample]]:
        return lambda: iter_hidden_states(model, part, step, tokens_per_batch=cfg.hidden_states.tokens_per_batch,
                                          device=device, layer_ids=layer_ids, windows=windows)

    units = [shards.ShardUnit(i, forward(ordered[cut.start : cut.stop])) for i, cut in enumerate(cuts)]
    return shards.write_hidden_states_ranked(
        store, cfg.run, step, ranks.mine(units), ranks, hidden_size=model.config.hidden_size, layer_ids=stored,
        target=target, compression=cfg.shard_compression, layout=layout, lease_s=lease_s,
        lease_wait_s=lease_wait_s)


def _from_capture_replica(store: ObjectStore, cfg: PipelineConfig, step: int, checkpoint_uri: str,
                          rollouts: list[Rollout], train: list[Rollout], windows: dict[str, tuple[int, int]], model,
                          layer_ids: list[int] | None) -> tuple[list[HiddenSample], dict[str, int]]:
    """A capture replica of the step's policy writes the hidden states of the plan's rollouts (`train`, each sent
    whole) into a directory of this stage's own, read back as a `vllm` source's files are; the directory goes
    once its samples are in memory."""
    # Here, not at the top: the config (pydantic) and the drivers are not on a bare GPU image's forward path.
    from pipeline.config import PROJECT_ROOT
    from pipeline.serving.drivers import VllmServer
    from pipeline.sources import vllm_capture

    requested = layer_ids or [model.config.num_hidden_layers]
    v = cfg.fleet.vllm
    server = VllmServer(PROJECT_ROOT / v.python, v.dtype, v.max_model_len, v.kv_cache_gib, tuple(v.extra_args))
    root = cfg.data_path / "capture"
    directory = root / step_key(step)
    shutil.rmtree(directory, ignore_errors=True)  # an interrupted earlier try's files: matched to no request now
    private_dir(directory)
    try:
        captured = vllm_capture.capture(
            server, str(target_lib.policy_directory(store, checkpoint_uri, target_lib.load_settings(cfg))), train,
            requested, directory, root / "replica", cfg.hidden_states.capture_concurrency)
        dtypes = vllm_hidden_states.HIDDEN_DTYPES if v.dtype == "auto" else (getattr(torch, v.dtype),)
        samples, ingest = _from_vllm(cfg, step, directory, requested, rollouts, windows, model, layer_ids,
                                     captured.names, dtypes)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return samples, {**ingest, **captured.metadata()}


@torch.no_grad()
def _from_vllm(cfg: PipelineConfig, step: int, directory: Path, requested: list[int], rollouts: list[Rollout],
               windows: dict[str, tuple[int, int]], model, layer_ids: list[int] | None,
               names: dict[str, str] | None = None,
               dtypes: tuple[torch.dtype, ...] = vllm_hidden_states.HIDDEN_DTYPES,
               ) -> tuple[list[HiddenSample], dict[str, int]]:
    num_layers = model.config.num_hidden_layers
    ingested = vllm_hidden_states.ingest_directory(
        directory, rollouts, step, requested, layer_ids or [num_layers],
        hidden_size=model.config.hidden_size, train_ids=set(windows), windows=windows,
        max_unmatched_share=cfg.hidden_states.max_unmatched_share, names=names, hidden_dtypes=dtypes,
    )
    if not ingested.samples:
        raise FileNotFoundError(f"no vLLM hidden-state files (*.safetensors) for this step's rollouts in {directory}")
    samples = ingested.samples
    if layer_ids is None:  # EAGLE-1/2 reads the last layer after the target's final norm
        samples = [replace(s, hidden=model.model.norm(s.hidden.float()).to(torch.bfloat16)) for s in samples]
    return samples, ingested.metadata()
