"""The rounds greedy speculative decoding makes along a text the target emitted, counted by the product.

A replica that decodes a prompt greedily emits the target's argmax text; along that text the product knows
every round vLLM ran. The first answer token comes from the prefill; each round then starts after the tokens
emitted so far (context length s), drafts d_1..d_k from the drafter (`drafter_chain`: step j reads its own
drafts), keeps the leading drafts that are the target's argmax, emits one more token and moves s past them:

    matched(s) = leading j with d_j = argmax p_T(. | x_<s, d_1..d_{j-1})
    s  ->  s + matched(s) + 1,   while s < N (a request that has its tokens runs no further round)

A round near the end may keep drafts past the last emitted token (vLLM counts them before it cuts the answer
at max_tokens), so the target scores the drafts themselves, not the text. vLLM's counters count the same:
one draft per round, `matched` accepted tokens, so the two mean acceptance lengths agree up to the two
engines' arithmetic (a near-tie of the argmax).

    python -m pipeline.evaluation.greedy_rounds < request.json      what the deploy's agreement gate launches

reads {"policy": dir, "drafter": dir, "k": k, "canaries": [{"prompt": [...], "completion": [...]}, ...]} and
prints {"rounds": R, "accepted": A}.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from pipeline.evaluation.expected_acceptance import drafter_chain
from pipeline.models.drafter import Drafter


@dataclass(frozen=True)
class RoundCount:
    rounds: int  # drafts, in vLLM's words: one per round
    accepted: int  # draft tokens kept

    def __add__(self, other: RoundCount) -> RoundCount:
        return RoundCount(self.rounds + other.rounds, self.accepted + other.accepted)

    @property
    def tau(self) -> float | None:
        """Mean acceptance length: tokens emitted per round, vLLM's `1 + accepted / drafts`."""
        return 1 + self.accepted / self.rounds if self.rounds else None


@torch.no_grad()
def greedy_rounds(model: PreTrainedModel, drafter: Drafter, sequence: torch.Tensor, prompt_len: int,
                  k: int) -> RoundCount:
    """The rounds along `sequence` (N,): a prompt of `prompt_len` tokens and the greedy answer after it."""
    n = sequence.shape[0]
    if n <= prompt_len + 1:
        return RoundCount(0, 0)  # the prefill emitted the whole answer
    starts = torch.arange(prompt_len + 1, n)  # (S,) every context length a round can start from
    chain = drafter_chain(model, drafter, sequence, starts, k, temperature=1.0)
    matched = chain.argmax.long().cumprod(dim=1).sum(dim=1).tolist()  # (S,) leading drafts the target keeps
    count, s = RoundCount(0, 0), prompt_len + 1
    while s < n:
        kept = matched[s - prompt_len - 1]
        count += RoundCount(1, kept)
        s += kept + 1
    return count


def main() -> None:
    from pipeline.models import target as target_lib
    from pipeline.models.checkpoint import load_drafter

    request = json.load(sys.stdin)
    model = target_lib.load_checkpoint(request["policy"]).float().eval()
    drafter = load_drafter(Path(request["drafter"]), model.config.num_hidden_layers).float().eval()
    drafter.attach(model)
    total = RoundCount(0, 0)
    for canary in request["canaries"]:
        sequence = torch.tensor(canary["prompt"] + canary["completion"], dtype=torch.long)
        total += greedy_rounds(model, drafter, sequence, len(canary["prompt"]), int(request["k"]))
    sys.stdout.write(json.dumps(asdict(total)) + "\n")


if __name__ == "__main__":
    main()
