"""Drafter checkpoints as vLLM and SGLang load them, with no conversion step.

EAGLE-1/2 (`drafter.kind: eagle`):
    <dir>/
    ├── config.json         LlamaConfig + "architectures": ["EagleLlamaForCausalLM"]; with the target
    │                       given, its vocab_size, rope_theta, rope_scaling, max_position_embeddings
    └── model.safetensors   fc.weight, layers.0.* (no embed_tokens / lm_head: vLLM
                            shares the target's, which is what we train against)
    vllm serve TARGET --speculative-config '{"method": "eagle", "model": "<dir>", "num_speculative_tokens": 4}'

EAGLE-3 (`drafter.kind: eagle3`):
    <dir>/
    ├── config.json         "architectures": ["LlamaForCausalLMEagle3"], Llama fields, draft_vocab_size,
    │                       target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids,
    │                       norm_before_residual (always written: engines differ on its default),
    │                       fc_norm / norm_output (EAGLE-3.1; written only when true: SpecForge 0.2
    │                       reads `norm_output: false` as "no final norm", vLLM always applies it);
    │                       with the target given, its rope_theta, rope_scaling, max_position_embeddings
    └── model.safetensors   midlayer.*, fc.weight, norm.weight, lm_head.weight, d2t, t2d
                            [, fc_norm.N.weight (EAGLE-3.1)] [, embed_tokens.weight if not the target's]
                            (no d2t, t2d for a draft vocabulary that is the target's whole: vLLM allocates
                            d2t only for a smaller one; lm_head's rows are then in target-id order)
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "<dir>", "num_speculative_tokens": 4}'

P-EAGLE (`drafter.kind: peagle`): EAGLE-3's layout with every layer and two additions
    <dir>/
    ├── config.json         EAGLE-3's, with num_hidden_layers, parallel_drafting: true, the masked token
    │                       as mask_token_id, pard_token and ptd_token_id (the names vLLM reads), num_depths,
    │                       down_sample_ratio, down_sample_ratio_min
    └── model.safetensors   layers.0.* (EAGLE-3's first layer), layers.1.* ... (Llama blocks), fc.weight,
                            norm.weight, lm_head.weight, d2t, t2d, embed_tokens.weight (trained), mask_hidden
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "<dir>", "num_speculative_tokens": 4,
                                             "parallel_drafting": true}'
    A checkpoint is P-EAGLE by its `mask_hidden` key: without it, the same files load as EAGLE-3.

P-EAGLE in speculators' format (`save_speculators`), as speculators' `PEagleDraftModel.from_pretrained`
and vLLM (which converts speculators configs) load it:
    <dir>/
    ├── config.json         speculators_model_type: "peagle", transformer_layer_config (the draft layers'
    │                       LlamaConfig, head_dim written), draft_vocab_size, target_hidden_size,
    │                       eagle_aux_hidden_state_layer_ids, mask_token_id, norm flags,
    │                       speculators_config (algorithm peagle, greedy proposals of num_depths tokens,
│                       the verifier)
    └── model.safetensors   the same tensors as above (speculators names them alike)

Import also takes the published variants (`layers.0.` for `midlayer.`, a `model.` prefix)
and refuses anything that is not safetensors.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pipeline.models.drafter import Drafter
from pipeline.models.eagle import ARCHITECTURE, EagleConfig, EagleDrafter, llama_fields
from pipeline.models.eagle3 import ARCHITECTURE as EAGLE3_ARCHITECTURE
from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter, default_aux_layer_ids
from pipeline.models.peagle import PEagleConfig, PEagleDrafter
from pipeline.models.rope import UnsupportedRopeError, check_scaling, rope_from
from pipeline.models.target_forward import TargetMetadata
from pipeline.models.weights import WeightsLayoutError, read_header

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A drafter checkpoint that does not match its config or is not safetensors."""


def target_fields(model: Drafter, target: TargetMetadata) -> dict:
    """What the engines read of the target through the drafter's config: its vocabulary, and its
    position encoding (rope_theta, rope_scaling as the target has them; the draft layer attends
    over the target's positions) up to its max_position_embeddings (vLLM caps the served context
    at the draft model's). A drafter shaped after another target (vocabulary, width, position
    encoding) is refused."""
    config = model.config
    mismatched = [(name, ours, theirs) for name, ours, theirs in (
        ("vocab_size", config.vocab_size, target.vocab_size),
        ("target hidden_size", model.target_hidden_size, target.hidden_size),
        ("rope_theta", config.rope_theta, target.rope_theta),
        ("rope_scaling", config.rope_scaling, target.rope_scaling),
    ) if ours != theirs]
    if mismatched:
        raise CheckpointError("drafter does not fit the target it is exported for: " + ", ".join(
            f"{name} {ours} != target's {theirs}" for name, ours, theirs in mismatched))
    return {
        "vocab_size": target.vocab_size,
        "rope_theta": target.rope_theta,
        "rope_scaling": target.rope_scaling,
        "max_position_embeddings": max(config.max_position_embeddings, target.max_position_embeddings),
    }


def save_drafter(model: Drafter, directory: Path, target: TargetMetadata | None = None) -> Path:
    """Write the checkpoint; with `target`, its config carries what the engines need of that target."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.checkpoint_tensors().items()}
    config = model.checkpoint_config()
    if target is not None:
        config.update(target_fields(model, target))
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    share_as_umask_allows(directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return directory


_UMASK_LOCK = threading.Lock()


def process_umask() -> int:
    """The process's umask, read without changing it where the kernel says it (Linux 4.7+)."""
    try:
        found = re.search(r"^Umask:\s*([0-7]+)$", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        found = None
    if found:
        return int(found.group(1), 8)
    with _UMASK_LOCK:  # set and restored at once: the only portable way to read it
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def share_as_umask_allows(path: Path) -> None:
    """Give a file the mode a plain `open()` would have (0666 less the umask). safetensors' writer creates its
    file 0600 whatever the umask, and a vLLM server running as another user must read the weights as it
    reads config.json."""
    path.chmod(0o666 & ~process_umask())


def save_speculators(
    model: PEagleDrafter, directory: Path, target: TargetMetadata, verifier: str | None = None
) -> Path:
    """Write a P-EAGLE drafter in speculators' format, proposing up to its depths; `verifier`: the target's
    name or path, if it has one."""
    if not isinstance(model, PEagleDrafter):
        raise TypeError(f"speculators' peagle format holds P-EAGLE drafters, not {model.kind}")
    c = model.config
    fields = target_fields(model, target)
    theta, scaling = fields["rope_theta"], fields["rope_scaling"]
    rope = {"rope_theta": theta, "rope_type": "default"} if scaling is None else \
        {**scaling, "rope_theta": theta, "rope_type": scaling.get("rope_type", scaling.get("type"))}
    layer = {
        **llama_fields(c), "num_hidden_layers": c.num_hidden_layers, "vocab_size": fields["vocab_size"],
        "max_position_embeddings": fields["max_position_embeddings"], "rope_parameters": rope,
        "attention_bias": False, "mlp_bias": False,
    }
    for key in ("rope_theta", "rope_scaling", "torch_dtype"):
        layer.pop(key)
    config = {
        "architectures": ["PEagleDraftModel"],
        "speculators_model_type": "peagle",
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "mask_token_id": c.mask_token_id,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": c.fc_norm,
        "norm_output": False,
        "embed_requires_grad": True,
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "peagle",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.num_depths}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [_ARCHITECTURES.get(target.model_type, "")]},
        },
    }
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.checkpoint_tensors().items()}
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    share_as_umask_allows(directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return directory


def _from_speculators(raw: dict) -> dict:
    """A speculators `peagle` config.json as the fields of our (vLLM's) P-EAGLE config.json."""
    layer = raw.get("transformer_layer_config") or {}
    proposals = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return {
        **layer,
        "architectures": [EAGLE3_ARCHITECTURE],
        "draft_vocab_size": raw.get("draft_vocab_size"),
        "target_hidden_size": raw.get("target_hidden_size"),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": raw.get("eagle_aux_hidden_state_layer_ids")},
        **{key: raw[key] for key in ("norm_before_residual", "fc_norm", "mask_token_id") if key in raw},
        "num_depths": max(p.get("speculative_tokens", 1) for p in proposals),
    }


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


_META_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


def _read(directory: Path, header_only: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the tensors of model.safetensors; with `header_only`, tensors on the meta device
    of the shapes and dtypes the file's header gives (nothing else of the file is read)."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not weights_path.exists():
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        hint = f" (found {', '.join(pickles)}: pickled weights are refused)" if pickles else ""
        raise CheckpointError(f"{directory}: a drafter checkpoint needs {WEIGHTS_FILE}{hint}")
    if not config_path.exists():
        raise CheckpointError(f"{directory}: a drafter checkpoint needs {CONFIG_FILE}")
    try:
        if header_only:
            with weights_path.open("rb") as f:
                entries = read_header(f, weights_path.stat().st_size, str(weights_path))
            tensors = {name: torch.empty(e.shape, dtype=_META_DTYPES.get(e.dtype, torch.float32), device="meta")
                       for name, e in entries.items()}
        else:
            tensors = load_file(weights_path)
    except (SafetensorError, OSError, WeightsLayoutError) as exc:
        raise CheckpointError(f"{weights_path}: not a readable safetensors file ({exc})") from None
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    return raw, tensors


def check_drafter(directory: Path, target_num_layers: int | None = None) -> None:
    """Refuse a checkpoint `load_drafter` would refuse, from config.json and the safetensors header alone:
    the drafter its config implies is built on the meta device (no memory: a drafter of a 405B target is
    about 19 GB in fp32) and checked against the header's tensor names and shapes; no tensor is read."""
    raw, tensors = _read(directory, header_only=True)
    with torch.device("meta"):
        _build(directory, raw, tensors, target_num_layers)


def load_drafter(directory: Path, target_num_layers: int | None = None) -> Drafter:
    """Load and check a checkpoint of either kind; the caller then attaches the target.

    `target_num_layers` supplies vLLM's default aux layers for EAGLE-3 checkpoints that do
    not name theirs (the EAGLE authors' releases)."""
    raw, tensors = _read(directory)
    return _build(directory, raw, tensors, target_num_layers)


def _build(directory: Path, raw: dict, tensors: dict[str, torch.Tensor], target_num_layers: int | None) -> Drafter:
    """The drafter of a checkpoint's config with its tensors, each checked against what the config implies."""
    if raw.get("speculators_model_type") == "peagle":
        raw = _from_speculators(raw)
    architectures = raw.get("architectures")
    if architectures == [EAGLE3_ARCHITECTURE] and any(k.endswith("mask_hidden") for k in tensors):
        return _load_peagle(directory, raw, tensors, target_num_layers)
    if architectures == [EAGLE3_ARCHITECTURE]:
        return _load_eagle3(directory, raw, tensors, target_num_layers)
    if architectures != [ARCHITECTURE]:
        raise CheckpointError(
            f"{directory / CONFIG_FILE}: architectures {architectures}, expected "
            f"[{ARCHITECTURE!r}] or [{EAGLE3_ARCHITECTURE!r}]"
        )
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    rope_theta, rope_scaling = _rope(raw, config_path)
    try:
        config = EagleConfig(**{k: raw[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "max_position_embeddings")}, rope_theta=rope_theta, rope_scaling=rope_scaling)
    except KeyError as exc:
        raise CheckpointError(f"{config_path}: missing key {exc}") from None
    model = EagleDrafter(config)
    expected = model.trainable_state_dict()
    _check_tensors(weights_path, expected, tensors, extra={"embed_tokens.weight", "lm_head.weight"})
    model.load_state_dict({k: tensors[k].to(torch.float32) for k in expected}, strict=False)
    return model


def _check_tensors(
    weights_path: Path, expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
    optional: set[str] = frozenset(), extra: set[str] = frozenset(),
) -> None:
    """The checkpoint's tensors against what its config implies, for every kind: each expected key
    present (but `optional` ones) at its shape, and no key beyond them but the `extra` ones."""
    missing = sorted(set(expected) - set(tensors) - optional)
    unexpected = sorted(set(tensors) - set(expected) - extra)
    if missing or unexpected:
        raise CheckpointError(f"{weights_path}: missing keys {missing}, unexpected keys {unexpected}")
    for key, tensor in expected.items():
        if key in tensors and tensors[key].shape != tensor.shape:
            raise CheckpointError(
                f"{weights_path}: {key} has shape {tuple(tensors[key].shape)}, config implies {tuple(tensor.shape)}"
            )


def _rope(raw: dict, config_path: Path) -> tuple[float, dict | None]:
    """The checkpoint's (rope_theta, rope_scaling), of a scaling the draft layer can follow."""
    theta, scaling = rope_from(raw)
    try:
        check_scaling(scaling)
    except UnsupportedRopeError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None
    return theta, scaling


def _canonical_eagle3_key(key: str) -> str:
    """Published variants -> our names: a `model.` prefix, `layers.0.` for `midlayer.`."""
    key = key.removeprefix("model.")
    return "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key


def _eagle3_config(raw: dict, config_path: Path, target_num_layers: int | None) -> Eagle3Config:
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or raw.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        if target_num_layers is None:
            raise CheckpointError(f"{config_path}: no eagle_aux_hidden_state_layer_ids and no target to default from")
        aux = default_aux_layer_ids(target_num_layers)
    rope_theta, rope_scaling = _rope(raw, config_path)
    try:
        heads = raw["num_attention_heads"]
        return Eagle3Config(
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            aux_layer_ids=tuple(aux),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            # Absent means the EAGLE authors' / SpecForge layer (residual before hidden_norm).
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            fc_norm=bool(raw.get("fc_norm", False)),
            norm_output=bool(raw.get("norm_output", False)),
        )
    except KeyError as exc:
        raise CheckpointError(f"{config_path}: missing key {exc}") from None
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None


def _load_peagle(
    directory: Path, raw: dict, tensors: dict[str, torch.Tensor], target_num_layers: int | None
) -> PEagleDrafter:
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    base = _eagle3_config(raw, config_path, target_num_layers)
    try:
        config = PEagleConfig(
            **{f: getattr(base, f) for f in Eagle3Config.__dataclass_fields__},
            num_hidden_layers=raw.get("num_hidden_layers", 1),
            mask_token_id=raw.get("mask_token_id", raw.get("pard_token", raw.get("ptd_token_id"))),
            num_depths=raw.get("num_depths", 8),
            down_sample_ratio=raw.get("down_sample_ratio", 0.7),
            down_sample_ratio_min=raw.get("down_sample_ratio_min", 0.2),
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None
    model = PEagleDrafter(config)
    tensors = {_canonical_peagle_key(k): v for k, v in tensors.items()}
    expected = model.trainable_state_dict()
    optional = {"d2t", "t2d"} if config.draft_vocab_size == config.vocab_size else set()
    _check_tensors(weights_path, expected, tensors, optional=optional | {"embed_tokens.weight"})
    model.load_state_dict({k: tensors[k].to(v.dtype) for k, v in expected.items() if k in tensors}, strict=False)
    # Embeddings the checkpoint lacks are the target's, as an EAGLE-3 drafter's; given ones are kept.
    model.own_embeddings = "embed_tokens.weight" in tensors
    return model


def _canonical_peagle_key(key: str) -> str:
    """Published variants -> our names: a `model.` prefix, `midlayer.` for `layers.0.`."""
    key = key.removeprefix("model.")
    return "layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key


def _load_eagle3(
    directory: Path, raw: dict, tensors: dict[str, torch.Tensor], target_num_layers: int | None
) -> Eagle3Drafter:
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    config = _eagle3_config(raw, config_path, target_num_layers)
    tensors = {_canonical_eagle3_key(k): v for k, v in tensors.items()}
    model = Eagle3Drafter(config)
    expected = model.trainable_state_dict()
    optional = {"d2t", "t2d"} if config.draft_vocab_size == config.vocab_size else set()
    _check_tensors(weights_path, expected, tensors, optional=optional, extra={"embed_tokens.weight"})
    state = {k: tensors[k].to(v.dtype) for k, v in expected.items() if k in tensors}
    if "embed_tokens.weight" in tensors:
        embed = tensors["embed_tokens.weight"]
        if embed.shape != model.embed_tokens.weight.shape:
            raise CheckpointError(f"{weights_path}: embed_tokens.weight has shape {tuple(embed.shape)}")
        state["embed_tokens.weight"] = embed.to(torch.float32)
        model.own_embeddings = True
    model.load_state_dict(state, strict=False)
    return model
