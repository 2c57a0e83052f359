"""The tiny EAGLE-3 drafters and target the unit tests of the model, its checkpoints, decoding and training share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, PreTrainedModel

from pipeline.models import target_forward
from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter, TTTCache, default_aux_layer_ids, draft_vocab
from pipeline.training.dataset import Sample
from tests.support.targets import tiny_target

V, DV, H, HEADS = 32, 24, 32, 2
AUX = (0, 1, 2)

VARIANTS = {
    "plain": {},
    "norm-before-residual": {"norm_before_residual": True},
    "fc-norm": {"fc_norm": True},
    "norm-output": {"norm_output": True},
    "gqa": {"num_key_value_heads": 1},
}


def make_config(**overrides) -> Eagle3Config:
    base = {
        "vocab_size": V, "draft_vocab_size": DV, "hidden_size": H, "target_hidden_size": H,
        "intermediate_size": 2 * H, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "aux_layer_ids": AUX,
    }
    return Eagle3Config(**{**base, **overrides})


def make_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(make_config(**overrides))
    with torch.no_grad():  # non-trivial norm weights, so that a skipped or misplaced norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # input_layernorm, hidden_norm, post_attention_layernorm, norm, fc_norm
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model.eval()


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def random_inputs(model: Eagle3Drafter, n: int, batch: int = 1, seed: int = 1):
    """(ids (B, n), aux (B, n, n_aux * Ht))."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (batch, n), generator=g)
    aux = torch.randn(batch, n, len(c.aux_layer_ids) * c.target_hidden_size, generator=g)
    return ids, aux


def random_counts(seed: int = 0, size: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (size,), generator=g)



def unroll(model: Eagle3Drafter, step_ids, g, positions, mask) -> list[torch.Tensor]:
    """Run steps 0..len(step_ids)-1 over all positions; step_ids[k] is (B, N) and g the step-0 hidden input."""
    cache, states, state = TTTCache(), [], g
    for ids in step_ids:
        state = model.step(ids, state, positions, mask, cache)
        states.append(state)
    return states


def eagle3_target() -> LlamaForCausalLM:
    return tiny_target(V, H, 4, HEADS)


def drafter_for(target: LlamaForCausalLM, seed: int = 0, **overrides) -> Eagle3Drafter:
    num_layers = target.config.num_hidden_layers
    torch.manual_seed(seed)
    model = Eagle3Drafter(make_config(aux_layer_ids=default_aux_layer_ids(num_layers), **overrides))
    model.set_vocab(*draft_vocab(random_counts(seed), DV))
    model.attach(target)
    model.init_lm_head(target)
    return model


def target_samples(target: LlamaForCausalLM, aux: tuple[int, ...], count: int, seed: int = 0) -> list[Sample]:
    """Samples the way pipeline.models.drafter.training_sample builds them: [aux..., L] layers flattened per token."""
    layer_ids = [*aux, target.config.num_hidden_layers]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(10, 18, (1,), generator=g))
        start = int(torch.randint(0, V, (1,), generator=g))
        ids = (start + 3 * torch.arange(n)) % V  # a repetitive little language
        layers = target_forward.forward(target, ids[None], layer_ids=layer_ids).layers[0]  # (T, n_aux + 1, H)
        mask = torch.ones(n, dtype=torch.int64)
        mask[:3] = 0
        out.append((ids, layers.flatten(1).float(), mask))
    return out



def fit_first_step(drafter: Eagle3Drafter, target: PreTrainedModel, texts: list[torch.Tensor], steps: int,
                   lr: float = 1e-2) -> Eagle3Drafter:
    """`drafter` (attached to `target`) with its first draft step fitted to `texts`, so that greedy decoding of
    their prompts keeps 0 to k drafts a round (an untrained drafter keeps almost none, every round alike). The
    embeddings are the target's and stay as they are."""
    draft_index = {int(t): i for i, t in enumerate(drafter.draft_to_target.tolist())}
    optimizer = torch.optim.Adam([p for name, p in drafter.named_parameters() if "embed" not in name], lr=lr)
    inputs = []
    for text in texts:
        n = text.shape[0] - 2  # pairs (f_t, x_{t+1}) whose step 0 drafts x_{t+2}
        with torch.no_grad():
            layers = target_forward.forward(target, text[None], drafter.decode_layer_ids).layers  # (1, N, L, H)
        labels = torch.tensor([draft_index.get(int(t), -100) for t in text[2:]])  # (n,) -100: not in the vocab
        inputs.append((text[None, 1 : n + 1], layers.flatten(2)[:, :n].float(), labels))
    drafter.train()
    for _ in range(steps):
        loss = torch.zeros(())
        for ids, features, labels in inputs:
            n = ids.shape[1]
            state = drafter.step(ids, drafter.project_aux(features), torch.arange(n)[None], causal(n), TTTCache())
            logits = drafter.lm_head(drafter.logits_input(state))[0]  # (n, DV)
            loss = loss + F.cross_entropy(logits, labels, ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()
