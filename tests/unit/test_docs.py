"""The README's configuration reference matches the configuration the code accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from pipeline.config import load_config

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| `([a-z0-9_.]+)` \| `([^`]*)` \|", re.MULTILINE)


def _leaves(data: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:  # an empty mapping (e.g. a node selector) is a value
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_every_config_key_is_documented_with_its_default() -> None:
    documented = dict(ROW.findall(README.read_text()))
    actual = _leaves(load_config().model_dump())
    assert sorted(documented) == sorted(actual), "README configuration reference and config keys differ"
    for key, default in documented.items():
        if default == "[...]":  # a list of mappings: described in words
            continue
        parsed = yaml.safe_load(default) if default != '""' else ""
        code = json.dumps(actual[key])
        assert parsed == actual[key], f"README says {key} defaults to {default}, the code says {code}"
