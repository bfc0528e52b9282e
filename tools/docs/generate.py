"""The documentation's generated parts, made from the sources they describe so they cannot drift.

Each function returns Markdown; the site's build (:mod:`hooks`) puts it where a page says
``<!-- generated: NAME -->``.  ``python tools/docs/generate.py NAME`` prints one.

- ``config-reference``: every variable of ``mpitrain.core.config.VARIABLES`` with its default,
  aliases and meaning, and which settings every rank must share (``config.MUST_AGREE``).
- ``horovod-parity``: Horovod 0.28.1's public names, face by face, as
  ``tests/parity/horovod_0_28_1.json`` records them (the data ``tests/unit/test_horovod_parity.py``
  checks against mpitrain): supported, differs (how), missing (why).
- ``horovodrun-flags``: horovodrun 0.28.1's flags (``tests/parity/horovodrun_0_28_1_flags.json``)
  against what ``mpitrainrun``'s own argument parser accepts.
- ``mpitrainrun-help``: ``mpitrainrun --help``.
- ``torch-api``: the API reference of the hvd face's torch-only names (``_face.TORCH_NAMES``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Callable
from contextlib import redirect_stdout
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARITY = ROOT / "tests" / "parity" / "horovod_0_28_1.json"
HOROVODRUN = ROOT / "tests" / "parity" / "horovodrun_0_28_1_flags.json"


def _cell(text: object) -> str:
    """Text fit for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def config_reference() -> str:
    from mpitrain.core import config

    defaults = {f.name: f.default for f in fields(config.Config)}
    must_agree = set(config.MUST_AGREE)
    lines = ["| variable | default | meaning | Horovod / other names |",
             "| --- | --- | --- | --- |"]
    for var in config.VARIABLES:
        default = defaults[var.field]
        shown = "(none)" if default == "" else repr(default)
        meaning = var.help + (" **Must be the same on every rank.**"
                              if var.field in must_agree else "")
        aliases = ", ".join(f"`{a}`" for a in var.aliases) or ""
        lines.append(f"| `{var.name}` | `{_cell(shown)}` | {_cell(meaning)} | {aliases} |")
    return "\n".join(lines) + "\n"


def _status(entry: dict) -> tuple[str, str]:
    status = entry.get("status", "")
    kind, _, why = status.partition(":")
    return kind.strip(), why.strip()


def horovod_parity() -> str:
    data = json.loads(PARITY.read_text())
    out: list[str] = []
    for spec in data["faces"].values():
        names = spec["names"]
        out.append(f"### `{spec['horovod_module']}` → `{spec['mpitrain_module']}`\n")
        face_kind, face_why = _status(spec)
        if face_kind == "missing":
            out.append(f"**Not provided**: {face_why}.\n")
            continue
        if spec.get("note"):
            out.append(f"{spec['note']}\n")
        groups: dict[str, list[tuple[str, dict]]] = {"same": [], "differs": [], "missing": []}
        for name, entry in sorted(names.items()):
            groups.setdefault(_status(entry)[0], []).append((name, entry))
        same = groups["same"]
        out.append(f"**Supported as in Horovod ({len(same)})**: "
                   + ", ".join(f"`{n}`" for n, _ in same) + ".\n")
        noted = [(n, e) for n, e in same if e.get("note")]
        if noted:
            out.append("Supported, with a note:\n")
            out.append("| name | note |\n| --- | --- |")
            out.extend(f"| `{n}` | {_cell(e['note'])} |" for n, e in noted)
            out.append("")
        for kind, title in (("differs", "Differs"), ("missing", "Missing")):
            rows = groups[kind]
            if not rows:
                continue
            out.append(f"**{title} ({len(rows)})**:\n")
            out.append("| name | how |\n| --- | --- |")
            for name, entry in rows:
                why = _status(entry)[1]
                if entry.get("note"):
                    why += f" ({entry['note']})"
                out.append(f"| `{name}` | {_cell(why)} |")
            out.append("")
    return "\n".join(out)


def _mpitrainrun_options() -> dict[str, argparse.Action]:
    from mpitrain.runner.launch_options import build_parser

    return dict(build_parser()._option_string_actions)  # argparse keeps no public index


def horovodrun_flags() -> str:
    data = json.loads(HOROVODRUN.read_text())
    ours = _mpitrainrun_options()
    lines = ["| horovodrun | mpitrainrun | what it does in mpitrainrun |", "| --- | --- | --- |"]
    for row in data["flags"]:
        flags = row["flags"]
        accepted = [f for f in flags if f in ours]
        theirs = ", ".join(f"`{f}`" for f in flags)
        if not accepted:
            why = "; ".join(row.get("not_accepted", {}).values()) or "not accepted"
            lines.append(f"| {theirs} | not accepted | {_cell(why)} |")
            continue
        action = ours[accepted[0]]
        spelled = ", ".join(f"`{f}`" for f in action.option_strings)
        what = action.help if action.help and action.help != argparse.SUPPRESS else ""
        what = what.replace("%(default)s", str(action.default))
        extra = [f"{f}: {n}" for f, n in row.get("not_accepted", {}).items()]
        if row.get("differs"):
            extra.append(row["differs"])
        if extra:
            what += " (" + "; ".join(extra) + ")"
        lines.append(f"| {theirs} | {spelled} | {_cell(what or row['help'])} |")
    return "\n".join(lines) + "\n"


def mpitrainrun_help() -> str:
    from mpitrain.runner.launch_options import build_parser

    parser = build_parser()
    parser.prog = "mpitrainrun"
    buffer = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: the same text everywhere
    try:
        with redirect_stdout(buffer):
            parser.print_help()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "```text\n" + buffer.getvalue().rstrip() + "\n```\n"


def torch_api() -> str:
    """mkdocstrings blocks for the torch-only names of the hvd face, from ``TORCH_NAMES``."""
    from mpitrain.face.api import TORCH_NAMES

    return "\n".join(f"::: mpitrain.torch.{module}.{name}\n"
                     for name, module in TORCH_NAMES.items())


GENERATORS: dict[str, Callable[[], str]] = {
    "config-reference": config_reference,
    "horovod-parity": horovod_parity,
    "horovodrun-flags": horovodrun_flags,
    "mpitrainrun-help": mpitrainrun_help,
    "torch-api": torch_api,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(GENERATORS))
    args = parser.parse_args(argv)
    sys.stdout.write(GENERATORS[args.name]())
    return 0


if __name__ == "__main__":
    sys.exit(main())
