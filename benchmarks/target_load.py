"""Policy loading: a 91M-parameter Llama-shaped target (hidden 768, 6 layers, vocab 32000, float32)
saved in 100 MB shards, loaded on the CPU.

Baseline, measured in the same run: what a loader that copies the checkpoint into a temporary
directory and calls transformers' `from_pretrained` does (`reference_copy_then_from_pretrained`).
transformers leaves float32 CPU weights memory-mapped, read on first use; ours reads them at
load (a file truncated later cannot crash a forward with SIGBUS), so `load_and_first_forward`
compares the two with that first read included.
Ours reads the files in place after checking every header against the config's meta-device
state dict (`check_s` is that check alone), and a second `load_policy` of the same checkpoint
in the process is a cache hit. Best of `Sizes.repeats`, alternating, so that other load on the
machine hits both alike. `TINY`, the smoke run's: a policy of a few MB in 4 shards, once.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sizes:
    vocab: int
    hidden: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    max_shard_size: str
    repeats: int


FULL = Sizes(vocab=32000, hidden=768, mlp=2048, layers=6, heads=12, kv_heads=4, max_shard_size="100MB", repeats=3)
TINY = Sizes(vocab=2048, hidden=128, mlp=256, layers=2, heads=4, kv_heads=2, max_shard_size="1MB", repeats=1)


def _reference(directory: Path):
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        for p in directory.iterdir():
            shutil.copy(p, Path(tmp) / p.name)
        return AutoModelForCausalLM.from_pretrained(tmp, dtype="float32", local_files_only=True).eval()


def _first_forward(model) -> None:
    import torch

    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long))


def run(tiny: bool = False) -> dict:
    from transformers import LlamaConfig

    from pipeline.data.store import ObjectStore
    from pipeline.models import target as target_lib
    from pipeline.models import target_checks

    sizes = TINY if tiny else FULL
    config = LlamaConfig(vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=sizes.mlp,
                         num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads,
                         num_key_value_heads=sizes.kv_heads, tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as tmp:
        store = ObjectStore(Path(tmp).as_uri())
        model = target_lib.build_target(config, seed=0)
        params = sum(p.numel() for p in model.parameters())
        with tempfile.TemporaryDirectory() as staging:
            model.save_pretrained(staging, safe_serialization=True, max_shard_size=sizes.max_shard_size)
            for p in Path(staging).iterdir():
                store.write_bytes(f"policy/{p.name}", p.read_bytes())
        del model
        directory = Path(tmp) / "policy"
        shards = len(list(directory.glob("*.safetensors")))
        settings = target_lib.LoadSettings(dtype="float32", cached_policies=0)
        ours, reference, check, ours_first, reference_first = [], [], [], [], []
        for _ in range(sizes.repeats):
            start = time.perf_counter()
            model = _reference(directory)
            reference.append(time.perf_counter() - start)
            _first_forward(model)
            reference_first.append(time.perf_counter() - start)
            del model
            start = time.perf_counter()
            model = target_lib.load_checkpoint(directory.as_uri(), settings=settings)
            ours.append(time.perf_counter() - start)
            _first_forward(model)
            ours_first.append(time.perf_counter() - start)
            del model
            start = time.perf_counter()
            where = directory.as_uri()
            layout = target_checks.read_layout(directory, where)
            target_checks.check_layout(target_checks.check_config((directory / "config.json").read_bytes(), where),
                                    layout, where)
            check.append(time.perf_counter() - start)
        cached = target_lib.LoadSettings(dtype="float32", cached_policies=1)
        target_lib.load_policy(store, "policy", settings=cached)
        start = time.perf_counter()
        target_lib.load_policy(store, "policy", settings=cached)
        hit = time.perf_counter() - start
        target_lib.POLICIES.clear()
    return {
        "parameters": params,
        "shards": shards,
        "load_s": min(ours),
        "reference_copy_then_from_pretrained_s": min(reference),
        "check_s": min(check),
        "cache_hit_ms": hit * 1000,
        "load_time_ratio": min(ours) / min(reference),
        "load_and_first_forward_s": min(ours_first),
        "reference_load_and_first_forward_s": min(reference_first),
        "load_and_first_forward_ratio": min(ours_first) / min(reference_first),
    }
