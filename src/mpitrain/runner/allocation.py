"""Scheduler allocations as host lists: Slurm node lists, PBS and LSF node files.

A job started inside an allocation should run where the scheduler put it.  This module turns
each scheduler's description of the allocation into :class:`~.hosts.HostSlots`:

* Slurm: ``SLURM_JOB_NODELIST`` (``node[01-04,07],gpu-[1-2]``) with
  ``SLURM_TASKS_PER_NODE`` (``2(x3),1``), else ``SLURM_JOB_CPUS_PER_NODE`` (same syntax);
* PBS/Torque: ``PBS_NODEFILE``, one line per slot;
* LSF: ``LSB_MCPU_HOSTS`` (``hostA 4 hostB 4``), else ``LSB_DJOB_HOSTFILE`` (one line per slot).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .hosts import HostfileError, HostSlots, check_host_name, parse_slot_lines

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostfileError(f"Slurm node list {text!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostfileError(f"Slurm node list {text!r}: unmatched ']' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostfileError(f"Slurm node list {text!r}: unclosed '['")
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str, context: str) -> list[str]:
    """``01-03,7`` -> ['01', '02', '03', '7']: zero padding follows the lower bound."""
    values = []
    for item in body.split(","):
        match = _RANGE_RE.match(item.strip())
        if not match:
            raise HostfileError(f"Slurm node list {context!r}: bad range {item!r} in "
                                f"[{body}]")
        lo_text, hi_text = match.group(1), match.group(2)
        if hi_text is None:
            values.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise HostfileError(f"Slurm node list {context!r}: range {item!r} runs backwards")
        width = len(lo_text) if lo_text.startswith("0") else 0
        values.extend(str(v).zfill(width) for v in range(lo, hi + 1))
    return values


def _expand_one(pattern: str, context: str) -> list[str]:
    """Expand one comma-free pattern; several bracket groups give their product."""
    names = [""]
    rest = pattern
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            names = [n + rest for n in names]
            break
        close_at = rest.index("]", open_at)
        prefix, body = rest[:open_at], rest[open_at + 1:close_at]
        names = [n + prefix + v for n in names for v in _expand_ranges(body, context)]
        rest = rest[close_at + 1:]
    return [check_host_name(n, f"Slurm node list {context!r}") for n in names]


def expand_nodelist(text: str) -> list[str]:
    """Expand a Slurm host list such as ``node[01-04,07],gpu-[1-2]`` into names, in order.

    Raises:
        HostfileError: unbalanced brackets, a bad or backwards range, or an invalid name.
    """
    text = text.strip()
    if not text:
        raise HostfileError("Slurm node list is empty")
    names: list[str] = []
    for part in _split_top_level(text):
        if not part:
            raise HostfileError(f"Slurm node list {text!r}: empty entry (stray comma?)")
        names.extend(_expand_one(part, text))
    return names


def expand_counts(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand Slurm's compressed counts: ``2(x3),1`` -> [2, 2, 2, 1].

    Raises:
        HostfileError: an item is neither ``N`` nor ``N(xK)``.
    """
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _COUNT_RE.match(item.strip())
        if not match:
            raise HostfileError(f"{name}={text!r}: cannot read {item!r} (expected N or N(xK))")
        value, repeat = int(match.group(1)), int(match.group(2) or 1)
        if value < 1 or repeat < 1:
            raise HostfileError(f"{name}={text!r}: {item!r} gives a node no slots")
        counts.extend([value] * repeat)
    return counts


def slurm_hosts(nodelist: str, tasks_per_node: str,
                name: str = "SLURM_TASKS_PER_NODE") -> list[HostSlots]:
    """Pair an expanded node list with expanded per-node counts.

    Raises:
        HostfileError: the two lists differ in length, or either does not parse.
    """
    nodes = expand_nodelist(nodelist)
    counts = expand_counts(tasks_per_node, name)
    if len(nodes) != len(counts):
        raise HostfileError(f"{name}={tasks_per_node!r} gives {len(counts)} counts for the "
                            f"{len(nodes)} nodes of {nodelist!r}")
    return [HostSlots(n, c) for n, c in zip(nodes, counts)]


def lsf_mcpu_hosts(text: str) -> list[HostSlots]:
    """Parse ``LSB_MCPU_HOSTS`` (``hostA 4 hostB 2``).

    Raises:
        HostfileError: an odd number of fields or a count that is not a positive integer.
    """
    fields = text.split()
    if not fields or len(fields) % 2:
        raise HostfileError(f"LSB_MCPU_HOSTS={text!r}: expected pairs of 'host count'")
    hosts = []
    for host, count in zip(fields[::2], fields[1::2]):
        if not count.isdigit() or int(count) < 1:
            raise HostfileError(f"LSB_MCPU_HOSTS={text!r}: bad count {count!r} for {host!r}")
        hosts.append(HostSlots(check_host_name(host, "LSB_MCPU_HOSTS"), int(count)))
    return hosts


def _read_lines(path: str, variable: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().splitlines()
    except OSError as exc:
        raise HostfileError(f"{variable}={path!r} cannot be read: {exc.strerror}") from None


@dataclass(frozen=True)
class Allocation:
    """Where a scheduler put this job: its name and the hosts with their slots."""

    scheduler: str  # "slurm", "pbs" or "lsf"
    hosts: tuple[HostSlots, ...]


def detect(environ: Mapping[str, str] | None = None) -> Allocation | None:
    """Return the allocation this process runs inside, or None outside any scheduler.

    Raises:
        HostfileError: the scheduler's variables are present but do not parse.
    """
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if env.get("SLURM_JOB_ID") and nodelist:
        for var in ("SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE"):
            if env.get(var):
                return Allocation("slurm", tuple(slurm_hosts(nodelist, env[var], var)))
        return Allocation("slurm", tuple(HostSlots(n, 1) for n in expand_nodelist(nodelist)))
    if env.get("PBS_NODEFILE"):
        path = env["PBS_NODEFILE"]
        return Allocation("pbs", tuple(parse_slot_lines(_read_lines(path, "PBS_NODEFILE"),
                                                        path)))
    if env.get("LSB_JOBID"):
        if env.get("LSB_MCPU_HOSTS"):
            return Allocation("lsf", tuple(lsf_mcpu_hosts(env["LSB_MCPU_HOSTS"])))
        if env.get("LSB_DJOB_HOSTFILE"):
            path = env["LSB_DJOB_HOSTFILE"]
            return Allocation("lsf", tuple(parse_slot_lines(
                _read_lines(path, "LSB_DJOB_HOSTFILE"), path)))
    return None
