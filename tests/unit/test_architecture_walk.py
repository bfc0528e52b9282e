"""ARCHITECTURE.md names the code it walks through; those names must exist.

The walk of one gradient (``file.py: Class.method`` and private helpers such as
``_adjacent_in_place``) went stale once already when a helper was renamed; a newcomer
following it would have searched for a function that was gone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "mpitrain"
TEXT = (ROOT / "ARCHITECTURE.md").read_text()

QUALIFIED = sorted(set(re.findall(r"`([a-z_/]+\.py): ([A-Za-z_][\w.]*)`", TEXT)))
PRIVATE = sorted(set(re.findall(r"`(_[a-z][a-z_]*)`", TEXT)))


def _defined(tree: ast.Module, dotted: str) -> bool:
    """Whether ``dotted`` (``name`` or ``Class.member``) is defined in ``tree``."""
    scope: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


def test_the_walk_names_code():
    assert len(QUALIFIED) >= 20, "the walk's `file.py: name` references were not found"


@pytest.mark.parametrize(("path", "dotted"), QUALIFIED, ids=[f"{p}:{d}" for p, d in QUALIFIED])
def test_each_named_file_defines_the_named_code(path, dotted):
    source = PACKAGE / path
    assert source.is_file(), f"ARCHITECTURE.md names {path}, which is not in src/mpitrain"
    assert _defined(ast.parse(source.read_text()), dotted), \
        f"ARCHITECTURE.md names {path}: {dotted}, which that file does not define"


@pytest.mark.parametrize("name", PRIVATE)
def test_each_named_helper_exists(name):
    pattern = re.compile(rf"^\s*(def|class) {re.escape(name)}\b", re.M)
    assert any(pattern.search(p.read_text()) for p in PACKAGE.rglob("*.py")), \
        f"ARCHITECTURE.md names {name}, which no module of src/mpitrain defines"
