"""Imports point down (docs/architecture.md, "Layers").

Every module of engine/, graphs/ and profiling/ is parsed (ast, so imports
inside functions and `if TYPE_CHECKING:` blocks count too) and each import of
ours is checked against the layer table below: a module may import its own
layer and the layers under it, never one above, and the library (engine/ and
graphs/) never imports profiling/. `from engine import Name` counts as an
import of the module that defines Name (engine/__init__.py loads most names
lazily, by module path). Also refused: modules that import each other in a
loop, and a `_private` name imported from another module.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "graphs", "profiling")

# Layer -> the layers it may import (itself included). Read bottom to top.
ALLOWED: dict[str, set[str]] = {
    "host": {"host"},  # engine/host/: numpy only, the request side
    "graphs": {"graphs"},  # graphs/: buckets, capture safety, replay; generic
    "ops": {"ops"},  # engine/ops.py, invariance.py, trace.py, cpu_*.py: device ops, the probe, stage ranges, threads, malloc
    "sampling": {"sampling", "host", "ops"},
    "step": {"step", "sampling", "host", "graphs", "ops"},
    "models": {"models", "step", "sampling", "host", "graphs", "ops"},
    "parallel": {"parallel", "step", "sampling", "host", "graphs", "ops"},
    "loop": {"loop", "models", "parallel", "step", "sampling", "host", "graphs", "ops"},
    "llm": {"llm", "loop", "models", "parallel", "step", "sampling", "host", "graphs", "ops"},  # engine/llm/: LLM
    # The package's face (engine/__init__.py), the command line and the profiling kit: everything;
    # the command line is part of the library, so not profiling/.
    "face": {"face", "cli", "llm", "loop", "models", "parallel", "step", "sampling", "host", "graphs", "ops"},
    "cli": {"cli", "face", "llm", "loop", "models", "parallel", "step", "sampling", "host", "graphs", "ops"},
    "profiling": {"profiling", "cli", "face", "llm", "loop", "models", "parallel", "step", "sampling", "host",
                  "graphs", "ops"},
}


def layer_of(module: str) -> str:
    """The layer of a module given by its dotted name."""
    parts = module.split(".")
    if parts[0] in ("graphs", "profiling"):
        return parts[0]
    if module in ("engine", "engine.__init__"):
        return "face"
    if module in ("engine.ops", "engine.invariance", "engine.trace", "engine.cpu_threads", "engine.cpu_memory"):
        return "ops"
    if module == "engine.__main__":
        return "cli"
    if len(parts) > 1 and parts[1] in ("host", "sampling", "step", "models", "parallel", "loop", "llm", "cli"):
        return parts[1]
    raise AssertionError(f"{module}: no layer; add it to tests/test_layers.py (and to docs/architecture.md)")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


@functools.lru_cache(maxsize=None)
def engine_face_names() -> dict[str, str]:
    """engine/__init__.py's names -> the module each comes from."""
    tree = ast.parse((ROOT / "engine" / "__init__.py").read_text())
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = node.module
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            names.update(ast.literal_eval(node.value))
    return names


def imports_of(path: Path, name: str, known: dict[str, Path]) -> list[tuple[int, str, list[str]]]:
    """(line, module imported, names taken) for every import of ours in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    face = engine_face_names()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    found.append((node.lineno, alias.name, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in known:  # `from engine import trace`: the submodule itself
                    found.append((node.lineno, submodule, []))
                elif target == "engine" and alias.name in face:  # `from engine import StepEngine`
                    found.append((node.lineno, face[alias.name], [alias.name]))
                else:
                    found.append((node.lineno, target, [alias.name]))
    return found


@functools.lru_cache(maxsize=None)
def edges() -> list[tuple[str, int, str, list[str]]]:
    known = modules()
    return [(name, line, target, names) for name, path in known.items()
            for line, target, names in imports_of(path, name, known)]


def upward(found: list[tuple[str, int, str, list[str]]]) -> list[str]:
    problems = []
    for name, line, target, _ in found:
        if target == name:
            continue
        source, dest = layer_of(name), layer_of(target)
        if dest not in ALLOWED[source]:
            problems.append(f"{modules()[name].relative_to(ROOT)}:{line}: {name} ({source}) imports {target} ({dest})")
    return problems


def test_every_import_points_down():
    assert upward(edges()) == []


def test_the_library_never_imports_profiling():
    library = [(name, line, target) for name, line, target, _ in edges()
               if name.split(".")[0] in ("engine", "graphs") and target.split(".")[0] == "profiling"]
    assert library == []


def test_no_private_name_is_imported_from_another_module():
    private = [f"{name}:{line} takes {names} from {target}" for name, line, target, names in edges()
               if target != name and any(n.startswith("_") for n in names)]
    assert private == []


def test_no_modules_import_each_other_in_a_loop():
    graph: dict[str, set[str]] = {}
    for name, _, target, _ in edges():
        if target != name and target in modules():
            graph.setdefault(name, set()).add(target)
    loops = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                loops.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert loops == []


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


@pytest.mark.parametrize("source, line", [
    ("engine/host/params.py", "from engine.step.engine_config import EngineConfig"),
    ("graphs/replay.py", "from engine.host.params import SamplingParams"),
    ("engine/sampling/draw.py", "from engine.step.engine_config import EngineConfig"),
    ("engine/models/protocol.py", "from engine.loop.loop_config import LoopConfig"),
    ("engine/step/lm_head.py", "from profiling.bench import _timing"),
    ("engine/host/param_records.py", "from engine import StepEngine"),
])
def test_a_planted_upward_import_is_found(source: str, line: str, tmp_path: Path):
    """The checker itself: one upward import planted in a copy of a module (inside a
    function, as the hidden kind would be) is reported, naming the file."""
    path = ROOT / source
    planted = tmp_path / path.name
    planted.write_text(path.read_text() + f"\n\ndef _planted() -> None:\n    {line}\n")
    name = module_name(path)
    found = [(name, ln, target, names) for ln, target, names in imports_of(planted, name, modules())]
    problems = upward(found)
    assert len(problems) == 1 and source in problems[0], problems


def repeated_base_names(paths: list[Path], root: Path) -> dict[str, list[str]]:
    """Module base names (`__init__` aside) held by more than one file, with their paths."""
    by_name: dict[str, list[str]] = {}
    for path in paths:
        if path.stem != "__init__":
            by_name.setdefault(path.stem, []).append(str(path.relative_to(root)))
    return {name: found for name, found in by_name.items() if len(found) > 1}


def test_every_module_base_name_in_engine_is_said_once():
    """A module's base name says one thing: no two `controls.py` or `verify.py` in engine/."""
    assert repeated_base_names(sorted((ROOT / "engine").rglob("*.py")), ROOT) == {}


def test_the_name_check_finds_a_planted_twin(tmp_path: Path):
    planted = [tmp_path / "step" / "verify.py", tmp_path / "sampling" / "verify.py", tmp_path / "step" / "__init__.py"]
    assert repeated_base_names(planted, tmp_path) == {"verify": ["step/verify.py", "sampling/verify.py"]}


def test_no_library_file_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for folder in ("engine", "graphs") for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
