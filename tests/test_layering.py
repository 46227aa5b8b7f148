"""The package's import structure: one order between its packages, no module importing a top-level script, no
cycle between modules, and one convention for command lines.

Imports inside functions count too: a dependency hidden in a function is still a dependency. The checks read the
source (ast), so they need no import of JAX.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "transformer_jax"
SCRIPTS = {"train", "evaluate", "benchmarks", "tests", "configs"}

# The packages (and top-level modules) of transformer_jax, in order: each may import those of earlier layers,
# never those of its own layer or a later one. training receives validation BLEU as a function
# (evaluation.translate.bleu_evaluator), so it imports neither decoding nor evaluation; explain draws with visualize.
LAYERS = [
    {"errors"},
    {"runtime"},
    {"sharding"},
    {"ops"},
    {"config"},
    {"cli"},
    {"model"},
    {"data"},
    {"training", "decoding"},
    {"evaluation"},
    {"interop"},
    {"convert", "export", "visualize", "sweep", "plan", "translate_corpus"},
    {"explain"},
]


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


def unit(module: str) -> str | None:
    """The package or top-level module of transformer_jax that `module` belongs to (None: outside, or the root)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "transformer_jax" and len(parts) > 1 else None


def layering_violations(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """'a -> b' for every import of a unit of the same or a later layer; 'a: in no layer' for an unlisted unit."""
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    out = []
    for module, targets in sorted(graph.items()):
        source = unit(module)
        if source is None:
            continue
        if source not in rank:
            out.append(f"{module}: {source} is in no layer; add it to LAYERS where its imports allow")
            continue
        for target in sorted(targets):
            other = unit(target)
            if other is None or other == source:
                continue
            if other not in rank or rank[other] >= rank[source]:
                out.append(f"{module} -> {target}")
    return out


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


def test_packages_import_only_earlier_layers():
    assert layering_violations(module_imports(), LAYERS) == []


def test_the_layering_check_finds_an_import_upwards_and_between_peers():
    graph = {
        "transformer_jax.training.loop": {"transformer_jax.evaluation.translate", "transformer_jax.model", "jax"},
        "transformer_jax.evaluation.translate": {"transformer_jax.training.step", "transformer_jax.evaluation.run"},
        "transformer_jax.sweep.runner": {"transformer_jax.export.ctranslate2"},
        "transformer_jax.new_thing": set(),
    }
    assert layering_violations(graph, LAYERS) == [
        "transformer_jax.new_thing: new_thing is in no layer; add it to LAYERS where its imports allow",
        "transformer_jax.sweep.runner -> transformer_jax.export.ctranslate2",
        "transformer_jax.training.loop -> transformer_jax.evaluation.translate",
    ]


def test_the_package_never_imports_a_script():
    offenders = {m: sorted(t for t in targets if t.split(".")[0] in SCRIPTS) for m, targets in module_imports().items()}
    assert not {m: t for m, t in offenders.items() if t}
    # Nor loads one by its file path: the only module loaded by path is a config file, by the one loader.
    loaders = [p.name for p in PACKAGE.rglob("*.py") if "spec_from_file_location" in p.read_text(encoding="utf-8")]
    assert loaders == ["cli.py"]


def test_module_imports_form_no_cycle():
    assert find_cycle(module_imports()) is None


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "os"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_command_line_is_a_main_module_of_the_package_it_drives():
    """One convention: `python -m transformer_jax.<package>` runs <package>/__main__.py, which holds flags and
    main only. data.prepare is the one named command: `python -m transformer_jax.data` would not say what it does."""
    commands = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if '__name__ == "__main__"' in p.read_text(encoding="utf-8")
    )
    assert commands == [
        "convert/__main__.py",
        "data/prepare.py",
        "evaluation/__main__.py",
        "explain/__main__.py",
        "export/__main__.py",
        "sweep/__main__.py",
        "translate_corpus/__main__.py",
        "visualize/__main__.py",
    ]
    commands = {"convert", "explain", "export", "visualize", "sweep"}
    assert not [p.name for p in PACKAGE.glob("*.py") if p.stem in commands]


# The one function allowed jax's private API: --plan's per-module cost analysis, which jax exposes nowhere else
# (its docstring says so). Every other module and function uses public jax only, so that a jax upgrade breaks
# loudly or not at all.
PRIVATE_JAX_ALLOWED = {"transformer_jax.plan.accelerators.hlo_module_cost_from_private_jax"}


def private_jax_imports() -> set[str]:
    """'module.function' (or 'module' at its top level) of every import of jax._src in the package."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for top in ast.parse(path.read_text(encoding="utf-8")).body:
            for node in ast.walk(top):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [f"{node.module}.{a.name}" for a in node.names]
                if any(n.startswith("jax._src") for n in names):
                    found.add(f"{module}.{top.name}" if isinstance(top, ast.FunctionDef) else module)
    return found


def test_only_one_plan_function_imports_jax_private_modules():
    private = private_jax_imports()
    assert private <= PRIVATE_JAX_ALLOWED, private - PRIVATE_JAX_ALLOWED


PROCESS_HOOKS = {("sys", "excepthook"), ("sys", "unraisablehook"), ("threading", "excepthook")}


def test_no_library_module_replaces_a_process_wide_hook():
    """A library call must not change how the whole process reports errors (a hook kept after a failure would
    drop later errors of any thread), nor may the command lines."""
    assigned = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) > 1:
                obj, attr = node.args[0], node.args[1]
                if (
                    isinstance(obj, ast.Name)
                    and isinstance(attr, ast.Constant)
                    and (obj.id, attr.value) in PROCESS_HOOKS
                ):
                    assigned.append(f"{path.name}:{node.lineno}")
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                        if (t.value.id, t.attr) in PROCESS_HOOKS:
                            assigned.append(f"{path.name}:{t.value.id}.{t.attr}")
    assert assigned == [], assigned
