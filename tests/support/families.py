"""Tiny random policies of every supported family, built from their transformers configs.

Two layers each, every parameter random (biases and norm weights too: transformers initialises
them to 0 and 1, which would hide a bias or norm the loader dropped): Llama with llama3 RoPE
scaling, Mistral with a sliding window shorter than the sequences, Qwen2 with q/k/v biases,
Qwen3 with q/k norms and tied embeddings; and a Qwen2 variant mixing full and sliding-window layers.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

V, H, LAYERS = 96, 32, 2
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=4, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=8, tie_word_embeddings=True),
}
# Qwen2 with sliding-window attention on its second layer only: one mask per layer type.
VARIANTS = {**FAMILIES, "qwen2-sliding": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False,
                                                             use_sliding_window=True, sliding_window=4,
                                                             max_window_layers=1)}
SHARD = "24KB"  # several shards per tiny model


def random_model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(VARIANTS[family]()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model
