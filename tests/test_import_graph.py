"""The import graph of the project's own modules, read from the source: no stage folder imports
another (docs/architecture.md invariant 10), and no module imports itself through others. Every
import counts, also one made inside a function or under TYPE_CHECKING: each is a dependency a
reader has to follow."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO_ROOT

PACKAGES = ("ipc", "services", "supervision", "client", "kernels")
MODULES = ("supervisor", "brigade_cli")
STAGES = ("tokenizer", "scheduler", "gpu_worker", "encoder", "detokenizer", "gateway")
# The crossings made on purpose, each with its reason. With encoder.in_worker the worker of engine
# group 0 serves encoder 0 in its own process (the baseline benchmarks/encoder_bench.py measures the
# encoder stage against), with the encoder stage's own code.
ALLOWED_CROSSINGS = {("services.gpu_worker.__main__", "services.encoder.server")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    paths = [REPO_ROOT / f"{name}.py" for name in MODULES]
    for package in PACKAGES:
        paths += sorted((REPO_ROOT / package).rglob("*.py"))
    return {module_name(p): p for p in paths}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules `path` imports (the longest known prefix of each imported name)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: imports_of(path, name, known) for name, path in modules.items()}


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" and parts[1] in STAGES else None


def test_no_stage_folder_imports_another_and_no_library_imports_a_stage():
    crossings = []
    for module, imported in import_graph().items():
        for target in imported:
            owner, used = stage_of(module), stage_of(target)
            if used is not None and used != owner and (module, target) not in ALLOWED_CROSSINGS:
                crossings.append(f"{module} -> {target}")
    assert crossings == [], "stage folders import only ipc/ and the shared libraries:\n" + "\n".join(
        crossings
    )


def test_there_are_no_import_cycles():
    graph = import_graph()
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state[target] == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif state[target] == 0:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if state[module] == 0:
            visit(module, [module])
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_the_graph_sees_imports_inside_functions_and_type_checking(tmp_path):
    """The checks above can fail: a lazy or type-only import is an edge too."""
    graph = import_graph()
    assert "supervision.ray_stages" in graph["supervision.backends"]
    assert "services.common.text" in graph["services.detokenizer.__main__"]
