"""The typed pipeline configuration (pipeline.config)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import CONFIG_ENV, DEFAULTS_PATH, ConfigError, PipelineConfig, load_config, parse_config


@pytest.fixture(autouse=True)
def _no_user_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)


def write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_load() -> None:
    cfg = load_config()

    assert cfg == PipelineConfig()  # defaults.yaml and the model's defaults agree
    assert cfg.run == "demo"
    assert cfg.rollout_source == "simulated"
    assert cfg.train.window_tokens == 512
    assert cfg.train.data_buffer_max_size == 10000
    assert cfg.train.buffer_steps == 2
    assert cfg.train.optim.lr == pytest.approx(3e-3)
    assert cfg.eval.num_speculative_tokens == 4
    assert cfg.promotion.policy == "auto"
    assert cfg.drafter.intermediate_size is None


def test_defaults_file_lists_every_key() -> None:
    def keys(data: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in data.items():
            out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
        return out

    from_file = keys(yaml.safe_load(DEFAULTS_PATH.read_text()))
    from_model = keys(PipelineConfig().model_dump())
    assert from_file == from_model


def test_overrides_merge_over_defaults() -> None:
    cfg = load_config(overrides={"train": {"epochs": 3, "optim": {"lr": 0.1}}, "run": "other"})

    assert cfg.run == "other"
    assert cfg.train.epochs == 3
    assert cfg.train.optim.lr == pytest.approx(0.1)
    # siblings of the overridden keys keep their defaults
    assert cfg.train.window_tokens == 512
    assert cfg.train.optim.lr_warmup_steps == 10
    assert cfg.eval == PipelineConfig().eval


def test_config_is_frozen() -> None:
    cfg = load_config()
    with pytest.raises(ValueError, match="frozen"):
        cfg.train.epochs = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        pytest.param({"train": {"window_tokens": 0}}, "train.window_tokens", id="window-zero",
                     marks=pytest.mark.reliability("bad_input", "config out of range: window 0")),
        pytest.param({"train": {"window_tokens": 1}}, "train.window_tokens", id="window-one"),
        pytest.param({"train": {"data_buffer_max_size": -1}}, "train.data_buffer_max_size", id="buffer-negative",
                     marks=pytest.mark.reliability("bad_input", "config out of range: buffer size negative")),
        pytest.param({"train": {"buffer_steps": 0}}, "train.buffer_steps", id="buffer-steps-zero"),
        pytest.param({"train": {"optim": {"lr": 0}}}, "train.optim.lr", id="lr-zero"),
        pytest.param({"train": {"epochs": "many"}}, "train.epochs", id="epochs-not-int"),
        pytest.param({"eval": {"num_speculative_tokens": 0}}, "eval.num_speculative_tokens", id="k-zero",
                     marks=pytest.mark.reliability("bad_input", "config out of range: k < 1")),
        pytest.param({"eval": {"held_out_fraction": 1.0}}, "eval.held_out_fraction", id="held-out-one"),
        pytest.param({"train": {"bogus": 1}}, "train.bogus", id="unknown-nested-key"),
        pytest.param({"bogus": 1}, "bogus", id="unknown-top-level-key"),
        pytest.param({"promotion": {"policy": "sometimes"}}, "promotion.policy", id="policy-sometimes"),
        pytest.param({"rollout_source": "kafka"}, "rollout_source", id="rollout-source"),
        pytest.param({"run": "has space"}, "run", id="run-name-pattern"),
        pytest.param({"train": {"vloss_weight": 0, "ploss_weight": 0}}, "train.vloss_weight", id="no-loss"),
        pytest.param({"simulation": {"hidden_size": 30, "num_heads": 4}}, "simulation.hidden_size", id="heads"),
        pytest.param({"simulation": {"vocab_size": 8, "candidates": 9}}, "simulation.candidates", id="candidates"),
        pytest.param({"simulation": {"open_top1": [0.02, 0.9]}}, "simulation.open_top1", id="favourite-not-likeliest"),
        pytest.param({"simulation": {"open_top1": [0.9, 0.5]}}, "simulation.open_top1", id="open-top1-reversed"),
        pytest.param({"refresh": {"min_share": 0}}, "refresh.min_share", id="refresh-share-zero"),
        pytest.param({"refresh": {"min_share": 1.5}}, "refresh.min_share", id="refresh-share-above-one"),
        pytest.param({"refresh": {"max_tokens": 10}}, "refresh.max_tokens", id="refresh-budget-tiny"),
        pytest.param({"refresh": {"margin": -0.1}}, "refresh.margin", id="refresh-margin-negative"),
        pytest.param({"simulation": {"parts_per_step": 0}}, "simulation.parts_per_step", id="parts-zero"),
        pytest.param({"fleet": {"update": "warm"}}, "fleet.update", id="fleet-update"),
        pytest.param({"fleet": {"weight_transfer_backend": "disk"}}, "fleet.weight_transfer_backend",
                     id="weight-transfer-without-command"),
        pytest.param({"fleet": {"driver": "command", "command": "{argv}", "update": "restart",
                                "weight_transfer_backend": "disk"}}, "fleet.weight_transfer_backend",
                     id="weight-transfer-with-restart"),
    ],
)
def test_invalid_values_name_the_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(overrides=overrides)


def test_error_names_every_bad_key() -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_config({"train": {"window_tokens": 0}, "eval": {"num_speculative_tokens": 0}})
    message = str(excinfo.value)
    assert "train.window_tokens" in message
    assert "eval.num_speculative_tokens" in message


@pytest.mark.parametrize(
    ("moved", "new_key"),
    [
        ({"train": {"launcher": "k8s"}}, "train.launcher is now launch.launcher"),
        ({"train": {"warm_idle_s": 60.0}}, "train.warm_idle_s is now launch.warm_idle_s"),
        ({"train": {"k8s": {"image": "x"}}}, "train.k8s is now launch.k8s (its cpu and memory: launch.training.cpu"),
        ({"train": {"nproc_per_node": 8}}, "train.nproc_per_node is now launch.training.nproc"),
        ({"train": {"nnodes": 2}}, "train.nnodes is now launch.training.nnodes"),
        ({"train": {"rdzv_port": 29500}}, "train.rdzv_port is now launch.training.rdzv_port"),
        ({"extract": {"nproc": 2}}, "extract is now launch.extraction"),
        ({"eval": {"nproc": 2}}, "eval.nproc is now launch.evaluation.nproc"),
        ({"eval": {"cpu": "4"}}, "eval.cpu is now launch.evaluation.cpu"),
        ({"eval": {"memory": "8Gi"}}, "eval.memory is now launch.evaluation.memory"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_launch_setting_outside_launch_is_refused_naming_its_key(tmp_path: Path, moved: dict, new_key: str) -> None:
    """A file written for the keys a launch setting had under `train`, `extract` or `eval` is refused with the key
    that holds it now, never loaded with the setting silently at its default."""
    with pytest.raises(ConfigError, match=re.escape(new_key)):
        load_config(write_yaml(tmp_path / "old.yaml", moved))
    with pytest.raises(ConfigError, match=re.escape(new_key)):  # a stage's job carrying the old keys too
        parse_config({**PipelineConfig().model_dump(mode="json"), **moved})


def test_yaml_file_merges_over_defaults(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "cfg.yaml", {"run": "mine", "train": {"epochs": 7}, "eval": {"max_new_tokens": 5}})

    cfg = load_config(path)

    assert cfg.run == "mine"
    assert cfg.train.epochs == 7
    assert cfg.eval.max_new_tokens == 5
    assert cfg.train.window_tokens == 512
    assert cfg.eval.num_speculative_tokens == 4


def test_yaml_file_as_string_path_and_overrides_on_top(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "cfg.yaml", {"train": {"epochs": 7, "seed": 5}})

    cfg = load_config(str(path), overrides={"train": {"epochs": 2}})

    assert cfg.train.epochs == 2
    assert cfg.train.seed == 5


def test_environment_variable_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = write_yaml(tmp_path / "env.yaml", {"run": "from-env"})
    arg_file = write_yaml(tmp_path / "arg.yaml", {"run": "from-arg"})
    monkeypatch.setenv(CONFIG_ENV, str(env_file))

    assert load_config().run == "from-env"
    assert load_config(arg_file).run == "from-arg"


def test_invalid_value_in_yaml_file_names_the_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "cfg.yaml", {"train": {"data_buffer_max_size": -1}})
    with pytest.raises(ConfigError, match=re.escape("train.data_buffer_max_size")):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("- a\n- b\n", "mapping at the top level", id="list"),
        pytest.param("train: [unclosed\n", "cannot read config file", id="bad-yaml"),
    ],
)
def test_unreadable_yaml_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_missing_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("")
    assert load_config(path) == PipelineConfig()


def test_derived_paths(tmp_path: Path) -> None:
    cfg = load_config(overrides={"data_dir": str(tmp_path)})
    assert cfg.data_path == tmp_path
    assert cfg.storage_root == (tmp_path / "store").as_uri()
    assert cfg.tracking_uri == f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    explicit = load_config(overrides={"storage": {"root": "s3://bucket/prefix"}})
    assert explicit.storage_root == "s3://bucket/prefix"


def test_auto_compression_is_fp8_on_object_storage_and_raw_locally() -> None:
    assert load_config().shard_compression == "none"
    assert load_config(overrides={"storage": {"root": "s3://bucket/prefix"}}).shard_compression == "fp8-e4m3"
    chosen = load_config(overrides={"storage": {"root": "s3://bucket/prefix", "compression": "split-zstd"}})
    assert chosen.shard_compression == "split-zstd"


# -- secrets in the configuration --------------------------------------------------------------------------------

SECRET = "Hunter2-7c1e"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        pytest.param("storage.root", f"s3://bucket/store?X-Amz-Signature={SECRET}", id="root-presigned"),
        pytest.param("storage.endpoint_url", f"http://minio:9000/?token={SECRET}", id="endpoint-token"),
        pytest.param("storage.endpoint_url", f"http://minio:9000/#{SECRET}", id="endpoint-fragment"),
        pytest.param("mlflow.tracking_uri", f"http://mlflow:5000/?token={SECRET}", id="mlflow-token"),
        pytest.param("mlflow.tracking_uri", f"postgresql://db/mlflow?sslmode=require&password={SECRET}",
                     id="mlflow-db-password"),
        pytest.param("drafter.warm_start", f"s3://models/specforge?X-Amz-Security-Token={SECRET}", id="warm-start"),
        pytest.param("drafter.warm_start", f"https://ops:{SECRET}@hub/drafter", id="warm-start-userinfo"),
        pytest.param("hidden_states.vllm_path", f"/mnt/vllm/{{step}}?token={SECRET}", id="vllm-path"),
        pytest.param("hidden_states.vllm_path", f"file://ops:{SECRET}@host/vllm/{{step}}", id="vllm-path-userinfo"),
    ],
)
def test_tokens_in_config_values_are_refused_naming_the_key(key: str, value: str, reliability) -> None:
    """A token in a query string, a fragment or user info is refused at load, naming the key and where secrets
    go instead, never the value."""
    reliability.bad_input(f"a token in the config key {key} (query string, fragment or user info)")
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"{re.escape(key)}: .*must not carry") as failure:
        load_config(overrides={section: {name: value}})
    assert SECRET not in str(failure.value)
    assert "come from" in str(failure.value) or "local directory" in str(failure.value) or \
        "MLFLOW_TRACKING_TOKEN" in str(failure.value)


def test_settings_without_secrets_still_load() -> None:
    cfg = load_config(overrides={
        "mlflow": {"tracking_uri": "postgresql://db:5432/mlflow?sslmode=verify-full&connect_timeout=10"},
        "drafter": {"warm_start": "/models/specforge-eagle3"},
        "hidden_states": {"vllm_path": "/mnt/vllm/{step}"},
    })
    assert cfg.mlflow.tracking_uri.endswith("connect_timeout=10")


@pytest.mark.reliability("security", "a config file that is not YAML: the error names the line, never quotes it")
def test_a_yaml_error_names_the_line_without_quoting_it(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(f'mlflow:\n  tracking_uri: "http://mlflow:5000/?token={SECRET}\n  experiment: [\n')
    with pytest.raises(ConfigError, match=r"cannot read config file .*cfg.yaml: not YAML: line \d+") as failure:
        load_config(path)
    assert SECRET not in str(failure.value)
    assert failure.value.__suppress_context__  # a logged traceback does not quote PyYAML's error either
