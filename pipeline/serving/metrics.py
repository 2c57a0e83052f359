"""vLLM's speculative-decoding counters: render them (stand-in replica) and read them from a replica's /metrics
(deploy gates, live tau).

    vllm:spec_decode_num_drafts_total                      draft rounds
    vllm:spec_decode_num_draft_tokens_total                tokens proposed
    vllm:spec_decode_num_accepted_tokens_total             tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="j"}

Over a window between two scrapes: mean acceptance length = 1 + accepted / drafts,
acceptance rate = accepted / draft_tokens. Such a window holds every request the replica served in it; one
completion's own counts come in its response instead, where vLLM runs with --per-request-spec-decode-metrics
(`request_counters`).

The stand-in replica adds two metrics of its own (vLLM has neither):

    standin:speculative_batch_threshold                    the largest batch bucket whose rounds speculate now
    standin:rounds_total{kind="speculative"|"plain"}       rounds run, by kind
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pipeline.serving.drivers import ReplicaSpec, call

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        positions = self.accepted_per_position.keys() | other.accepted_per_position.keys()
        return SpecCounters(
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted + other.accepted,
            {j: self.accepted_per_position.get(j, 0.0) + other.accepted_per_position.get(j, 0.0) for j in positions},
        )

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.drafts - earlier.drafts,
            self.draft_tokens - earlier.draft_tokens,
            self.accepted - earlier.accepted,
            {j: v - earlier.accepted_per_position.get(j, 0.0) for j, v in self.accepted_per_position.items()},
        )

    def to_json(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "accepted_per_position": {str(j): v for j, v in self.accepted_per_position.items()}}

    @classmethod
    def from_json(cls, data: dict) -> SpecCounters:
        return cls(data["drafts"], data["draft_tokens"], data["accepted"],
                   {int(j): v for j, v in data["accepted_per_position"].items()})

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts > 0 else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens > 0 else None


def parse(text: str) -> SpecCounters:
    """Sum the counters over all label sets (engines, models) of a /metrics page."""
    totals = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # _created timestamps
            name = sample.name.removesuffix("_total")
            if name in totals:
                totals[name] += sample.value
            elif name == PER_POSITION:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
    return SpecCounters(totals[DRAFTS], totals[DRAFT_TOKENS], totals[ACCEPTED], per_position)


def request_counters(completion: dict) -> SpecCounters | None:
    """One completion's own counts (vLLM's `metrics.speculative_decoding`: verify steps, draft tokens, accepted
    draft tokens); None where the replica does not report them."""
    spec = (completion.get("metrics") or {}).get("speculative_decoding")
    if not spec:
        return None
    return SpecCounters(float(spec["num_spec_steps"]), float(spec["num_draft_tokens"]),
                        float(spec["num_accepted_draft_tokens"]))


def render(counters: SpecCounters, model_name: str) -> str:
    """Prometheus text exposition with vLLM's names and labels."""
    label = f'engine="0",model_name="{model_name}"'
    lines = []
    for name, value, help_text in (
        (DRAFTS, counters.drafts, "Number of spec decoding drafts."),
        (DRAFT_TOKENS, counters.draft_tokens, "Number of draft tokens."),
        (ACCEPTED, counters.accepted, "Number of accepted tokens."),
    ):
        lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter",
                  f"{name}_total{{{label}}} {value}"]
    lines += [f"# HELP {PER_POSITION}_total Accepted tokens per draft position.",
              f"# TYPE {PER_POSITION}_total counter"]
    lines += [f'{PER_POSITION}_total{{{label},position="{j}"}} {v}'
              for j, v in sorted(counters.accepted_per_position.items())]
    return "\n".join(lines) + "\n"


THRESHOLD = "standin:speculative_batch_threshold"
ROUNDS = "standin:rounds"


def render_standin(threshold: int, rounds: dict[str, int], model_name: str) -> str:
    """The stand-in's own metrics, in the same exposition format."""
    label = f'engine="0",model_name="{model_name}"'
    lines = [f"# HELP {THRESHOLD} The largest batch-size bucket whose rounds speculate (stand-in, not vLLM).",
             f"# TYPE {THRESHOLD} gauge", f"{THRESHOLD}{{{label}}} {threshold}",
             f"# HELP {ROUNDS}_total Decoding rounds by kind (stand-in, not vLLM).", f"# TYPE {ROUNDS}_total counter"]
    lines += [f'{ROUNDS}_total{{{label},kind="{kind}"}} {n}' for kind, n in sorted(rounds.items())]
    return "\n".join(lines) + "\n"


def read_standin(text: str) -> tuple[int | None, dict[str, float]]:
    """The stand-in's threshold and rounds by kind from a /metrics page; (None, {}) from a vLLM replica."""
    threshold, rounds = None, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == THRESHOLD:
                threshold = int(sample.value)
            elif sample.name == f"{ROUNDS}_total":
                rounds[sample.labels["kind"]] = rounds.get(sample.labels["kind"], 0.0) + sample.value
    return threshold, rounds


def scrape(replica: ReplicaSpec, timeout: float = 10.0) -> SpecCounters:
    """The replica's speculative-decoding counters now."""
    return parse(call(replica, "/metrics", timeout=timeout).decode())
