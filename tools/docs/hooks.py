"""MkDocs hooks: the site's generated parts, made from the repository on every build.

- ``architecture.md`` and ``changelog.md`` are ARCHITECTURE.md and CHANGELOG.md themselves;
- ``images/<plot>.svg`` are drawn by ``benchmarks/plots.py`` from ``benchmarks/results``;
- in any page, ``<!-- generated: NAME -->`` becomes :mod:`generate`'s NAME (the configuration
  reference, the Horovod parity tables, the horovodrun flag table, ``mpitrainrun --help``), and
  ``<!-- generated: plot NAME -->`` the plot with a caption naming the run it shows.

Nothing generated is written into the source tree, so nothing can go stale there.
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from mkdocs.structure.files import File, Files

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import generate  # noqa: E402 - a sibling module, found through the path just added

INCLUDED = {"architecture.md": "ARCHITECTURE.md", "changelog.md": "CHANGELOG.md"}
MARKER = re.compile(r"<!-- generated: ([a-z0-9-]+)(?: ([a-z0-9-]+))? -->")
_svgs: dict[str, bytes] = {}  # drawn once per process (mkdocs serve rebuilds often)


def _plots() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mpitrain_plots",
                                                  ROOT / "benchmarks" / "plots.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: Any) -> Files:
    for uri, source in INCLUDED.items():
        files.append(File.generated(config, uri, content=(ROOT / source).read_text()))
    if not _svgs:
        _svgs.update(_plots().render())
    for name, svg in _svgs.items():
        files.append(File.generated(config, f"images/{name}.svg", content=svg))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    here = posixpath.dirname(page.file.src_uri)

    def expand(match: re.Match[str]) -> str:
        name, argument = match.group(1), match.group(2)
        if name == "plot":
            if argument not in _svgs:
                raise ValueError(f"{page.file.src_uri}: no plot named {argument!r}")
            image = posixpath.relpath(f"images/{argument}.svg", here or ".")
            return f"![{argument}]({image})\n\n{_plots().caption(argument)}\n"
        if name not in generate.GENERATORS:
            raise ValueError(f"{page.file.src_uri}: nothing generates {name!r}")
        return generate.GENERATORS[name]()

    return MARKER.sub(expand, markdown)
