"""The layering ARCHITECTURE.md promises, checked on the source: who may import whom.

Layers, bottom up (a module may import its own layer and the ones this table allows):

    ground floor   mpitrain.core: config, topology, communicators, binding, dtypes, process
                   sets, errors
    data plane     mpitrain.ops: algorithms over plain buffers (no torch, no engine)
    engine         mpitrain.engine: requests, negotiation, fusion, buckets, the thread
    session        mpitrain.session: init/shutdown, the engine's life, process-set registration
    front door     mpitrain.collectives (with arrays and casts) and mpitrain.compression: the
                   one way to the engine
    adapters       torch/, tensorflow/, keras/, kvstore/, elastic/, the hvd face (face/), ...
    tools          mpitrain.runner: the launcher, which starts no engine

Every import counts, at module level or inside a function, and so does
``importlib.import_module("mpitrain....")`` with a literal name.  None of them may form a cycle
(deferring an import hides a circle from Python, not from the design), and an import inside a
function must say why it is there (a comment on its line or the line above): it defers an
optional or heavy dependency, or MPI's start.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# The floors' folders (ARCHITECTURE.md): the package root holds only the face's __init__, the
# session and Horovod's mxnet path.
GROUND = {"core"}
FRONT_DOOR = {"collectives", "compression"}
ADAPTERS = {"torch", "tensorflow", "keras", "kvstore", "mxnet", "face", "elastic"}

MAY_IMPORT = {
    "ground floor": {"ground floor"},
    "data plane": {"ground floor", "data plane"},
    "engine": {"ground floor", "data plane", "engine"},
    "session": {"ground floor", "engine", "session"},
    "front door": {"ground floor", "engine", "session", "front door"},
    "adapters": {"ground floor", "session", "front door", "adapters"},
    "tools": {"ground floor", "tools"},
}
# Frameworks stay above the front door: the lower floors serve numpy, torch and TF alike.
NO_FRAMEWORKS = {"ground floor", "data plane", "engine", "session"}
FRAMEWORKS = {"torch", "tensorflow", "keras"}
# Module names that once meant two things (issue 14); each must name one module again.
UNIQUE_NAMES = {"collectives", "runtime", "optimizer", "flat_buckets"}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "adapters"  # the package root loads the hvd face
    top = parts[1]
    if top == "ops":
        return "data plane"
    if top == "engine":
        return "engine"
    if top == "session":
        return "session"
    if top == "runner":
        return "tools"
    if top == "horovod_compat":
        # Its package finds the stand-in for the launcher (tools); the stand-in ``horovod``
        # package inside, imported only under that name, is a face like the others.
        return "adapters" if "shim" in parts else "tools"
    if top in GROUND:
        return "ground floor"
    if top in FRONT_DOOR:
        return "front door"
    if top in ADAPTERS:
        return "adapters"
    raise AssertionError(f"{module} is in no layer: add it to tests/unit/test_layering.py "
                         "and ARCHITECTURE.md")


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_under(src: Path) -> dict[str, Path]:
    return {module_name(p, src): p for p in sorted(src.rglob("*.py"))}


MODULES = modules_under(SRC)


def imported_by_name(call: ast.Call) -> str:
    """The module ``importlib.import_module("mpitrain.x")`` names (a literal), else ""."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name != "import_module" or not call.args:
        return ""
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""


class Import:
    def __init__(self, target: str, names: list[str], node: ast.stmt, in_function: bool):
        self.target, self.names, self.node, self.in_function = target, names, node, in_function


def imports_of(module: str, modules: dict[str, Path] = MODULES) -> list[Import]:
    path = modules[module]
    tree = ast.parse(path.read_text())
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[:len(package) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                found.append(Import(target, [a.name for a in child.names], child, in_function))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(alias.name, [], child, in_function))
            elif isinstance(child, ast.Call) and imported_by_name(child) in modules:
                found.append(Import(imported_by_name(child), [], child, in_function))
            visit(child, inside)

    visit(tree, False)
    return found


def mpitrain_targets(imp: Import, modules: dict[str, Path] = MODULES) -> list[str]:
    """The mpitrain modules an import names (``from . import x`` names module ``x``)."""
    if imp.target.split(".")[0] != "mpitrain":
        return []
    out = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in modules]
    if len(out) < len(imp.names) or not imp.names:
        out.append(imp.target)
    return out


def test_every_module_belongs_to_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    layer = layer_of(module)
    wrong = []
    for imp in imports_of(module):
        for target in mpitrain_targets(imp):
            if layer_of(target) not in MAY_IMPORT[layer]:
                wrong.append(f"line {imp.node.lineno}: {target} ({layer_of(target)})")
        framework = layer in NO_FRAMEWORKS and imp.target.split(".")[0] in FRAMEWORKS
        optional = layer == "ground floor" and imp.in_function  # torch, where numpy suffices
        if framework and not optional:
            wrong.append(f"line {imp.node.lineno}: {imp.target} (a framework)")
    assert not wrong, f"{module} ({layer}) may not import: " + "; ".join(wrong)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Who imports whom, every import counted (module level, deferred, by name)."""
    graph = {m: {t for imp in imports_of(m, modules) for t in mpitrain_targets(imp, modules)
                 if t in modules and t != m}
             for m in modules}
    # A submodule importing a name through its own package (``from . import x``) finds the
    # package being built by then: leave those edges out.  A package's ``__init__`` importing
    # its submodules stays in: the package depends on them.
    return {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or []."""
    state: dict[str, int] = {}
    cycle: list[str] = []

    def walk(m: str, path: list[str]) -> bool:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle.extend(path[path.index(t):] + [m, t] if t in path else [m, t])
                return True
            if t not in state and walk(t, path + [m]):
                return True
        state[m] = 2
        return False

    for m in sorted(graph):
        if m not in state and walk(m, []):
            break
    return cycle


def test_no_import_cycle_not_even_through_deferred_imports():
    cycle = find_cycle(import_graph(MODULES))
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_deferred_import_and_an_import_by_name(tmp_path):
    package = tmp_path / "mpitrain"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text(
        "def later():\n    from . import high  # deferred on purpose\n    return high\n")
    (package / "high.py").write_text(
        "import importlib\n\nLOW = importlib.import_module('mpitrain.low')\n")
    modules = modules_under(tmp_path)
    assert find_cycle(import_graph(modules)) in (
        ["mpitrain.high", "mpitrain.low", "mpitrain.high"],
        ["mpitrain.low", "mpitrain.high", "mpitrain.low"])
    (package / "low.py").write_text("def later():\n    return None\n")
    assert find_cycle(import_graph(modules_under(tmp_path))) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_inside_functions_say_why(module):
    lines = MODULES[module].read_text().split("\n")
    silent = [imp.node.lineno for imp in imports_of(module) if imp.in_function
              and "#" not in lines[imp.node.lineno - 1]
              and not lines[imp.node.lineno - 2].strip().startswith("#")]
    assert not silent, (f"{module}: imports inside functions at lines {silent} give no reason; "
                        "move them to the top, or say what they defer")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules(module):
    tree = ast.parse(MODULES[module].read_text())
    module_aliases = set()
    wrong = []
    for imp in imports_of(module):
        for name in imp.names:
            full = f"{imp.target}.{name}"
            if full in MODULES:
                module_aliases.add(name)
            elif (imp.target.startswith("mpitrain") and name.startswith("_")
                  and not name.startswith("__")):
                wrong.append(f"line {imp.node.lineno}: imports {name} from {imp.target}")
        if isinstance(imp.node, ast.ImportFrom):
            for alias in imp.node.names:
                if f"{imp.target}.{alias.name}" in MODULES and alias.asname:
                    module_aliases.add(alias.asname)
                    if len(alias.asname) == 1:
                        wrong.append(f"line {imp.node.lineno}: {alias.name} imported as "
                                     f"{alias.asname}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            wrong.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    assert not wrong, f"{module} reaches into other modules' private names: {wrong}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) == "adapters"))
def test_adapters_leave_fusion_and_the_engine_to_the_layers_below(module):
    tree = ast.parse(MODULES[module].read_text())
    wrong = [f"line {node.lineno}: .{node.attr}" for node in ast.walk(tree)
             if isinstance(node, ast.Attribute)
             and node.attr in {"engine", "fusion_threshold", "shared_empty"}]
    assert not wrong, (f"{module} reaches the engine or sizes buckets itself (ask "
                       f"mpitrain.collectives): {wrong}")


def test_module_names_that_meant_two_things_mean_one():
    for name in UNIQUE_NAMES:
        holders = [m for m, p in MODULES.items()
                   if p.stem == name or (p.name == "__init__.py" and p.parent.name == name)]
        assert len(holders) <= 1, f"{name} names several modules: {holders}"


def test_the_package_root_holds_only_the_face_the_session_and_horovods_mxnet_path():
    """Each floor has its folder (ARCHITECTURE.md); a module left loose in the root hides its."""
    loose = sorted(p.stem for p in (SRC / "mpitrain").glob("*.py"))
    assert loose == ["__init__", "mxnet", "session"], loose
