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

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from pipeline.evaluation.speculative import features_for
from pipeline.models import target_forward
from pipeline.models.drafter import Drafter


@dataclass(frozen=True)
class ChainProbabilities:
    drafts: torch.Tensor  # (S, k) draft token ids per start
    accept: torch.Tensor  # (S, k) p_T(d_j | context, d_1..d_{j-1})

    def tau(self) -> torch.Tensor:
        """(S,) expected tokens per target forward of each start's round."""
        return 1 + torch.cumprod(self.accept, dim=1).sum(dim=1)

    def per_position(self) -> torch.Tensor:
        """(k,) mean probability that drafts 1..j are all accepted."""
        return torch.cumprod(self.accept, dim=1).mean(dim=0)


def _tree_inputs(sequence: torch.Tensor, starts: torch.Tensor, drafts: torch.Tensor, dtype: torch.dtype):
    """The sequence with each start's first `drafts.shape[1]` drafts appended, their positions and
    the additive mask (1, 1, C, C) of the layout above."""
    n, (s, d) = sequence.shape[0], drafts.shape
    device = sequence.device
    ids = torch.cat([sequence, drafts.reshape(-1)])  # (C,)
    offsets = torch.arange(d, device=device)
    positions = torch.cat([torch.arange(n, device=device), (starts[:, None] + offsets).reshape(-1)])  # (C,)
    c = n + s * d
    allowed = torch.zeros(c, c, dtype=torch.bool, device=device)
    allowed[:n, :n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    rows = n + torch.arange(s * d, device=device)  # (S*d,)
    owner = torch.arange(s, device=device).repeat_interleave(d)  # (S*d,)
    allowed[rows, :n] = torch.arange(n, device=device)[None, :] < starts[owner][:, None]
    block = offsets[None, :] <= offsets[:, None]  # (d, d) lower triangle
    for i in range(s):
        lo = n + i * d
        allowed[lo:lo + d, lo:lo + d] = block
    mask = torch.zeros(c, c, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return ids[None], positions[None], mask[None, None]


@torch.no_grad()
def _logits(model: PreTrainedModel, sequence: torch.Tensor, starts: torch.Tensor, drafts: torch.Tensor,
            temperature: float) -> torch.Tensor:
    """(S, d+1, V) log-probabilities at temperature T of the token at start + j, given the sequence's
    first `start` tokens and drafts 1..j (j = 0..d)."""
    n, (s, d) = sequence.shape[0], drafts.shape
    ids, positions, mask = _tree_inputs(sequence, starts, drafts, model.dtype)
    hidden = model.model(input_ids=ids, position_ids=positions, attention_mask=mask).last_hidden_state[0]  # (C, H)
    columns = torch.cat([(starts - 1)[:, None], n + torch.arange(s * d, device=sequence.device).reshape(s, d)], 1)
    logits = model.lm_head(hidden[columns]).float()  # (S, d+1, V)
    return torch.log_softmax(logits / temperature, dim=-1)


@torch.no_grad()
def chain_probabilities(model: PreTrainedModel, sequence: torch.Tensor, starts: torch.Tensor, drafts: torch.Tensor,
                        temperature: float) -> ChainProbabilities:
    """The target's acceptance probability of each start's drafts (S, k) along `sequence` (N,);
    `starts` (S,) are the numbers of context tokens, each at least 1."""
    logprobs = _logits(model, sequence, starts, drafts[:, :-1], temperature)  # (S, k, V)
    accept = logprobs.gather(-1, drafts[..., None]).squeeze(-1).exp()  # (S, k)
    return ChainProbabilities(drafts, accept)


@torch.no_grad()
def target_argmax_chain(model: PreTrainedModel, sequence: torch.Tensor, starts: torch.Tensor, k: int,
                        temperature: float) -> ChainProbabilities:
    """The oracle greedy drafter: at each start it proposes the target's own argmax k times in a row
    (k target forwards, each with one more draft per start)."""
    drafts = torch.empty(starts.shape[0], 0, dtype=sequence.dtype, device=sequence.device)
    for _ in range(k):
        logprobs = _logits(model, sequence, starts, drafts, temperature)  # (S, j+1, V)
        drafts = torch.cat([drafts, logprobs[:, -1].argmax(-1, keepdim=True)], dim=1)
    return chain_probabilities(model, sequence, starts, drafts, temperature)


def round_starts(prompt_len: int, length: int) -> torch.Tensor:
    """(S,) the context lengths a speculative round can start from in a sequence of `length` tokens
    whose answer begins at `prompt_len`: after each answer token but the last (the target emits the
    first answer token itself, and after the last no round runs)."""
    return torch.arange(prompt_len + 1, length)


@torch.no_grad()
def drafter_chain(model: PreTrainedModel, drafter: Drafter, sequence: torch.Tensor, starts: torch.Tensor, k: int,
                  temperature: float, features: torch.Tensor | None = None) -> ChainProbabilities:
    """A drafter's greedy proposals at each start of `sequence` (N,), as decoding makes them (step j
    reads the drafter's own drafts 1..j, not the sequence's tokens), and the target's acceptance
    probability of each: one target forward for the drafter's features, k unrolled drafter passes
    (pass j recomputes steps 0..j-1, so the drafter's TTT path serves unchanged), one forward for
    the probabilities."""
    device = sequence.device
    out = target_forward.forward(model, sequence[None], drafter.decode_layer_ids)
    n = sequence.shape[0] - 1  # pairs (f_t, x_{t+1}), t < N - 1
    features = features_for(out, drafter.decode_layer_ids)[:, :n]  # (1, n, D)
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]  # (1, 1, n, n)
    positions = torch.arange(n, device=device)[None]  # (1, n)
    step_ids = [sequence[1:][None]]  # step 0 at t reads x_{t+1}
    for j in range(k):
        drafts = drafter.draft_unrolled(features, step_ids, positions, mask)  # (j+1, 1, n): step j at t drafts t+2+j
        if j + 1 < k:
            step_ids.append(drafts[j])
    pairs = starts - 2  # the round after context x_0 .. x_{s-1} drafts from the pair (f_{s-2}, x_{s-1})
    proposals = drafts[:, 0, pairs].T.contiguous()  # (S, k)
    return chain_probabilities(model, sequence, starts, proposals, temperature)
