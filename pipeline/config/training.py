"""`train` and `drafter`: how and when a step's drafter trains (FastRL's `speculative.train` keys where FastRL has
them), its optimizer, and the drafter's architecture."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.section import Section, no_credentials


class OptimConfig(Section):
    lr: float = Field(default=3e-3, gt=0, description="AdamW peak learning rate.")
    warm_start_lr: float = Field(
        default=6e-3, ge=0,
        description="Peak learning rate of a training that starts from a drafter (train.warm_start_epochs): a short "
                    "run catches up faster at a higher rate; 0 = lr.",
    )
    lr_warmup_steps: int = Field(default=10, ge=0, description="Linear warmup iterations.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, gt=0, description="Max global gradient norm.")


class ScheduleConfig(Section):
    """When a step's drafter trains (pipeline/training/schedule.py); every kind decides on the interval's steps."""

    kind: Literal["interval", "acceptance", "cost"] = Field(
        default="interval",
        description="`interval`: every `train.training_interval_steps` steps; `acceptance`: when the champion's tau "
                    "fell by more than `tau_drop` since its promotion; `cost`: when keeping the champion one more "
                    "chance loses more rollout time than a training costs per chance at its best retraining interval.",
    )
    tau_drop: float = Field(default=0.3, gt=0, description="`acceptance`: the fall in tau that asks for a retraining.")


class TrainConfig(Section):
    enable_drafter_training: bool = Field(default=True, description="Master switch for drafter training.")
    training_interval_steps: int = Field(default=1, ge=1, description="Train every N RL steps.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="When a step's drafter trains.")
    min_samples: int = Field(default=32, ge=1, description="Train only once the buffer holds this many samples.")
    batch_size_per_gpu: int = Field(default=16, ge=1, description="Samples packed into one training sequence.")
    max_seq_len: int = Field(default=4096, ge=2, description="Cap on tokens of one packed training sequence.")
    data_buffer_max_size: int = Field(default=10000, ge=1, description="Most samples the cross-step buffer holds.")
    buffer_steps: int = Field(default=2, ge=1, description="The buffer keeps samples of the last N RL steps.")
    max_unreadable_share: float = Field(
        default=0.1, ge=0, le=1,
        description="The most buffer samples a training may find unreadable (corrupt shards) before it fails.",
    )
    window_tokens: int = Field(default=512, ge=2, description="Most tokens per sample (response end first).")
    vloss_weight: float = Field(default=0.5, ge=0, description="Weight of the SmoothL1 hidden-state loss.")
    ploss_weight: float = Field(default=0.5, ge=0, description="Weight of the soft cross-entropy token loss.")
    epochs: int = Field(default=20, ge=1, description="Most passes over the buffer per training run.")
    warm_start_epochs: int = Field(
        default=4, ge=0,
        description="Most passes over the buffer of a training that starts from a drafter (the champion, or "
                    "drafter.warm_start): it knows the policy of the steps before and catches up on the newest; "
                    "0 = train.epochs. A fresh drafter trains train.epochs.",
    )
    max_tokens: int = Field(
        default=4_000_000, ge=0,
        description="Trained positions per training run (windowed tokens); epochs are an upper bound. "
                    "0 = epochs decide.",
    )
    ttt_steps: int = Field(default=3, ge=1, description="EAGLE-3 training-time-test steps unrolled.")
    ttt_decay: float = Field(default=0.8, gt=0, le=1, description="EAGLE-3 loss weight of TTT step k is decay**k.")
    seed: int = Field(default=0, description="Seed for data order and initialisation.")
    parallelism: Literal["ddp", "fsdp", "auto"] = Field(
        default="auto",
        description="Several ranks: replicate the drafter (ddp), shard it with FSDP2 (fsdp), or shard only when "
                    "its training state exceeds train.fsdp_memory_share of one GPU (auto).",
    )
    fsdp_memory_share: float = Field(
        default=0.5, gt=0, le=1,
        description="`auto`: the share of one GPU's memory the unsharded fp32 training state may take.",
    )
    fsdp_units: Literal["auto", "drafter", "layer"] = Field(
        default="auto",
        description="Sharded (fsdp): gather the whole drafter once a step and reduce-scatter its gradient once "
                    "(drafter: fewest collectives), or one unit per decoder layer, freed after its forward "
                    "(layer: least memory); auto: drafter when a step's peak with one unit (whole weights and "
                    "gradient, plus the rank's shards) is within train.fsdp_memory_share of one GPU.",
    )
    gpu_memory_gb: float = Field(
        default=80.0, gt=0, description="`auto` off CUDA: the GPU memory to decide for (a CUDA rank reads its own)."
    )
    checkpoint_every: int = Field(
        default=50, ge=0, description="Save a resumable checkpoint every N iterations into the store (0: never)."
    )
    checkpoint_background: bool = Field(
        default=True,
        description="Write checkpoints in a background thread while training goes on (one write in flight).",
    )
    log_every: int = Field(
        default=10, ge=1, description="Bring the iterations' metrics to the host and log them every N iterations."
    )
    dtype: Literal["bf16", "fp32"] = Field(
        default="bf16", description="GPU compute: bf16 autocast over fp32 weights, or fp32; a CPU trains in fp32."
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer settings.")

    @model_validator(mode="after")
    def _some_loss(self) -> TrainConfig:
        if self.vloss_weight == 0 and self.ploss_weight == 0:
            raise ValueError("train.vloss_weight and train.ploss_weight are both 0: nothing to train")
        if self.window_tokens > self.max_seq_len:
            raise ValueError(f"train.window_tokens ({self.window_tokens}) exceeds train.max_seq_len "
                             f"({self.max_seq_len}): one sample would not fit a packed sequence")
        return self


class DrafterConfig(Section):
    kind: Literal["eagle", "eagle3", "peagle"] = Field(
        default="eagle3", description="Drafter architecture: EAGLE-1/2, EAGLE-3, or P-EAGLE (parallel drafting)."
    )
    intermediate_size: int | None = Field(
        default=None, ge=1, description="MLP width of the draft layer; the target's when unset."
    )
    aux_layer_ids: list[int] | None = Field(
        default=None, description="EAGLE-3 target layers (vLLM ids); (2, L//2, L-3) when unset."
    )
    draft_vocab_size: int | None = Field(
        default=None, ge=1, description="EAGLE-3 draft vocabulary; min(32000, target vocab) when unset."
    )
    fc_norm: bool = Field(default=False, description="EAGLE-3.1: one RMSNorm per aux chunk before fc.")
    norm_output: bool = Field(default=False, description="EAGLE-3.1: carry the post-norm state between steps.")
    norm_before_residual: bool = Field(default=False, description="EAGLE-3: residual taken after hidden_norm.")
    warm_start: str = Field(
        default="", description="Checkpoint directory to start from while there is no champion (e.g. SpecForge)."
    )
    num_layers: int = Field(
        default=2, ge=1, description="P-EAGLE: draft decoder layers (the first is EAGLE-3's, the others plain Llama)."
    )
    num_depths: int = Field(
        default=8, ge=1, description="P-EAGLE: tokens one forward predicts; eval.num_speculative_tokens at most."
    )
    down_sample_ratio: float = Field(
        default=0.7, gt=0, le=1, description="P-EAGLE COD sampling: depth d keeps a ratio**d share of positions."
    )
    down_sample_ratio_min: float = Field(
        default=0.2, gt=0, le=1, description="P-EAGLE COD sampling: the share a depth keeps at least."
    )
    mask_token_id: int | None = Field(
        default=None, ge=0,
        description="P-EAGLE: the token of the masked depths; unset: the highest target id outside the draft vocab.",
    )

    @field_validator("warm_start")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        return no_credentials(value, "drafter.warm_start")

    @model_validator(mode="after")
    def _aux_layers(self) -> DrafterConfig:
        if self.aux_layer_ids is not None and (len(self.aux_layer_ids) < 1 or min(self.aux_layer_ids) < 0):
            raise ValueError("drafter.aux_layer_ids must list at least one layer id >= 0")
        if self.down_sample_ratio_min > self.down_sample_ratio:
            raise ValueError(f"drafter.down_sample_ratio_min ({self.down_sample_ratio_min}) exceeds "
                             f"drafter.down_sample_ratio ({self.down_sample_ratio})")
        return self
