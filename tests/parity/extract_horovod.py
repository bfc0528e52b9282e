"""Read Horovod's public surface out of its source (no Horovod install needed) into JSON.

    python tests/parity/extract_horovod.py HOROVOD_SRC [--merge tests/parity/horovod_0_28_1.json]

HOROVOD_SRC is a checkout of github.com/horovod/horovod (the directory holding ``horovod/``),
at the tag the data file names.  For each face (``horovod.torch``, ``horovod.tensorflow``,
``horovod.tensorflow.keras``, ...) it lists every public name the face's ``__init__`` binds at
top level (inside ``if``/``try`` blocks too, since Horovod defines names conditionally),
follows ``from horovod... import`` chains and ``name = _basics.name`` aliases to the
definition, and records its kind, parameters with their defaults as source text, the
exceptions its body raises directly, and the first line of its ``Returns:`` docstring section.

The statuses ("same", "differs: ...", "missing: ...") are judgements, not facts of Horovod's
source: ``--merge`` keeps those of an existing data file (and its notes), so the file can be
regenerated without losing them.  The parity test (tests/unit/test_horovod_parity.py) reads
the result.  This script is a maintenance tool: it is not run by the test suite.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

FACES = {
    "torch": "horovod.torch",
    "torch.elastic": "horovod.torch.elastic",
    "tensorflow": "horovod.tensorflow",
    "tensorflow.keras": "horovod.tensorflow.keras",
    "tensorflow.keras.callbacks": "horovod.tensorflow.keras.callbacks",
    "keras": "horovod.keras",
    "keras.callbacks": "horovod.keras.callbacks",
}

# Factories whose result users call methods on: (module, factory) -> the class in that module
# whose public methods the result has (Horovod builds the result's class from its __dict__).
RESULT_CLASSES = {("horovod.torch.optimizer", "DistributedOptimizer"): "_DistributedOptimizer"}

# Wrappers whose own signature is (*args, **kwargs): the signature users see is the target's.
FORWARDS = {"init": ("horovod.common.basics", "HorovodBasics.init"),
            "shutdown": ("horovod.common.basics", "HorovodBasics.shutdown")}


class Source:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, ast.Module] = {}

    def path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.exists():
                return p
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.trees:
            p = self.path(module)
            self.trees[module] = ast.parse(p.read_text()) if p else ast.Module(body=[],
                                                                              type_ignores=[])
        return self.trees[module]

    def is_module(self, module: str) -> bool:
        return self.path(module) is not None


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements executed at import, looking into if/try/with blocks."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + _top_level(node.orelse)
            for h in node.handlers:
                out += _top_level(h.body)
        elif isinstance(node, ast.With):
            out += _top_level(node.body)
        else:
            out.append(node)
    return out


def _bindings(tree: ast.Module) -> dict[str, ast.stmt]:
    """name -> first statement binding it at top level."""
    names: dict[str, ast.stmt] = {}
    for node in _top_level(tree.body):
        targets: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            targets = [node.name]
        elif isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.ImportFrom):
            targets = [a.asname or a.name for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.asname or a.name.split(".")[0] for a in node.names]
        for t in targets:
            names.setdefault(t, node)
    return names


def _params(fn: ast.FunctionDef, drop_self: bool) -> list[str]:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(
        a.defaults)
    out = [p.arg if d is None else f"{p.arg}={ast.unparse(d)}"
           for p, d in zip(positional, defaults)]
    if drop_self and out and out[0] in ("self", "cls"):
        out = out[1:]
    if a.vararg:
        out.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        out.append("*")
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append(p.arg if d is None else f"{p.arg}={ast.unparse(d)}")
    if a.kwarg:
        out.append(f"**{a.kwarg.arg}")
    return out


def _raises(fn: ast.AST) -> list[str]:
    found: list[str] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = ast.unparse(exc)
            if name[:1].isupper() and name not in found:
                found.append(name)
    return found


def _returns(fn: ast.AST) -> str | None:
    doc = ast.get_docstring(fn) if isinstance(fn, (ast.FunctionDef, ast.ClassDef)) else None
    if not doc:
        return None
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() in ("Returns:", "Return:"):
            text = []
            for nxt in lines[i + 1:]:
                if not nxt.strip() or nxt.strip().endswith(":") and not nxt.startswith("    "):
                    break
                text.append(nxt.strip())
            return " ".join(text) or None
    return None


def _function(fn: ast.FunctionDef, where: str, method: bool = False) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": "method" if method else "function", "defined_in": where,
                            "params": _params(fn, drop_self=method)}
    if any(isinstance(d, ast.Name) and d.id == "contextmanager" for d in fn.decorator_list):
        info["contextmanager"] = True
    raises = _raises(fn)
    if raises:
        info["raises"] = raises
    ret = _returns(fn)
    if ret:
        info["returns"] = ret
    return info


def _class(cls: ast.ClassDef, where: str) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": "class", "defined_in": where,
                            "bases": [ast.unparse(b) for b in cls.bases]}
    members: dict[str, Any] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            if node.name == "__init__":
                info["params"] = _params(node, drop_self=True)
                raises = _raises(node)
                if raises:
                    info["raises"] = raises
            elif not node.name.startswith("_"):
                static = any(isinstance(d, ast.Name) and d.id == "staticmethod"
                             for d in node.decorator_list)
                members[node.name] = _function(node, where, method=not static)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and not t.id.startswith("_"):
                    members[t.id] = {"kind": "attribute", "value": ast.unparse(node.value)}
    if members:
        info["members"] = members
    return info


def resolve(src: Source, module: str, name: str, depth: int = 0) -> dict[str, Any]:
    """What ``module.name`` is, followed to its definition inside Horovod."""
    if depth > 20:
        return {"kind": "unknown"}
    if src.is_module(f"{module}.{name}") and name not in _bindings(src.tree(module)):
        return {"kind": "module", "defined_in": f"{module}.{name}"}
    tree = src.tree(module)
    path = src.path(module)
    where = str(path.relative_to(src.root)) if path else module
    node = _bindings(tree).get(name)
    if node is None:
        return {"kind": "unknown", "defined_in": module}
    if isinstance(node, ast.FunctionDef):
        if name in FORWARDS and _params(node, False) == ["*args", "**kwargs"]:
            target_mod, target = FORWARDS[name]
            cls_name, meth = target.split(".")
            cls = _bindings(src.tree(target_mod)).get(cls_name)
            assert isinstance(cls, ast.ClassDef)
            for n in cls.body:
                if isinstance(n, ast.FunctionDef) and n.name == meth:
                    info = _function(n, f"{target_mod.replace('.', '/')}.py", method=True)
                    info["kind"] = "function"
                    return info
        info = _function(node, where)
        result_class = RESULT_CLASSES.get((module, name))
        if result_class is not None:
            cls = _bindings(tree).get(result_class)
            assert isinstance(cls, ast.ClassDef)
            info["members"] = _class(cls, where).get("members", {})
            info["members_are_of"] = "the returned object"
        return info
    if isinstance(node, ast.ClassDef):
        return _class(node, where)
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            base = ".".join(module.split(".")[:-node.level] + ([base] if base else []))
        if not base.startswith("horovod"):
            return {"kind": "external", "defined_in": base}
        for a in node.names:
            if (a.asname or a.name) == name:
                if src.is_module(f"{base}.{a.name}"):
                    return {"kind": "module", "defined_in": f"{base}.{a.name}"}
                return resolve(src, base, a.name, depth + 1)
    if isinstance(node, ast.Import):
        return {"kind": "external"}
    if isinstance(node, ast.Assign):
        value = node.value
        if (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
                and value.value.id == "_basics"):
            cls = _bindings(src.tree("horovod.common.basics")).get("HorovodBasics")
            assert isinstance(cls, ast.ClassDef)
            for n in cls.body:
                if isinstance(n, ast.FunctionDef) and n.name == value.attr:
                    info = _function(n, "horovod/common/basics.py", method=True)
                    info["kind"] = "function"
                    return info
            return {"kind": "constant", "defined_in": "horovod/common/basics.py",
                    "value": f"HorovodBasics.{value.attr}"}
        return {"kind": "value", "defined_in": where, "value": ast.unparse(value)}
    return {"kind": "unknown", "defined_in": where}


def extract(root: Path) -> dict[str, Any]:
    src = Source(root)
    faces: dict[str, Any] = {}
    for face, module in FACES.items():
        names = {}
        for name in sorted(_bindings(src.tree(module))):
            if name.startswith("_"):
                continue
            info = resolve(src, module, name)
            if info["kind"] == "external":
                continue  # tf, keras, os, packaging ...: not Horovod's API
            names[name] = info
        # ``from horovod.torch.mpi_ops import x`` also binds the submodule ``mpi_ops`` on the
        # package: ``hvd.mpi_ops`` works in Horovod, so it is part of what scripts can reach.
        for node in _top_level(src.tree(module).body):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(module + "."):
                sub = node.module[len(module) + 1:].split(".")[0]
                if not sub.startswith("_") and sub not in names:
                    names[sub] = {"kind": "module", "defined_in": f"{module}.{sub}"}
        names = dict(sorted(names.items()))
        faces[face] = {"horovod_module": module, "names": names}
    return faces


def merge(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """Keep the judgements (status, note, mpitrain_module) of an older data file."""
    for face, data in new.items():
        old_face = old.get("faces", {}).get(face, {})
        for key in ("mpitrain_module", "status", "note"):
            if key in old_face:
                data[key] = old_face[key]
        for name, info in data["names"].items():
            previous = old_face.get("names", {}).get(name, {})
            for key in ("status", "note", "members_checked_on", "before_init"):
                if key in previous:
                    info[key] = previous[key]
            for member, minfo in info.get("members", {}).items():
                prev_m = previous.get("members", {}).get(member, {})
                if "status" in prev_m:
                    minfo["status"] = prev_m["status"]
    return new


def dumps(data: Any, indent: int = 0) -> str:
    """JSON with one entry per line and short lists (parameters, raises) kept on one line."""
    pad = " " * indent
    if isinstance(data, dict) and data:
        items = [f'{pad} {json.dumps(k)}: {dumps(v, indent + 1).lstrip()}' for k, v in data.items()]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return pad + json.dumps(data)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("horovod_src", type=Path)
    parser.add_argument("--merge", type=Path, default=None)
    args = parser.parse_args(argv)
    faces = extract(args.horovod_src)
    data: dict[str, Any] = {"horovod_version": "0.28.1",
                            "source": "github.com/horovod/horovod, tag v0.28.1",
                            "faces": faces}
    if args.merge is not None and args.merge.exists():
        old = json.loads(args.merge.read_text())
        data = {**{k: v for k, v in old.items() if k != "faces"}, "faces": merge(faces, old)}
    sys.stdout.write(dumps(data) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
