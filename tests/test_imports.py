"""The package's import graph, read from the source with `ast`: no cycles (type-only imports
included, and `from PACKAGE import name` counted as an import of the package's `__init__`, whose
namespace it reads), and the layers import downwards (`scheduler/` decides, it does not drive the
engine)."""

from __future__ import annotations

import ast
from pathlib import Path

import tiered

ROOT = Path(tiered.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The package module an imported name lives in (`tiered.x.y.Name` -> `tiered.x.y`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path) -> set[str]:
    """Every `tiered` module `path` imports: at the top, inside functions and under TYPE_CHECKING."""
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.split(".")[0] == "tiered")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tiered":
            module = node.module or ""
            if module in MODULES and MODULES[module].name == "__init__.py":
                found.add(module)  # the package's namespace is read, so its __init__ runs first
            for a in node.names:
                found.add(f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else _resolve(module))
    found.discard(None)
    found.discard(_module_name(path) if path.is_relative_to(ROOT) else None)
    return {m for m in found if m is not None}


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_walk_sees_the_imports_it_should() -> None:
    assert len(MODULES) > 50 and "tiered.engine.core" in MODULES
    core = {"tiered.scheduler.scheduler", "tiered.engine.executor", "tiered.engine.startup", "tiered.engine.profile"}
    assert core <= GRAPH["tiered.engine.core"]
    assert "tiered.engine" in GRAPH["tiered"]  # in a function: counted
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_from_a_package_import_counts_the_package_init(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from tiered.hybrid.attention import native\nfrom tiered.hybrid.attention.kernels import KERNELS\n"
    )
    assert imports_of(source) == {
        "tiered.hybrid.attention",
        "tiered.hybrid.attention.native",
        "tiered.hybrid.attention.kernels",
    }


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_scheduler_decides_and_never_imports_the_engine_or_the_api() -> None:
    for name, deps in GRAPH.items():
        if name.startswith("tiered.scheduler"):
            runs = ("tiered.engine.core", "tiered.engine.executor", "tiered.engine.startup", "tiered.engine.profile")
            bad = {d for d in deps if d == "tiered.engine" or d.startswith((*runs, "tiered.api"))}
            assert not bad, f"{name} imports {bad}"


def test_no_module_name_appears_twice_and_few_modules_sit_at_the_top() -> None:
    names = [p.name for p in ROOT.rglob("*.py") if p.name != "__init__.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    assert len([p for p in ROOT.glob("*.py") if p.name != "__init__.py"]) <= 5


# The layers, bottom first: a module imports only from its own layer or below (`tiered.cli`,
# `tiered.embedded` and `tiered.logs` sit outside and may use any).
LAYERS = [
    # the types a request goes through; the config tree; the C++ library and the CPU allocator
    ("tiered.request", "tiered.config", "tiered.native", "tiered.allocator"),
    ("tiered.hybrid",),  # the model, its forward and kernels
    ("tiered.offload", "tiered.scheduler"),  # the KV tiers; what runs next
    ("tiered.engine",),  # the step loop, its runners (in-process, pipeline stages)
    ("tiered.api", "tiered.cluster"),  # serving
]


def _layer(module: str) -> int | None:
    for rank, packages in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return rank
    return None


def test_every_import_points_down_the_layers() -> None:
    up = sorted(
        (name, dep)
        for name, deps in GRAPH.items()
        for dep in deps
        if (mine := _layer(name)) is not None and (theirs := _layer(dep)) is not None and theirs > mine
    )
    assert up == [], "imports that point up: " + ", ".join(f"{a} -> {b}" for a, b in up)
    assert _layer("tiered.request.tokens") == 0 and _layer("tiered.engine.pipeline.stage") == 3


def test_the_public_names_resolve_to_the_types_the_engine_takes() -> None:
    """What docs/engine.md's in-process example imports: `tiered.Engine` and the options a request
    is served with (its adapter, priority, objective), from the package itself."""
    import tiered.engine
    from tiered.request.score import RequestOptions, Result, ScoreParams

    assert tiered.RequestOptions is tiered.engine.RequestOptions is RequestOptions
    assert (tiered.Result, tiered.ScoreParams) == (Result, ScoreParams)
    assert tiered.Engine is tiered.engine.Engine and tiered.Engine.__module__ == "tiered.engine.core"
    assert set(tiered.__all__) == {"Engine", "RequestOptions", "Result", "ScoreParams", "__version__"}


def test_the_package_drawing_in_the_docs_is_the_import_graph() -> None:
    """docs/engine.md draws which package imports which; the drawing is the source's graph."""
    layered = [p for packages in LAYERS for p in packages]
    drawn: dict[str, set[str]] = {}
    text = (ROOT.parent / "docs" / "engine.md").read_text()
    for line in text.split("<!-- imports -->")[1].split("<!-- /imports -->")[0].splitlines():
        if line.startswith("tiered."):
            name, _, deps = line.partition("->")
            drawn[name.strip()] = {f"tiered.{d.strip()}" for d in deps.split(",") if d.strip()}
    found: dict[str, set[str]] = {p: set() for p in layered}
    for name, deps in GRAPH.items():
        package = ".".join(name.split(".")[:2])
        if package in found:
            found[package] |= {d for dep in deps if (d := ".".join(dep.split(".")[:2])) in found and d != package}
    assert drawn == found
