"""The package's import structure: no module imports a top-level script, and module imports form no cycle.

Imports inside functions count too: a cycle hidden in a function is still two modules that cannot be understood,
tested or moved apart. The check reads the source (ast), so it needs no import of JAX.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "transformer_jax"
SCRIPTS = {"train", "evaluate", "benchmarks", "tests", "configs"}


def module_imports() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports (a `from pkg import name` of a submodule
    counts as that submodule), and the top-level names of everything else it imports."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node] & graph.keys()):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_never_imports_a_script():
    offenders = {m: sorted(t for t in targets if t.split(".")[0] in SCRIPTS) for m, targets in module_imports().items()}
    assert not {m: t for m, t in offenders.items() if t}
    # Nor loads one by its file path: the only module loaded by path is a config file, by the one loader.
    loaders = [p.name for p in PACKAGE.rglob("*.py") if "spec_from_file_location" in p.read_text(encoding="utf-8")]
    assert loaders == ["config_files.py"]


def test_module_imports_form_no_cycle():
    assert find_cycle(module_imports()) is None


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "os"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
