"""The documentation matches the code: the configuration reference, the code map, the links, the README's length."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([a-z0-9_.]+)` \| `([^`]*)` \|", re.MULTILINE)
CODE_PACKAGES = ("pipeline", "assets", "resources", "jobs", "ops", "demo", "recipes")
CODE_MAP_ENTRY = re.compile(rf"`((?:{'|'.join(CODE_PACKAGES)})/[A-Za-z0-9_/]+\.py|cli\.py|definitions\.py)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _leaves(data: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:  # an empty mapping (e.g. a node selector) is a value
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _section(text: str, heading: str) -> str:
    """The body of a `## heading` section, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def test_every_config_key_is_documented_with_its_default() -> None:
    documented = dict(ROW.findall(CONFIGURATION.read_text()))
    actual = _leaves(load_config().model_dump())
    assert sorted(documented) == sorted(actual), "docs/configuration.md and the config keys differ"
    for key, default in documented.items():
        if default == "[...]":  # a list of mappings: described in words
            continue
        parsed = yaml.safe_load(default) if default != '""' else ""
        code = json.dumps(actual[key])
        assert parsed == actual[key], f"docs/configuration.md says {key} defaults to {default}, the code says {code}"


def test_the_code_map_lists_every_module_and_only_modules_that_exist() -> None:
    listed = set(CODE_MAP_ENTRY.findall(_section(ARCHITECTURE.read_text(), "Code map")))
    modules = {p.relative_to(ROOT).as_posix() for package in CODE_PACKAGES for p in (ROOT / package).rglob("*.py")
               if p.name != "__init__.py"} | {"cli.py", "definitions.py"}
    assert not modules - listed, f"modules missing from the code map: {sorted(modules - listed)}"
    assert not listed - modules, f"the code map lists modules that do not exist: {sorted(listed - modules)}"


def test_the_readme_is_a_front_door() -> None:
    """What it is, the two commands, one diagram, where to go next: a newcomer reads it in five minutes."""
    assert len(README.read_text().splitlines()) <= 150


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL),
                          re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_in_the_docs_point_at_files_and_headings() -> None:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # a URL
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"links to files or headings that do not exist: {broken}"
