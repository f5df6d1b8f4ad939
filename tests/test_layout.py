"""The package's structure, checked: the import layers of docs/design.md §2 (no import reaches up a
layer, none forms a cycle, lazy imports included) and the size of functions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "specforge"

LAYERS = {
    "specforge.docgen": 8,
    "specforge.cli": 7,
    "specforge.recipes": 6,
    "specforge.families": 5,
    "specforge.trainer": 4,
    "specforge.serving": 4,
    "specforge.distill": 4,
    "specforge.engine": 3,
    "specforge.engine.cpu": 1,
    "specforge.models": 2,
    "specforge.data": 1,
    "specforge.config": 0,
    "specforge.io": 0,
    "specforge.errors": 0,
    "specforge.distributed": 0,
    "specforge.results": 0,
    "specforge.configs": 0,
    "specforge": 0,
}
"""``scripts -> cli -> recipes -> families -> {trainer, serving, distill} -> engine -> models ->
data -> {config, io, errors, distributed}``: a module imports only from lower layers, or from its
own package (without cycles); ``trainer``, ``serving`` and ``distill`` never import each other.
A draft family (``families/<name>/``) binds a model, an objective, a proposer and an exporter
over the layers below; the recipes reach it through the registry. The
CPU kernels (``engine.cpu``) sit beside ``data``: torch and the lowest layer only, so the
models' loader may prepack with them."""

MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS: dict[str, str] = {}
"""Functions allowed past the limit, with the reason (none today)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


REGISTRY_LEVEL = re.compile(r"specforge\.families(\.\w+\.options)?")
"""The family registry and the families' config sections: torch-free, in the lowest layer
beside the config that composes the sections from them."""


def layer_of(module: str) -> tuple[str, int]:
    """The layer a ``specforge`` module belongs to (the registry's, else the longest matching
    prefix)."""
    if REGISTRY_LEVEL.fullmatch(module):
        return "specforge.families (registry)", 0
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return prefix, LAYERS[prefix]


def imported_modules(path: Path, tree: ast.AST | None = None) -> list[tuple[str, int]]:
    """``(specforge module, line)`` for every import in a file, top-level or inside functions."""
    tree = tree or ast.parse(path.read_text())
    found = []
    package = module_name(path) if path.name == "__init__.py" else module_name(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + (path.name == "__init__.py")]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(base, node.lineno)]
    return [(name, line) for name, line in found if name.split(".")[0] == "specforge"]


def import_graph() -> dict[str, list[tuple[str, int]]]:
    return {module_name(path): imported_modules(path) for path in sorted(PACKAGE.rglob("*.py"))}


def layer_violations(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    problems = []
    for module, imports in graph.items():
        home, level = layer_of(module)
        for name, line in imports:
            other_home, other_level = layer_of(name)
            upward = other_level > level
            sideways = other_level == level and other_home != home and level > 0
            if upward or sideways:
                problems.append(
                    f"{module}:{line} imports {name} ({other_home} is not below {home})"
                )
    return problems


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Import cycles between modules (depth-first search on the module graph)."""
    edges = {
        m: sorted({n for n, _ in imports if n in graph and n != m}) for m, imports in graph.items()
    }
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in edges[node]:
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    return found


def test_imports_follow_the_layers():
    assert layer_violations(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("specforge.data.chat", "from specforge.trainer.ttt import ttt_loss", "imports"),
        ("specforge.models.eagle3", "from specforge.serving import bench", "imports"),
        ("specforge.trainer.ttt", "import specforge.serving.tree", "imports"),
        ("specforge.data.vocab", "def f():\n    from specforge.recipes import train\n", "imports"),
        ("specforge.data.vocab", "from specforge.io import read_jsonl", None),
    ],
)
def test_the_layer_check_catches_a_forbidden_import(tmp_path, module, source, expected):
    """The check itself bites: adding one forbidden import (lazy ones too) is reported."""
    path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    graph = import_graph()
    graph[module] = graph[module] + imported_modules(path, ast.parse(source))
    problems = layer_violations(graph)
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and module in problems[0] and expected in problems[0]


def test_the_cycle_check_catches_a_cycle():
    graph = import_graph()
    conversations = "specforge.data.conversations"  # data.sources imports it
    graph[conversations] = graph[conversations] + [("specforge.data.sources", 1)]
    assert any(conversations in cycle for cycle in cycles(graph))


def long_functions() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                name = f"{module_name(path)}.{node.name}"
                if length > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS:
                    found.append(f"{name}: {length} lines")
    return found


def test_no_function_is_longer_than_the_limit():
    assert long_functions() == []


RUNTIME_MAX_FUNCTION_LINES = 60
"""The runtime (the loop, the policies, the verifier, the stats and every proposer, a family's
included) is read function by function: none is longer than this, docstring included."""


def runtime_files() -> list[Path]:
    serving = PACKAGE / "serving"
    names = ("speculative.py", "drafting.py", "policy.py", "verifier.py", "stats.py")
    return [
        *(serving / name for name in names),
        *sorted((serving / "proposers").glob("*.py")),
        *sorted(PACKAGE.glob("families/*/proposer.py")),
    ]


def test_the_runtime_s_functions_are_short_and_the_loop_holds_no_proposer():
    for path in runtime_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                assert length <= RUNTIME_MAX_FUNCTION_LINES, f"{path.name}:{node.name} {length}"
    runtime = PACKAGE / "serving" / "speculative.py"
    classes = [
        n.name for n in ast.walk(ast.parse(runtime.read_text())) if isinstance(n, ast.ClassDef)
    ]
    assert classes == ["SpeculativeDecoder"]  # no proposer or policy inside the runtime


FAMILY_HOMES = {"dflash": ("dflash",), "peagle": ("peagle", "p-eagle", "PEagle")}
"""A family's folder name and the spellings of its name that only its folder (and the
registry) may use."""


def family_mentions(family: str, spellings: tuple[str, ...]) -> list[str]:
    """The package's modules outside ``families/<family>/`` that name the family, except the
    registry and the generated-docs module (recipes, ``configs/*.yaml``, are documentation that
    runs: a family's recipe names it)."""
    home = PACKAGE / "families" / family
    allowed = {PACKAGE / "families" / "__init__.py", PACKAGE / "docgen.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if home in path.parents or path in allowed:
            continue
        text = path.read_text().lower()
        if any(spelling.lower() in text for spelling in spellings):
            found.append(str(path.relative_to(PACKAGE)))
    return found


@pytest.mark.parametrize("family", ["peagle", "dflash"])
def test_a_family_is_named_only_in_its_folder_and_the_registry(family):
    """Adding a family touches its folder and one registry line: no other module names it."""
    assert family_mentions(family, FAMILY_HOMES[family]) == []


def test_every_registered_family_answers_the_registry():
    """Each registry line names a folder whose record is that family, complete."""
    from specforge.families import REGISTRY, family

    for name in REGISTRY:
        found = family(name)
        assert found.name == name and callable(found.proposer) and callable(found.build)
        assert (PACKAGE / "families" / name / "__init__.py").is_file()


def _dotted(path: Path) -> str:
    """``specforge.x.y`` for a file under any ``specforge`` folder (the package, or a test's)."""
    parts = path.with_suffix("").parts
    parts = parts[len(parts) - 1 - parts[::-1].index("specforge") :]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def context_variables(graph_paths) -> list[str]:
    """``module: name`` for every ``ContextVar`` that a module other than its own reads or
    sets (imports it by name): options crossing layers must be passed explicitly."""
    owners: dict[str, str] = {}
    for path in graph_paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and "ContextVar(" in ast.unparse(node):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    owners[ast.unparse(target)] = _dotted(path)
    crossings = []
    for path in graph_paths:
        source = path.read_text()
        for name, owner in owners.items():
            if _dotted(path) != owner and re.search(rf"\b{name}\b", source):
                crossings.append(f"{_dotted(path)}: {owner}.{name}")
    return crossings


def test_no_context_variable_crosses_a_module():
    assert context_variables(sorted(PACKAGE.rglob("*.py"))) == []


def test_the_context_variable_check_catches_a_crossing(tmp_path):
    package = tmp_path / "specforge"
    (package / "data").mkdir(parents=True)
    owner = "from contextvars import ContextVar\nMODE = ContextVar('m')\n"
    (package / "data" / "a.py").write_text(owner)
    (package / "models").mkdir()
    (package / "models" / "b.py").write_text("from specforge.data.a import MODE\nMODE.get()\n")
    found = context_variables(sorted(package.rglob("*.py")))
    assert found == ["specforge.models.b: specforge.data.a.MODE"]
