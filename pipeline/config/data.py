"""`hidden_states`, `capture` and `storage`: where a step's hidden states come from, which rollouts' are stored, and
the object store they are stored in."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pipeline.config.section import Section, no_credentials


class HiddenStatesConfig(Section):
    source: Literal["forward", "vllm", "capture"] = Field(
        default="forward", description="`forward`: run the step's policy here; `vllm`: ingest vLLM connector files; "
        "`capture`: start a vLLM replica of the step's policy (`fleet.vllm`) with extract_hidden_states, have it "
        "write the files, ingest them, stop it."
    )
    vllm_path: str = Field(
        default="", description="Directory of vLLM's connector files; `{step}` becomes the step key (step-000123)."
    )
    vllm_layer_ids: list[int] = Field(
        default_factory=list, description="eagle_aux_hidden_state_layer_ids vLLM was started with, in order."
    )
    tokens_per_batch: int = Field(
        default=8192, ge=1,
        description="`forward`: padded tokens per forward batch (rollouts sorted by length); bounds extraction memory.",
    )
    samples_per_shard: int = Field(
        default=256, ge=1,
        description="`forward`: samples per shard at most (a shard is also cut at 512 MiB); `extract.nproc` ranks "
                    "share a step's shards, so a step of fewer shards than ranks leaves ranks idle.",
    )
    capture_concurrency: int = Field(
        default=8, ge=1, description="`capture`: rollouts in flight to the capture replica, which batches their "
        "prefills.",
    )
    max_unmatched_share: float = Field(
        default=0.0, ge=0, le=1,
        description="vLLM files: the most connector files matching no rollout, and rollouts without a file, "
                    "each as a share of the rollouts, before the step is refused.",
    )

    @field_validator("vllm_path")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        return no_credentials(value, "hidden_states.vllm_path")

    @model_validator(mode="after")
    def _vllm_needs_path(self) -> HiddenStatesConfig:
        if self.source == "vllm" and (not self.vllm_path or not self.vllm_layer_ids):
            raise ValueError("hidden_states.source vllm needs hidden_states.vllm_path and hidden_states.vllm_layer_ids")
        return self


class CaptureConfig(Section):
    """Which rollouts of a step have their hidden states stored (pipeline/data/capture.py)."""

    max_samples: int = Field(
        default=1024, ge=0,
        description="Most training rollouts captured per step, chosen by sample id and stratified by length "
                    "and reward; 0 = all.",
    )
    max_tokens: int = Field(
        default=0, ge=0, description="Most tokens stored per step (each rollout's training window); 0 = no limit.",
    )


class StorageConfig(Section):
    root: str = Field(default="", description="Object store root URI; `<data_dir>/store` when empty.")
    endpoint_url: str = Field(default="", description="S3-compatible endpoint (MinIO, Ceph, ...); AWS when empty.")
    region: str = Field(default="", description="S3 region; the AWS default chain when empty.")
    compression: Literal["auto", "none", "split-zstd", "fp8-e4m3"] = Field(
        default="auto",
        description="Hidden-state shards: `auto` (fp8-e4m3 on object storage, raw bf16 on a local root), raw bf16, "
                    "lossless split-zstd (1.46x smaller), or lossy fp8-e4m3 (2x smaller).",
    )

    checkpoint_prefixes: list[str] = Field(
        default_factory=list,
        description="URI prefixes (besides the store root) a trainer's policy.json may point its checkpoint_uri at.",
    )
    allow_http_checkpoints: bool = Field(
        default=False, description="Let checkpoint_uri be http(s) (still only under checkpoint_prefixes)."
    )
    step_lease_s: float = Field(
        default=1800.0, gt=0,
        description="S3: how long a writer of a step's hidden states holds its lease (renewed before its commit).",
    )
    step_lease_wait_s: float = Field(
        default=120.0, ge=0, description="How long a second writer of a step waits for the first before failing."
    )

    @field_validator("root", "endpoint_url")
    @classmethod
    def _no_credentials(cls, value: str, info: ValidationInfo) -> str:
        return no_credentials(value, f"storage.{info.field_name}")

    @field_validator("checkpoint_prefixes")
    @classmethod
    def _prefixes_without_credentials(cls, value: list[str]) -> list[str]:
        for prefix in value:
            if "://" not in prefix or any(c in prefix for c in "@?#"):
                raise ValueError("storage.checkpoint_prefixes must be full URIs without credentials, query or fragment")
        return value
