"""`cli.py plan`: the capacity plan of the reference steps, pinned against a fixed throughput file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import cli
from pipeline.accounting.capacity import (
    DEFAULT_THROUGHPUT,
    CapacityError,
    CapacityPlan,
    PolicyShape,
    StepShape,
    Throughput,
    plan_capacity,
)
from pipeline.config import CONFIG_ENV, load_config

ROOT = Path(__file__).resolve().parents[2]

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "tie_word_embeddings": False}
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
             "tie_word_embeddings": False}
# The H100 figures of docs/storage.md, fixed here so that the pins below move only with the model.
THROUGHPUT = {
    "extraction": {"target": {"hidden_size": 2048, "num_layers": 16, "intermediate_size": 8192, "num_heads": 32,
                              "num_kv_heads": 8, "vocab_size": 128256, "min_len": 128, "max_len": 2048},
                   "plain_forward_tokens_per_s": 180000, "storage_write_gb_per_s": 1.36},
    "training": {"gpu": {"gpu": "NVIDIA H100 80GB HBM3", "tokens_per_s": 47400,
                         "shapes": {"hidden": 4096, "heads": 32, "kv_heads": 8, "mlp": 14336, "draft_vocab": 32000,
                                    "tokens": 8192, "docs": 16}}},
    "evaluation": {"gpu": {"target_params": 1235746816, "speculative_tokens_per_s": 492}},
}
# The settings the pins are of: the capture and training budgets of the shipped defaults.
SETTINGS = {"capture": {"max_samples": 1024, "max_tokens": 0},
            "train": {"window_tokens": 512, "epochs": 20, "max_tokens": 4_000_000, "buffer_steps": 2},
            "eval": {"num_prompts": 24, "max_new_tokens": 40, "held_out_fraction": 0.125},
            "storage": {"compression": "none"}, "drafter": {"kind": "eagle3"}}


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, policy: dict,
          *extra: str) -> str:
    (tmp_path / "config.json").write_text(json.dumps(policy))
    (tmp_path / "throughput.json").write_text(json.dumps(THROUGHPUT))
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(SETTINGS))
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "pipeline.yaml"))  # what --config does, undone after the test
    capsys.readouterr()
    cli.main(["plan", "--policy", str(tmp_path / "config.json"),
              "--rollouts", "4096", "--mean-tokens", "3000", "--p99-tokens", "12000", "--gpus", "8",
              "--gpu-type", "H100", "--rl-step-s", "600", "--throughput", str(tmp_path / "throughput.json"), *extra])
    return capsys.readouterr().out


def test_reference_8b_step(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    table = _plan(tmp_path, capsys, monkeypatch, QWEN3_8B)
    assert table.startswith("| figure ")
    figures = dict(line.strip("| ").split(" | ") for line in table.splitlines()[2:])
    assert {k.strip(): v for k, v in figures.items()} == {
        "GPU": "8 x NVIDIA H100 80GB HBM3",
        "policy parameters": "8.2B",
        "rollouts captured per step": "1,024",
        "tokens forwarded per step": "3.07M",
        "tokens stored per step": "0.52M",
        "bytes stored per step": "17.1 GB",
        "bytes retained (2 steps)": "34.3 GB",
        "stored / read by training": "1.00x",
        "tokens trained per step": "4.00M",
        "extraction GPU-s per step": "128",
        "training GPU-s per step": "80",
        "evaluation GPU-s per step": "78",
        "drafter GPU-s per step": "286 (6.0% of the RL step's 4,800)",
        "drafter latency": "173 s",
        "served drafter's lag (RL step 600 s)": "1 RL step(s)",
    }


def test_reference_70b_step_as_json(tmp_path: Path, capsys: pytest.CaptureFixture,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads(_plan(tmp_path, capsys, monkeypatch, LLAMA_70B, "--json"))
    plan = CapacityPlan.from_json(doc)
    rounded = {k: round(v, 1) if isinstance(v, float) else v for k, v in doc.items()}
    assert rounded == {
        "gpu": "NVIDIA H100 80GB HBM3", "gpus": 8, "rl_step_s": 600.0, "policy_params": 70552387584,
        "rollouts_captured": 1024, "tokens_forwarded": 3070929.0, "tokens_stored": 522696.6,
        "bytes_stored": 34258055741.3, "bytes_retained": 68516111482.6, "retained_steps": 2,
        "stored_vs_read": 1.0, "tokens_trained": 4000000.0, "extraction_gpu_s": 1200.9, "training_gpu_s": 262.8,
        "evaluation_gpu_s": 668.4, "latency_s": 1081.3, "lag_steps": 2, "schema_version": 1,
        "drafter_gpu_s": 2132.0, "drafter_share": 0.4,
    }
    # a 70B policy's forward over 3M tokens alone is a quarter of 8 GPUs' 600 s: the plan says so
    assert doc["drafter_share"] == pytest.approx(2132.0 / 4800, abs=1e-3)
    assert plan.lag_steps == 2


@pytest.mark.parametrize(("drafter", "layers"), [
    ({"kind": "eagle"}, 1),  # EAGLE-1/2: the last layer after the final norm
    ({"kind": "eagle3"}, 4),  # vLLM's aux layers of a 36-layer target, (2, 18, 33), and the last, 36
    ({"kind": "peagle"}, 4),  # P-EAGLE reads EAGLE-3's layers
    ({"kind": "peagle", "aux_layer_ids": [1, 18, 36]}, 3),  # the last among the aux layers: stored once
], ids=["eagle", "eagle3", "peagle", "peagle-last-among-aux"])
def test_bytes_stored_count_every_layer_the_drafter_reads(drafter: dict, layers: int) -> None:
    cfg = load_config(overrides={**SETTINGS, "drafter": drafter})
    step = StepShape(4096, 3000, 12000, 8, "H100", 600)
    plan = plan_capacity(PolicyShape.from_config(QWEN3_8B), step, Throughput.from_bench(THROUGHPUT, "t"), cfg)
    assert plan.tokens_stored == pytest.approx(522_696.6, rel=1e-6)  # the same windows whatever the kind
    per_token = layers * 4096 * 2 + 5  # each layer's bf16 values at H 4096, the token's id and mask
    assert plan.bytes_stored == pytest.approx(plan.tokens_stored * per_token, rel=1e-9)


def test_the_plan_imports_no_torch() -> None:
    """`cli.py plan` imports no torch: the layers a drafter stores come from `pipeline.models.layers`,
    as extraction's do, which needs none."""
    code = "import sys, pipeline.accounting.capacity; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "False"


def test_whole_rollouts_store_what_training_never_reads() -> None:
    """Before capture plans: every token of every training rollout, 5.9x the windows training reads."""
    cfg = load_config()
    cfg = cfg.model_copy(update={"capture": cfg.capture.model_copy(update={"max_samples": 0}),
                                 "train": cfg.train.model_copy(update={"max_tokens": 0, "epochs": 20,
                                                                                "warm_start_epochs": 0})})
    step = StepShape(4096, 3000, 12000, 8, "H100", 600)
    before = plan_capacity(PolicyShape.from_config(QWEN3_8B), step, Throughput.from_bench(THROUGHPUT, "t"), cfg,
                           whole_rollouts=True)
    assert before.rollouts_captured == pytest.approx(3584)
    assert before.stored_vs_read == pytest.approx(5.88, abs=0.01)
    assert before.bytes_stored == pytest.approx(352.3e9, rel=1e-3)
    assert before.training_gpu_s > 1400
    assert before.lag_steps == 3


def test_the_shipped_default_is_readable_and_lengths_fit_mean_and_p99() -> None:
    assert "H100" in Throughput.load(DEFAULT_THROUGHPUT).gpu
    lengths = StepShape(10, 3000, 12000, 1, "H100", 600).lengths()
    assert sum(lengths) / len(lengths) == pytest.approx(3000, rel=0.01)
    assert sorted(lengths)[int(0.99 * len(lengths))] == pytest.approx(12000, rel=0.02)


@pytest.mark.parametrize(("doc", "field"), [
    ({"hidden_size": 64}, "num_attention_heads"),
    ({**QWEN3_8B, "vocab_size": 0}, "vocab_size"),
])
def test_a_policy_config_lacking_a_size_is_refused_naming_it(doc: dict, field: str) -> None:
    with pytest.raises(CapacityError, match=field):
        PolicyShape.from_config(doc, "config.json")


def test_throughput_without_gpu_figures_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({**THROUGHPUT, "training": {"gpu": None}}))
    with pytest.raises(CapacityError, match="without a GPU"):
        Throughput.load(path)
    (tmp_path / "c.json").write_text(json.dumps(QWEN3_8B))
    with pytest.raises(SystemExit, match="not a A100"):
        cli.main(["plan", "--policy", str(tmp_path / "c.json"), "--rollouts", "8", "--mean-tokens", "10",
                  "--p99-tokens", "20", "--gpus", "1", "--gpu-type", "A100"])


def test_sampled_rollouts_are_evaluated_twice() -> None:
    """At the rollouts' temperature each drafter is decoded at it and greedily beside it (acceptance.measure_step):
    the plan counts both passes."""
    policy, throughput = PolicyShape.from_config(QWEN3_8B, "qwen3"), Throughput.load()
    step = StepShape(1024, 3000, 12000, 8, "H100", 600.0)

    def evaluation_s(temperature: float) -> float:
        cfg = load_config(overrides={"eval": {"sampling": {"temperature": temperature}}})
        return plan_capacity(policy, step, throughput, cfg).evaluation_gpu_s

    assert evaluation_s(1.0) == pytest.approx(2 * evaluation_s(0.0))


def test_a_measured_policy_load_is_each_extraction_ranks_first_work() -> None:
    """With `extraction.policy_load_gb_per_s`, each of the step's GPUs loads the policy's weights (bf16 unless its
    config says float32) before its forward: the plan adds those seconds on every GPU and once to the latency."""
    step = StepShape(1024, 3000, 12000, 8, "H100", 600.0)
    cfg = load_config(overrides=SETTINGS)
    without = Throughput.from_bench(THROUGHPUT, "t")
    loaded = Throughput.from_bench({**THROUGHPUT, "extraction": {**THROUGHPUT["extraction"],
                                                                 "policy_load_gb_per_s": 2.0}}, "t")
    for config, bytes_per_param in ((QWEN3_8B, 2), ({**QWEN3_8B, "torch_dtype": "float32"}, 4)):
        policy = PolicyShape.from_config(config)
        before, after = (plan_capacity(policy, step, t, cfg) for t in (without, loaded))
        load_s = policy.params * bytes_per_param / 2e9
        assert after.extraction_gpu_s == pytest.approx(before.extraction_gpu_s + 8 * load_s)
        assert after.latency_s == pytest.approx(before.latency_s + load_s)
        assert after.training_gpu_s == before.training_gpu_s
