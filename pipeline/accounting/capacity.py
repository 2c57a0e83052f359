"""The capacity plan: what the drafter side of one RL step costs, before it runs (`python cli.py plan`).

    policy config.json  ─┐
    the RL step's shape  ├─> CapacityPlan: GPU-seconds of extraction, training, evaluation per step,
    the pipeline config  │   bytes stored per step and over the retention window, and the
    throughput figures  ─┘   served drafter's lag in RL steps

Throughput figures are a `make bench` JSON measured on the GPU in question (`extraction`,
`training.gpu`, `evaluation.gpu`); `capacity_h100.json` beside this file holds those of one
H100 80GB (docs/storage.md, "On an H100"), the shipped default. Each figure is moved from the
model it was measured on to the policy at hand by FLOPs per token (extraction's forward, the
drafter's training step) or by parameters (decoding, which reads every weight per token; loading the
step's policy, extraction's first work, where the JSON has `extraction.policy_load_gb_per_s`).

Rollout lengths are lognormal, fitted to the mean and the p99 given; a sample stores its
training window (pipeline/data/capture.py), at most `train.window_tokens` of its tokens, and
the forward pass runs over the whole rollout (the window ends at the response's end).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING

from pipeline.models.layers import stored_layer_ids

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

SCHEMA_VERSION = 1
DEFAULT_THROUGHPUT = Path(__file__).resolve().parent / "capacity_h100.json"
SPLIT_ZSTD_RATIO = 1.46  # docs/storage.md, Compression
EVALUATED_DRAFTERS = 3  # co-trained, served, baseline
_QUANTILES = 2000  # points of the length distribution the expectations are taken over


class CapacityError(ValueError):
    """An input the plan cannot use; the message names the file and the field."""


def _field(doc: dict, key: str, where: str, kind: type = float):
    value = doc.get(key)
    if kind is int and isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise CapacityError(f"{where}: field {key} is missing or not a positive number")
    return kind(value)


@dataclass(frozen=True)
class PolicyShape:
    """A decoder-only transformer's sizes, as a transformers config.json states them."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    explicit_head_dim: int = 0  # config.json's head_dim where it is not hidden_size / heads (Qwen3, Gemma)
    bytes_per_param: int = 2  # the checkpoint's: config.json's torch_dtype (bf16 unless it says float32)

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> PolicyShape:
        config = config.get("text_config", config)  # multimodal configs nest the language model's
        heads = _field(config, "num_attention_heads", where, int)
        return cls(
            hidden_size=_field(config, "hidden_size", where, int),
            num_layers=_field(config, "num_hidden_layers", where, int),
            intermediate_size=_field(config, "intermediate_size", where, int),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            vocab_size=_field(config, "vocab_size", where, int),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            explicit_head_dim=int(config.get("head_dim") or 0),
            bytes_per_param=4 if str(config.get("torch_dtype", config.get("dtype", ""))) == "float32" else 2,
        )

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size  # q, k, v, o; gate, up, down

    @property
    def params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    def forward_flops_per_token(self, context: float) -> float:
        """The backbone's forward (no lm_head: extraction catches layer states), attention over `context`
        earlier tokens on average."""
        attention = 2 * 2 * self.num_layers * context * self.num_heads * self.head_dim  # QK^T and PV
        return 2 * self.num_layers * self.layer_params + attention


@dataclass(frozen=True)
class DrafterShape:
    """The EAGLE-3 drafter of a target, and the windows it trains on."""

    hidden: int
    heads: int
    kv_heads: int
    mlp: int
    draft_vocab: int
    window: int

    @classmethod
    def of(cls, policy: PolicyShape, window: int, draft_vocab: int | None = None) -> DrafterShape:
        return cls(policy.hidden_size, policy.num_heads, policy.num_kv_heads, policy.intermediate_size,
                   draft_vocab or min(32000, policy.vocab_size), window)

    def train_flops_per_token(self, ttt_steps: int = 3) -> float:
        """Training FLOPs per token (benchmarks/training.py's count): each TTT step's forward and
        backward through the projections, MLP, head and attention, the teacher's logits, the fc."""
        h, d = self.hidden, self.hidden // self.heads
        proj = 2 * (2 * h) * (self.heads + 2 * self.kv_heads) * d + 2 * self.heads * d * h
        mlp = 2 * 3 * h * self.mlp
        head = 2 * h * self.draft_vocab
        attention = 2 * 2 * (self.window / 2) * h
        teacher = 2 * h * self.draft_vocab
        return ttt_steps * (3 * (proj + mlp + head + attention) + teacher) + 3 * 2 * 3 * h * h


@dataclass(frozen=True)
class Throughput:
    """What `make bench` measured on one GPU, and on which models."""

    gpu: str
    forward_tokens_per_s: float  # extraction's plain forward
    forward_model: PolicyShape
    forward_context: float  # mean attention context of the benchmark's rollouts
    write_gb_per_s: float  # the store's write rate as extraction sees it
    train_tokens_per_s: float
    train_model: DrafterShape
    decode_tokens_per_s: float  # batched speculative decoding
    decode_params: int
    load_gb_per_s: float | None = None  # a policy checkpoint loaded for the forward, where measured

    @classmethod
    def from_bench(cls, doc: dict, where: str) -> Throughput:
        try:
            extraction, gpu_train, gpu_eval = doc["extraction"], doc["training"]["gpu"], doc["evaluation"]["gpu"]
            target = extraction["target"]
        except (KeyError, TypeError):
            raise CapacityError(f"{where}: needs extraction (with target), training.gpu and evaluation.gpu, as "
                                "`make bench` on a GPU writes them") from None
        if not (isinstance(gpu_train, dict) and isinstance(gpu_eval, dict)):
            raise CapacityError(f"{where}: training.gpu and evaluation.gpu are empty: measured without a GPU")
        forward_model = PolicyShape(
            hidden_size=_field(target, "hidden_size", f"{where} extraction.target", int),
            num_layers=_field(target, "num_layers", f"{where} extraction.target", int),
            intermediate_size=_field(target, "intermediate_size", f"{where} extraction.target", int),
            num_heads=_field(target, "num_heads", f"{where} extraction.target", int),
            num_kv_heads=_field(target, "num_kv_heads", f"{where} extraction.target", int),
            vocab_size=_field(target, "vocab_size", f"{where} extraction.target", int))
        lengths = (_field(target, "min_len", f"{where} extraction.target"),
                   _field(target, "max_len", f"{where} extraction.target"))
        shapes = gpu_train.get("shapes", {})
        tokens, docs = int(shapes.get("tokens", 8192)), int(shapes.get("docs", 16))
        return cls(
            gpu=str(gpu_train.get("gpu") or gpu_eval.get("device") or "unknown GPU"),
            forward_tokens_per_s=_field(extraction, "plain_forward_tokens_per_s", f"{where} extraction"),
            forward_model=forward_model,
            forward_context=_uniform_context(*lengths),
            write_gb_per_s=_field(extraction, "storage_write_gb_per_s", f"{where} extraction"),
            train_tokens_per_s=_field(gpu_train, "tokens_per_s", f"{where} training.gpu"),
            train_model=DrafterShape(int(shapes.get("hidden", 4096)), int(shapes.get("heads", 32)),
                                     int(shapes.get("kv_heads", 8)), int(shapes.get("mlp", 14336)),
                                     int(shapes.get("draft_vocab", 32000)), tokens // docs),
            decode_tokens_per_s=_field(gpu_eval, "speculative_tokens_per_s", f"{where} evaluation.gpu"),
            decode_params=_field(gpu_eval, "target_params", f"{where} evaluation.gpu", int),
            load_gb_per_s=(_field(extraction, "policy_load_gb_per_s", f"{where} extraction")
                           if "policy_load_gb_per_s" in extraction else None),
        )

    @classmethod
    def load(cls, path: Path | None = None) -> Throughput:
        path = path or DEFAULT_THROUGHPUT
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CapacityError(f"{path}: not a readable JSON file ({exc.__class__.__name__})") from None
        return cls.from_bench(doc, str(path))


def _uniform_context(low: float, high: float) -> float:
    """Mean attention context per token of lengths uniform in [low, high]: E[L^2] / (2 E[L])."""
    return (high**3 - low**3) / (3 * (high - low) or 1) / (low + high) if high > low else low / 2


@dataclass(frozen=True)
class StepShape:
    """One RL step as the platform sees it."""

    rollouts: int
    mean_tokens: float
    p99_tokens: float
    gpus: int
    gpu_type: str
    rl_step_s: float

    def lengths(self) -> list[float]:
        """Rollout lengths at evenly spaced quantiles of the lognormal with this mean and p99."""
        z99 = NormalDist().inv_cdf(0.99)
        ratio = math.log(max(self.p99_tokens, self.mean_tokens) / self.mean_tokens)
        # ln p99 = mu + z99 sigma and ln mean = mu + sigma^2 / 2: the smaller root for sigma
        sigma = z99 - math.sqrt(max(0.0, z99 * z99 - 2 * ratio))
        mu = math.log(self.mean_tokens) - sigma * sigma / 2
        normal = NormalDist()
        return [math.exp(mu + sigma * normal.inv_cdf((i + 0.5) / _QUANTILES)) for i in range(_QUANTILES)]


@dataclass(frozen=True)
class CapacityPlan:
    """The figures of one plan: per RL step unless named otherwise."""

    gpu: str
    gpus: int
    rl_step_s: float
    policy_params: int
    rollouts_captured: float
    tokens_forwarded: float
    tokens_stored: float
    bytes_stored: float
    bytes_retained: float
    retained_steps: int
    stored_vs_read: float  # bytes stored over the bytes of the windows training reads
    tokens_trained: float
    extraction_gpu_s: float
    training_gpu_s: float
    evaluation_gpu_s: float
    latency_s: float  # from the step's rollouts to the drafter trained on them being measured
    lag_steps: int
    schema_version: int = SCHEMA_VERSION

    @property
    def drafter_gpu_s(self) -> float:
        return self.extraction_gpu_s + self.training_gpu_s + self.evaluation_gpu_s

    @property
    def drafter_share(self) -> float:
        """Drafter GPU-seconds over the RL step's own (its GPUs for its period)."""
        return self.drafter_gpu_s / (self.gpus * self.rl_step_s)

    def to_json(self) -> dict:
        return {**asdict(self), "drafter_gpu_s": self.drafter_gpu_s, "drafter_share": self.drafter_share}

    @classmethod
    def from_json(cls, doc: dict) -> CapacityPlan:
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise CapacityError(f"capacity plan schema_version {doc.get('schema_version')!r}, "
                                f"expected {SCHEMA_VERSION}")
        return cls(**{k: v for k, v in doc.items() if k not in ("drafter_gpu_s", "drafter_share")})

    def rows(self) -> list[tuple[str, str]]:
        gb = 1e9
        return [
            ("GPU", f"{self.gpus} x {self.gpu}"),
            ("policy parameters", f"{self.policy_params / 1e9:.1f}B"),
            ("rollouts captured per step", f"{self.rollouts_captured:,.0f}"),
            ("tokens forwarded per step", f"{self.tokens_forwarded / 1e6:,.2f}M"),
            ("tokens stored per step", f"{self.tokens_stored / 1e6:,.2f}M"),
            ("bytes stored per step", f"{self.bytes_stored / gb:,.1f} GB"),
            (f"bytes retained ({self.retained_steps} steps)", f"{self.bytes_retained / gb:,.1f} GB"),
            ("stored / read by training", f"{self.stored_vs_read:.2f}x"),
            ("tokens trained per step", f"{self.tokens_trained / 1e6:,.2f}M"),
            ("extraction GPU-s per step", f"{self.extraction_gpu_s:,.0f}"),
            ("training GPU-s per step", f"{self.training_gpu_s:,.0f}"),
            ("evaluation GPU-s per step", f"{self.evaluation_gpu_s:,.0f}"),
            ("drafter GPU-s per step", f"{self.drafter_gpu_s:,.0f} ({100 * self.drafter_share:.1f}% of the RL step's "
                                       f"{self.gpus * self.rl_step_s:,.0f})"),
            ("drafter latency", f"{self.latency_s:,.0f} s"),
            (f"served drafter's lag (RL step {self.rl_step_s:,.0f} s)", f"{self.lag_steps} RL step(s)"),
        ]

    def table(self) -> str:
        """A Markdown table, to paste into a design review."""
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'figure':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        return "\n".join(lines + [f"| {k:<{width}} | {v} |" for k, v in rows])


def _bytes_per_value(compression: str, hidden_size: int) -> float:
    if compression == "fp8-e4m3":
        return 1 + 4 / hidden_size  # one byte a value, a float32 scale a token
    return 2 / SPLIT_ZSTD_RATIO if compression == "split-zstd" else 2


def plan_capacity(policy: PolicyShape, step: StepShape, throughput: Throughput, cfg: PipelineConfig,
                  retained_steps: int | None = None, whole_rollouts: bool = False) -> CapacityPlan:
    """The drafter side of one RL step of `step`'s shape under `cfg` (its capture, train, storage and
    eval settings), on GPUs that run at `throughput`. `whole_rollouts`: as if every token of a
    captured rollout were stored, not only its window (how steps were stored before capture plans)."""
    window = cfg.train.window_tokens
    lengths = step.lengths()
    mean_len = sum(lengths) / len(lengths)
    window_per_sample = sum(min(n, window) for n in lengths) / len(lengths)
    stored_per_sample = mean_len if whole_rollouts else window_per_sample
    eligible = step.rollouts * (1 - cfg.eval.held_out_fraction)
    captured = eligible
    if cfg.capture.max_samples:
        captured = min(captured, cfg.capture.max_samples)
    if cfg.capture.max_tokens:
        captured = min(captured, cfg.capture.max_tokens / window_per_sample)
    tokens_forwarded = captured * mean_len
    tokens_stored = captured * stored_per_sample
    layers = len(stored_layer_ids(cfg.drafter, policy.num_layers) or [policy.num_layers])  # EAGLE-1/2: L alone
    bytes_per_token = layers * policy.hidden_size * _bytes_per_value(cfg.shard_compression, policy.hidden_size) + 5
    bytes_stored = tokens_stored * bytes_per_token

    # Training: the buffer's windows, epochs over them at most (a warm-started training's: the loop's steady
    # state), the token budget first.
    buffer_samples = min(cfg.train.buffer_steps * captured, cfg.train.data_buffer_max_size)
    buffer_positions = buffer_samples * max(0.0, window_per_sample - 1)
    epochs = min(cfg.train.epochs, cfg.train.warm_start_epochs or cfg.train.epochs)
    trained = epochs * buffer_positions
    if cfg.train.max_tokens:
        trained = min(trained, cfg.train.max_tokens)
    trained_per_step = trained / cfg.train.training_interval_steps
    read_share = min(1.0, trained / buffer_positions) if buffer_positions else 1.0
    stored_vs_read = stored_per_sample / window_per_sample / read_share

    # Each figure moved from the model it was measured on to this policy's.
    context = sum(n * n for n in lengths) / (2 * sum(lengths))
    forward_rate = throughput.forward_tokens_per_s * (
        throughput.forward_model.forward_flops_per_token(throughput.forward_context)
        / policy.forward_flops_per_token(context))
    write_s = bytes_stored / (throughput.write_gb_per_s * 1e9)
    # every extraction rank loads the step's policy before its forward
    load_s = policy.params * policy.bytes_per_param / (throughput.load_gb_per_s * 1e9) if throughput.load_gb_per_s \
        else 0.0
    extraction_gpu_s = step.gpus * load_s + max(tokens_forwarded / forward_rate, write_s)
    drafter = DrafterShape.of(policy, window, cfg.drafter.draft_vocab_size)
    train_rate = throughput.train_tokens_per_s * (throughput.train_model.train_flops_per_token(cfg.train.ttt_steps)
                                                  / drafter.train_flops_per_token(cfg.train.ttt_steps))
    training_gpu_s = trained_per_step / train_rate
    decode_rate = throughput.decode_tokens_per_s * throughput.decode_params / policy.params
    # each drafter decodes the prompts at the rollouts' sampling and, where that is not greedy, greedily beside it
    passes = 1 if cfg.eval.sampling.params().greedy else 2
    evaluation_gpu_s = EVALUATED_DRAFTERS * passes * cfg.eval.num_prompts * cfg.eval.max_new_tokens / decode_rate

    # Wall time: extraction over every GPU, training over its ranks, evaluation on one GPU.
    latency = (extraction_gpu_s / step.gpus + training_gpu_s / min(step.gpus, cfg.launch.training.nproc)
               + evaluation_gpu_s)
    retained = retained_steps or cfg.train.buffer_steps
    return CapacityPlan(
        gpu=throughput.gpu, gpus=step.gpus, rl_step_s=step.rl_step_s, policy_params=policy.params,
        rollouts_captured=captured, tokens_forwarded=tokens_forwarded, tokens_stored=tokens_stored,
        bytes_stored=bytes_stored, bytes_retained=bytes_stored * retained, retained_steps=retained,
        stored_vs_read=stored_vs_read, tokens_trained=trained_per_step, extraction_gpu_s=extraction_gpu_s,
        training_gpu_s=training_gpu_s, evaluation_gpu_s=evaluation_gpu_s, latency_s=latency,
        lag_steps=max(1, math.ceil(latency / step.rl_step_s)),
    )
