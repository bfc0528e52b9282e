"""Horovod 0.28.1's public API, name by name, against mpitrain's faces (issue 13).

tests/parity/horovod_0_28_1.json lists every public name of Horovod's torch, TensorFlow and
Keras faces (read from Horovod's source by tests/parity/extract_horovod.py) with a status:

- ``same``: the name exists and a call written for Horovod works: parameters named and ordered
  as Horovod's, extra ones trailing with defaults, Horovod's defaults equal (see
  tests/parity/compat.py); members of classes (and of DistributedOptimizer's result) alike.
- ``differs: <reason>``: the name exists; its signature or behaviour differs, for the reason.
- ``missing: <reason or issue>``: the name does not exist.  The test checks that too, so
  whoever adds the name is told to change its status here.

Faces import without ``init()``, so none of this needs MPI.  Behaviours (what a call does) are
checked under MPI in tests/mpi/test_horovod_parity.py and the other MPI suites.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from parity.compat import signature_problems

import mpitrain

pytestmark = pytest.mark.timeout(300)

DATA_FILE = Path(__file__).resolve().parents[1] / "parity" / "horovod_0_28_1.json"
DATA = json.loads(DATA_FILE.read_text())
FACES: dict[str, Any] = DATA["faces"]
STATUS = re.compile(r"^(same|(differs|missing): \S.{8,})$")


def _face_missing(face: str) -> bool:
    return str(FACES[face].get("status", "same")).startswith("missing")


def _module(face: str) -> ModuleType:
    name = FACES[face]["mpitrain_module"]
    if name.startswith("mpitrain.tensorflow"):
        pytest.importorskip("tensorflow")
    return importlib.import_module(name)


def _present(module: ModuleType, name: str, kind: str) -> bool:
    if kind == "module":
        try:
            importlib.import_module(f"{module.__name__}.{name}")
        except ModuleNotFoundError:
            return False
        return True
    return hasattr(module, name)


def _flip(where: str) -> str:
    return (f"mpitrain now has {where}: set its status in {DATA_FILE.name} to 'same' (or "
            f"'differs: <why>') so the parity test checks it")


def _target(module: ModuleType, obj: Any, info: dict[str, Any]) -> Any:
    """What the members of an entry are looked up on: the object, or the one the data names."""
    path = info.get("members_checked_on")
    if path is None:
        return obj
    if path.startswith("mpitrain."):
        mod, _, attr = path.rpartition(".")
        return getattr(importlib.import_module(mod), attr)
    return getattr(module, path)


def _member_problems(module: ModuleType, obj: Any, info: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    if not info.get("members"):
        return problems
    target = _target(module, obj, info)
    for member, m in info["members"].items():
        status = m.get("status", "same")
        present = hasattr(target, member)
        if status.startswith("missing"):
            if present:
                problems.append(_flip(f"the member {member}"))
            continue
        if not present:
            problems.append(f"member {member} is missing")
            continue
        if status == "same" and m.get("params") is not None:
            method = inspect.isclass(target) and m["kind"] == "method"
            problems += [f"{member}: {p}" for p in signature_problems(
                getattr(target, member), m["params"], module, method=method)]
    return problems


def _before_init(obj: Any, expected: str) -> None:
    assert not mpitrain.is_initialized()
    args = ["/nonexistent/parity-timeline.json"] * sum(
        p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
        for p in inspect.signature(obj).parameters.values())
    if expected == "raises ValueError":
        with pytest.raises(ValueError):
            obj(*args)
    elif expected == "returns False":
        assert obj(*args) is False
    elif expected == "returns a bool":
        assert isinstance(obj(*args), bool)
    else:
        raise AssertionError(f"unknown before_init expectation {expected!r}")


CASES = [pytest.param(face, name, id=f"{face}:{name}")
         for face, data in FACES.items() if not _face_missing(face)
         for name in data["names"]]


@pytest.mark.parametrize(("face", "name"), CASES)
def test_horovod_name(face: str, name: str) -> None:
    info = FACES[face]["names"][name]
    status = info["status"]
    assert STATUS.match(status), f"status {status!r}: 'same', 'differs: why' or 'missing: why'"
    module = _module(face)
    present = _present(module, name, info["kind"])
    if status.startswith("missing"):
        assert not present, _flip(f"{face}.{name}")
        return
    assert present, f"{module.__name__}.{name} does not exist ({status})"
    if status != "same" or info["kind"] == "module":
        return
    obj = getattr(module, name)
    problems = []
    if info.get("params") is not None:
        problems += signature_problems(obj, info["params"], module)
    problems += _member_problems(module, obj, info)
    assert not problems, (f"{module.__name__}.{name} is not Horovod's "
                          f"{FACES[face]['horovod_module']}.{name}{tuple(info.get('params', ()))}"
                          f": {problems}")
    if "before_init" in info:
        _before_init(obj, info["before_init"])


@pytest.mark.parametrize("face", [f for f in FACES if _face_missing(f)])
def test_a_face_listed_missing_is_absent(face: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(FACES[face]["mpitrain_module"])
    for info in FACES[face]["names"].values():
        assert info["status"].startswith("missing")


TORCH_NAMES = [name for name, info in FACES["torch"]["names"].items()
               if info["kind"] != "module" and not info["status"].startswith("missing")]


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_the_top_level_face_is_the_torch_face(name: str) -> None:
    # ``import mpitrain as hvd`` and ``import mpitrain.torch as hvd`` must be the same API,
    # and ``from mpitrain import *`` must bring every Horovod name the torch face offers.
    import mpitrain.torch

    assert getattr(mpitrain, name) is getattr(mpitrain.torch, name)
    assert name in mpitrain.__all__


def test_the_data_covers_the_faces_issue_13_names() -> None:
    assert DATA["horovod_version"] == "0.28.1"
    assert {"torch", "tensorflow", "tensorflow.keras", "tensorflow.keras.callbacks"} <= set(FACES)
    torch_names = set(FACES["torch"]["names"])
    assert {"allreduce", "DistributedOptimizer", "ccl_built", "sparse_allreduce_async",
            "broadcast_optimizer_state", "SyncBatchNorm", "elastic"} <= torch_names
