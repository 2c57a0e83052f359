"""Expected acceptance of greedy drafts under vLLM's rejection rule, exactly, from target probabilities.

At temperature T > 0 vLLM's rejection sampler accepts a greedily drafted token d (draft
probabilities one-hot) with the target's probability p_T(d | context), and a round ends at the
first rejection. So for drafts d_1..d_k proposed at a context, with
p_j = p_T(d_j | context, d_1..d_{j-1}):

    E[tokens per target forward] = 1 + p_1 + p_1 p_2 + ... + p_1 ... p_k

(the 1: the bonus or recovered token every round emits). The expectation is exact given the
drafts; no sampling noise. Every start of a sequence is scored in one target forward: the drafts
of each start are appended after the sequence as a block that sees only the sequence's first
`start` tokens and its own earlier drafts, at the positions decoding would give them:

    columns   [ x_0 ... x_{N-1} | d(s1)_1 .. d(s1)_{k-1} | d(s2)_1 .. | ... ]
    positions   0 ... N-1         s1 ... s1+k-2            s2 ...
    d(s)_j sees x_0 .. x_{s-1} and d(s)_1 .. d(s)_j

(the last draft of each start needs no column: its probability is read at the one before).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from pipeline.models import target_forward
from pipeline.models.drafter import Drafter
from pipeline.models.eagle3 import Eagle3Drafter, TTTCache


@dataclass(frozen=True)
class ChainProbabilities:
    drafts: torch.Tensor  # (S, k) draft token ids per start
    accept: torch.Tensor  # (S, k) p_T(d_j | context, d_1..d_{j-1})
    argmax: torch.Tensor | None = None  # (S, k) bool: d_j is the target's argmax there (what greedy decoding keeps)

    def tau(self) -> torch.Tensor:
        """(S,) expected tokens per target forward of each start's round."""
        return 1 + torch.cumprod(self.accept, dim=1).sum(dim=1)

    def per_position(self) -> torch.Tensor:
        """(k,) mean probability that drafts 1..j are all accepted."""
        return torch.cumprod(self.accept, dim=1).mean(dim=0)


@dataclass(frozen=True)
class TargetPrefix:
    """A sequence's forward through the target, kept to score drafts along it again and again (a drafter
    evaluated as it trains): its key/value cache (each use crops its draft columns off again), its
    post-norm states and the layers a drafter reads."""

    cache: DynamicCache
    features: torch.Tensor  # (N, H)
    layers: torch.Tensor | None  # (N, n_layers * H): `layer_ids`' states, concatenated; None without layer_ids


@torch.no_grad()
def target_prefix(model: PreTrainedModel, sequence: torch.Tensor, layer_ids: list[int] | None = None) -> TargetPrefix:
    cache = DynamicCache()
    out = target_forward.forward(model, sequence[None], layer_ids, past_key_values=cache)
    return TargetPrefix(cache, out.features[0], None if layer_ids is None else out.layers[0].flatten(1))


def _step_mask(n: int, starts: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, S, n + step * S) additive mask of the step-th drafts' queries (step >= 1), one per start,
    over the sequence's n columns and the drafts fed so far (step-major: column n + i * S + r holds
    start r's draft i + 1)."""
    s, device = starts.shape[0], starts.device
    base = torch.arange(n, device=device)[None, :] < starts[:, None]  # (S, n)
    own = torch.eye(s, dtype=torch.bool, device=device).repeat(1, step)  # (S, step * S): the start's own drafts
    allowed = torch.cat([base, own], dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[
        None, None]


@torch.no_grad()
def _chain(model: PreTrainedModel, sequence: torch.Tensor, starts: torch.Tensor, k: int, temperature: float,
           choose: Callable[[int, torch.Tensor], torch.Tensor], prefix: TargetPrefix | None) -> ChainProbabilities:
    """Drafts d_1..d_k at every start, d_j = choose(j, log p_T(. | context, d_1..d_{j-1})) (S,), and the
    target's probability of each. The sequence runs forward once into a key/value cache; each draft
    step then feeds one column per start, at its decoding position, seeing its start's context and
    its own earlier drafts (the layout above, the drafts' columns in the cache)."""
    n = sequence.shape[0]
    prefix = prefix or target_prefix(model, sequence)
    cache = prefix.cache
    logits = model.lm_head(prefix.features[starts - 1])  # (S, V): what predicts each start's first draft
    drafts, accept, argmax = [], [], []
    for j in range(k):
        logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)  # (S, V)
        draft = choose(j, logprobs)  # (S,)
        drafts.append(draft)
        accept.append(logprobs.gather(-1, draft[:, None]).squeeze(-1).exp())
        argmax.append(draft == logprobs.argmax(-1))
        if j + 1 < k:
            logits = target_forward.forward(model, draft[None], position_ids=(starts + j)[None], past_key_values=cache,
                                            attention_mask=_step_mask(n, starts, j + 1, model.dtype)).logits[0]
    if cache.get_seq_length() > n:
        cache.crop(n - cache.get_seq_length())  # a negative count: the draft columns off the end
    return ChainProbabilities(torch.stack(drafts, dim=1), torch.stack(accept, dim=1), torch.stack(argmax, dim=1))


@torch.no_grad()
def chain_probabilities(model: PreTrainedModel, sequence: torch.Tensor, starts: torch.Tensor, drafts: torch.Tensor,
                        temperature: float, prefix: TargetPrefix | None = None) -> ChainProbabilities:
    """The target's acceptance probability of each start's drafts (S, k) along `sequence` (N,);
    `starts` (S,) are the numbers of context tokens, each at least 1; `prefix`: the sequence's forward,
    when the caller keeps it."""
    return _chain(model, sequence, starts, drafts.shape[1], temperature, lambda j, _: drafts[:, j], prefix)


@torch.no_grad()
def target_argmax_chain(model: PreTrainedModel, sequence: torch.Tensor, starts: torch.Tensor, k: int,
                        temperature: float) -> ChainProbabilities:
    """The oracle greedy drafter: at each start it proposes the target's own argmax k times in a row."""
    return _chain(model, sequence, starts, k, temperature, lambda _, logprobs: logprobs.argmax(-1), None)


def _drafter_features(prefix: TargetPrefix, drafter: Drafter) -> torch.Tensor:
    """(N, D) what the drafter reads at each position: its layers, or the post-norm state."""
    if drafter.decode_layer_ids is None:
        return prefix.features
    if prefix.layers is None:
        raise ValueError("the target prefix holds no layers; build it with the drafter's decode_layer_ids")
    return prefix.layers


def round_starts(prompt_len: int, length: int) -> torch.Tensor:
    """(S,) the context lengths a speculative round can start from in a sequence of `length` tokens
    whose answer begins at `prompt_len`: after each answer token but the last (the target emits the
    first answer token itself, and after the last no round runs)."""
    return torch.arange(prompt_len + 1, length)


@torch.no_grad()
def drafter_chain(model: PreTrainedModel, drafter: Drafter, sequence: torch.Tensor, starts: torch.Tensor, k: int,
                  temperature: float, prefix: TargetPrefix | None = None) -> ChainProbabilities:
    """A drafter's greedy proposals at each start of `sequence` (N,), as decoding makes them (step j
    reads the drafter's own drafts 1..j, not the sequence's tokens), and the target's acceptance
    probability of each: the target's forward over the sequence (`prefix`, when the caller keeps it:
    it depends on the target and the sequence only), k unrolled drafter passes (pass j recomputes
    steps 0..j-1, so the drafter's TTT path serves unchanged), k - 1 small target forwards."""
    device = sequence.device
    n = sequence.shape[0] - 1  # pairs (f_t, x_{t+1}), t < N - 1
    prefix = prefix or target_prefix(model, sequence, drafter.decode_layer_ids)
    features = _drafter_features(prefix, drafter)[None, :n]  # (1, n, D)
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]  # (1, 1, n, n)
    positions = torch.arange(n, device=device)[None]  # (1, n)
    step_ids = [sequence[1:][None]]  # step 0 at t reads x_{t+1}
    for j in range(k):
        drafts = drafter.draft_unrolled(features, step_ids, positions, mask)  # (j+1, 1, n): step j at t drafts t+2+j
        if j + 1 < k:
            step_ids.append(drafts[j])
    pairs = starts - 2  # the round after context x_0 .. x_{s-1} drafts from the pair (f_{s-2}, x_{s-1})
    proposals = drafts[:, 0, pairs].T.contiguous()  # (S, k)
    return chain_probabilities(model, sequence, starts, proposals, temperature, prefix)


@torch.no_grad()
def eagle3_sampled_chain(model: PreTrainedModel, drafter: Eagle3Drafter, sequence: torch.Tensor, starts: torch.Tensor,
                         k: int, temperature: float, generator: torch.Generator,
                         prefix: TargetPrefix | None = None) -> ChainProbabilities:
    """vLLM's probabilistic drafting: at each start the drafter samples d_j from its own distribution q at
    `temperature` (over its draft vocabulary), step j reading its own sample d_{j-1}, and the target accepts
    d_j with min(1, p_T(d_j) / q(d_j)). One sampled chain per start: the product of its acceptance
    probabilities is an unbiased estimate of the chance that drafts 1..j are all accepted, so the mean
    over many starts estimates tau without the noise of sampled accept/reject decisions."""
    device = sequence.device
    n = sequence.shape[0] - 1
    prefix = prefix or target_prefix(model, sequence, drafter.decode_layer_ids)
    features = _drafter_features(prefix, drafter)[None, :n]  # (1, n, D)
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]  # (1, 1, n, n)
    positions = torch.arange(n, device=device)[None]  # (1, n)
    cache = TTTCache()
    state = drafter.project_aux(features)  # (1, n, H)
    ids = sequence[1:][None]  # (1, n): step 0 at t reads x_{t+1}
    drafts, draft_probs = [], []
    for _ in range(k):
        state = drafter.step(ids, state, positions, mask, cache)  # (1, n, H)
        logits = drafter.lm_head(drafter.logits_input(state))[0].float() / temperature  # (n, Vd)
        probs = torch.softmax(logits, dim=-1)
        sampled = torch.multinomial(probs, 1, generator=generator)  # (n, 1) draft ids
        draft_probs.append(probs.gather(-1, sampled)[:, 0])
        ids = drafter.draft_to_target[sampled[:, 0]][None]  # (1, n) target ids
        drafts.append(ids[0])
    pairs = starts - 2  # the round after context x_0 .. x_{s-1} drafts from the pair (f_{s-2}, x_{s-1})
    proposals = torch.stack(drafts, dim=1)[pairs]  # (S, k)
    q = torch.stack(draft_probs, dim=1)[pairs]  # (S, k)
    p = chain_probabilities(model, sequence, starts, proposals, temperature, prefix).accept  # (S, k)
    return ChainProbabilities(proposals, torch.clamp(p / q, max=1.0))
