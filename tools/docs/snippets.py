"""The code blocks of the documentation, and what CI does with each (standard library only).

Every fenced ``python`` block in README.md and docs/ must compile.  Shell blocks (``bash``) of
the pages a new user pastes from (:data:`PASTED`: README.md and the getting-started page) are
run as pasted, in order, one shell per page.  A block can say otherwise with an HTML comment
(invisible on the site) on the line just before its fence:

    <!-- test: skip REASON -->     a shell block that is not run here, and why (Slurm, a GPU,
                                   another host, a network CI cannot reach)
    <!-- test: run -->             a python block that runs as a program, alone (a world of one)
    <!-- test: run np=2 -->        a python block that runs under ``mpitrainrun -np 2``

``python tools/docs/snippets.py command README.md 1`` prints the README's command 1 (the line
after ``# 1.`` in its first shell block), which ``scripts/test.sh`` runs as pasted.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PASTED = ("README.md", "docs/getting-started.md")
SHELLS = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_MARKER = re.compile(r"<!--\s*test:\s*(skip|run)\b\s*(.*?)\s*-->")


@dataclass
class Block:
    """One fenced code block."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    action: str | None = None  # "skip" or "run", from a marker on the line before
    argument: str = ""  # the skip's reason, or the run's "np=N"

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def np(self) -> int:
        match = re.search(r"np=(\d+)", self.argument)
        return int(match.group(1)) if match else 1


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, indentation (list items) removed."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opened = _FENCE.match(lines[index])
        if not opened:
            index += 1
            continue
        indent, fence, lang = opened.groups()
        start = index
        body: list[str] = []
        index += 1
        while index < len(lines) and not lines[index].strip().startswith(fence):
            line = lines[index]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            index += 1
        index += 1
        marker = _MARKER.search(lines[start - 1]) if start > 0 else None
        found.append(Block(path, start + 1, lang.lower(), "\n".join(body) + "\n",
                           marker.group(1) if marker else None,
                           marker.group(2) if marker else ""))
    return found


def documentation_files() -> list[Path]:
    """Every Markdown file the site or the repository's front shows."""
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md",
            *sorted((ROOT / "docs").rglob("*.md"))]


def readme_command(number: int) -> str:
    """The README's command ``number``: the line after ``# N.`` in its first shell block."""
    for block in blocks(ROOT / "README.md"):
        lines = block.text.splitlines()
        for at, line in enumerate(lines):
            if block.lang in SHELLS and line.startswith(f"# {number}.") and at + 1 < len(lines):
                return lines[at + 1]
    raise LookupError(f"README.md has no shell block with a '# {number}.' line")


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "command" and argv[1] == "README.md":
        print(readme_command(int(argv[2])))
        return 0
    print("usage: snippets.py command README.md N", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
