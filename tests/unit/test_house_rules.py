"""The house's rules, read off the product's source: the domain core imports no Dagster, nothing imports Dagster's
private API (a minor release may move it), and every function and module stays small enough to read in a sitting."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("pipeline", "assets", "resources", "jobs", "ops", "demo", "recipes", "benchmarks", "deploy")
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 600


def _modules() -> dict[str, ast.Module]:
    files = [p for package in PRODUCT for p in (ROOT / package).rglob("*.py")]
    files += [ROOT / "cli.py", ROOT / "definitions.py"]
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(), str(p)) for p in files}


def _imported(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_private_dagster_api_and_no_dagster_in_the_domain_core() -> None:
    modules = _modules()
    private = {path: sorted(n for n in _imported(tree) if n.startswith("dagster._"))
               for path, tree in modules.items()}
    private = {p: n for p, n in private.items() if n}
    assert not private, f"Dagster's private API imported: {private}"
    # The launched workers speak Pipes (dagster_pipes), which is not Dagster.
    core = {path: sorted(n for n in _imported(tree) if n == "dagster" or n.startswith("dagster."))
            for path, tree in modules.items() if path.startswith("pipeline/")}
    core = {p: n for p, n in core.items() if n}
    assert not core, f"pipeline/ imports Dagster: {core}"


def test_the_real_serving_path_does_not_import_the_stand_in() -> None:
    # The stand-in replica (pipeline/serving/standin/) imports the fleet's code, never the other way: the `standin`
    # driver starts it as a process (`python -m pipeline.serving.standin.replica`), so vLLM's path holds none of it.
    standin = "pipeline.serving.standin"
    leaks = {path: sorted(n for n in _imported(tree) if n == standin or n.startswith(f"{standin}."))
             for path, tree in _modules().items()
             if path.startswith("pipeline/") and not path.startswith("pipeline/serving/standin/")}
    leaks = {p: n for p, n in leaks.items() if n}
    assert not leaks, f"pipeline/ imports the stand-in replica: {leaks}"


def test_no_function_over_80_lines_and_no_module_over_600() -> None:
    modules = _modules()
    long_functions = {f"{path}:{node.name}": node.end_lineno - node.lineno + 1
                      for path, tree in modules.items() for node in ast.walk(tree)
                      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                      and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
    long_modules = {path: n for path in modules if (n := len((ROOT / path).read_text().splitlines()))
                    > MAX_MODULE_LINES}
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
