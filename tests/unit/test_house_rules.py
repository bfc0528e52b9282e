"""The house rules a reader relies on (issue 39): small files, short parameter lists below.

A file over 400 lines holds more than one idea; a function of the data plane or the engine
that takes more than six parameters is passing a bundle down that should be one value
(``ops.Reduction``, ``engine.header.Header``).  Each test names what breaks the rule.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "mpitrain"
MAX_LINES = 400
MAX_PARAMETERS = 6
LOWER_FLOORS = ("ops", "engine")


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    count = len(names) + (args.vararg is not None) + (args.kwarg is not None)
    return count - (1 if names and names[0] in ("self", "cls") else 0)


def _is_device_kernel(path: Path, node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """CUDA kernels (``ops/cuda``, compiled by numba): their launch takes raw arguments."""
    return "cuda" in path.relative_to(SRC).parts and node.name == "kernel"


def test_no_file_is_over_400_lines():
    long = [f"{p.relative_to(SRC)}: {n} lines" for p in sorted(SRC.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, long


def test_no_function_of_the_data_plane_or_engine_takes_more_than_six_parameters():
    many = []
    for floor in LOWER_FLOORS:
        for path in sorted((SRC / floor).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and _parameters(node) > MAX_PARAMETERS
                        and not _is_device_kernel(path, node)):
                    many.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} "
                                f"({_parameters(node)})")
    assert not many, many


def test_the_parameter_count_leaves_out_self_and_counts_the_rest():
    tree = ast.parse("class C:\n def f(self, a, b, *c, d, **e): pass\ndef g(a, /, b): pass\n")
    counts = {n.name: _parameters(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert counts == {"f": 5, "g": 2}
