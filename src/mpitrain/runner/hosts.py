"""Host lists: parse, validate and write hostfiles and Horovod ``-H`` strings.

One parser serves ``mpitrainrun`` and the ``mpitrain-hostfile`` tool.  Four forms are read and
written:

* ``openmpi``: ``node1 slots=4`` (``max_slots=N`` accepted), one line per host;
* ``mpich``: ``node1:4`` (MPICH and Intel MPI machinefiles), one line per host;
* ``horovod``: ``node1:4,node2:4`` on one line, as given to ``horovodrun -H``;
* ``plain``: one line per *slot*, a host repeated once per slot (the form of PBS node files,
  LSF's ``LSB_DJOB_HOSTFILE`` and count-less MPICH machinefiles).  A file of distinct bare
  names is therefore one slot per host.

Reading accepts every line form in any file; ``#`` starts a comment.  A host given a count
(``slots=N`` or ``:N``) must appear on exactly one line: listing it again is a mistake (or the
legacy "each line adds a slot" habit) and is reported with both line numbers.  A host named only
on bare lines gets one slot per line.  Every error is a :class:`HostfileError` (a
``ValueError``) naming the source, the line and the offending token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FORMATS = ("openmpi", "mpich", "horovod", "plain")

# RFC 1123 labels, plus '_' which /etc/hosts and some clusters use anyway; IPv4 fits too.
_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?"
                      r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*$")


class HostfileError(ValueError):
    """A host list that cannot be used, with the place (source and line) it came from."""


@dataclass(frozen=True)
class HostSlots:
    """One host and the number of processes it may run."""

    host: str
    slots: int

    def __post_init__(self) -> None:
        check_host_name(self.host)
        if not isinstance(self.slots, int) or isinstance(self.slots, bool) or self.slots < 1:
            raise HostfileError(f"host {self.host!r}: slots must be an integer >= 1, "
                                f"got {self.slots!r}")


def check_host_name(name: str, where: str = "") -> str:
    """Return ``name`` if it is a usable host name, else raise HostfileError naming it."""
    if not name or len(name) > 253 or not _HOST_RE.match(name):
        prefix = f"{where}: " if where else ""
        raise HostfileError(f"{prefix}{name!r} is not a valid host name (letters, digits, "
                            "'-', '_' and '.' only)")
    return name


def _parse_count(text: str, where: str, host: str) -> int:
    if text == "":
        raise HostfileError(f"{where}: host {host!r} has an empty slot count")
    try:
        value = int(text)
    except ValueError:
        raise HostfileError(f"{where}: host {host!r}: slot count {text!r} is not an "
                            "integer") from None
    if value < 1:
        raise HostfileError(f"{where}: host {host!r} has {value} slots; a host needs at "
                            "least 1 (remove the line to leave it out)")
    return value


def parse_hosts_string(text: str, default_slots: int = 1, source: str = "-H") -> list[HostSlots]:
    """Parse a Horovod ``-H`` string such as ``node1:4,node2:4``.

    Args:
        text: comma-separated ``host[:slots]`` tokens.
        default_slots: slots of a token without ``:slots`` (Horovod's default is 1).
        source: how to name the string in errors.

    Returns:
        The hosts in the order given.

    Raises:
        HostfileError: an empty or malformed token, a zero count, or a repeated host; the
            message quotes the token.
    """
    tokens = text.split(",")
    if not text.strip():
        raise HostfileError(f"{source}: empty host list")
    seen: dict[str, int] = {}
    hosts = []
    for index, raw in enumerate(tokens, start=1):
        token = raw.strip()
        where = f"{source} token {index} {token!r}"
        if not token:
            raise HostfileError(f"{source}: token {index} is empty in {text!r} (stray comma?)")
        name, sep, count = token.partition(":")
        if ":" in count:
            raise HostfileError(f"{where}: expected host or host:slots")
        check_host_name(name, where)
        slots = _parse_count(count, where, name) if sep else default_slots
        if name in seen:
            raise HostfileError(f"{where}: host {name!r} is already token {seen[name]}; give "
                                "it once with its total slot count")
        seen[name] = index
        hosts.append(HostSlots(name, slots))
    return hosts


def _parse_line(body: str, where: str) -> tuple[str, int | None]:
    """Parse one non-empty line (comment stripped): (host, slots or None when bare)."""
    fields = body.split()
    first = fields[0]
    if ":" in first:
        if len(fields) > 1:
            raise HostfileError(f"{where}: unexpected {fields[1]!r} after {first!r}")
        name, _, count = first.partition(":")
        if ":" in count:
            raise HostfileError(f"{where}: {first!r}: expected host:slots")
        check_host_name(name, where)
        return name, _parse_count(count, where, name)
    name = check_host_name(first, where)
    slots: int | None = None
    max_slots: int | None = None
    for field in fields[1:]:
        key, sep, value = field.partition("=")
        if not sep:
            raise HostfileError(f"{where}: unexpected {field!r}; Open MPI lines read "
                                "'host slots=N'")
        if key == "slots":
            slots = _parse_count(value, where, name)
        elif key == "max_slots":
            max_slots = _parse_count(value, where, name)
        else:
            raise HostfileError(f"{where}: unknown key {key!r} (known: slots, max_slots)")
    if max_slots is not None:
        if slots is None:
            slots = max_slots
        elif max_slots < slots:
            raise HostfileError(f"{where}: host {name!r} has max_slots={max_slots} < "
                                f"slots={slots}")
    return name, slots


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[HostSlots]:
    """Parse a hostfile in any of the line forms (see the module docstring).

    Args:
        text: the file's contents.
        source: the file's name, used in errors.

    Returns:
        The hosts in order of first appearance.

    Raises:
        HostfileError: a malformed line, a zero or empty slot count, a host given a count and
            listed again, or a file without hosts; the message has the line number.
    """
    counted: dict[str, tuple[int, int]] = {}  # host -> (slots, line)
    bare: dict[str, list[int]] = {}  # host -> lines
    order: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        where = f"{source}:{number}"
        name, slots = _parse_line(body, where)
        earlier = None
        if name in counted:
            earlier = counted[name][1]
        elif slots is not None and name in bare:
            earlier = bare[name][0]
        if earlier is not None:
            raise HostfileError(f"{where}: host {name!r} is already listed on line {earlier}; "
                                "give each host one line with its total slots")
        if name not in counted and name not in bare:
            order.append(name)
        if slots is None:
            bare.setdefault(name, []).append(number)
        else:
            counted[name] = (slots, number)
    if not order:
        raise HostfileError(f"{source}: no hosts (only blank or comment lines)")
    return [HostSlots(h, counted[h][0] if h in counted else len(bare[h])) for h in order]


def read_hostfile(path: str) -> list[HostSlots]:
    """Read and parse the hostfile at ``path`` (see :func:`parse_hostfile_text`).

    Raises:
        HostfileError: the file cannot be read or does not parse.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise HostfileError(f"cannot read hostfile {path!r}: {exc.strerror}") from None
    return parse_hostfile_text(text, source=path)


def parse_slot_lines(lines: Iterable[str], source: str) -> list[HostSlots]:
    """Count slots in a one-line-per-slot node file (PBS, LSF): repeats add slots.

    Raises:
        HostfileError: a line holds something other than one host name, or there is none.
    """
    counts: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        if len(body.split()) != 1:
            raise HostfileError(f"{source}:{number}: expected one host name, got {body!r}")
        name = check_host_name(body, f"{source}:{number}")
        counts[name] = counts.get(name, 0) + 1
    if not counts:
        raise HostfileError(f"{source}: no hosts")
    return [HostSlots(h, n) for h, n in counts.items()]


def with_slots(hosts: Sequence[HostSlots], slots: int) -> list[HostSlots]:
    """The same hosts, each with ``slots`` slots (``--slots-per-host`` / ``-npernode``)."""
    return [HostSlots(h.host, slots) for h in hosts]


def total_slots(hosts: Sequence[HostSlots]) -> int:
    return sum(h.slots for h in hosts)


def format_hosts(hosts: Sequence[HostSlots], fmt: str) -> str:
    """Write ``hosts`` in one of :data:`FORMATS` (files end with a newline).

    Raises:
        ValueError: ``fmt`` is not a known format.
    """
    if fmt == "openmpi":
        return "".join(f"{h.host} slots={h.slots}\n" for h in hosts)
    if fmt == "mpich":
        return "".join(f"{h.host}:{h.slots}\n" for h in hosts)
    if fmt == "horovod":
        return ",".join(f"{h.host}:{h.slots}" for h in hosts) + "\n"
    if fmt == "plain":
        return "".join(f"{h.host}\n" * h.slots for h in hosts)
    raise ValueError(f"unknown hostfile format {fmt!r}; choose one of {', '.join(FORMATS)}")


def place(np: int, hosts: Sequence[HostSlots]) -> list[HostSlots]:
    """Fill hosts in order, each up to its slots, with ``np`` processes.

    Consecutive ranks land on the same host, so local ranks follow rank order.

    Returns:
        The hosts that receive processes, each with the number it receives.

    Raises:
        ValueError: ``np`` is below 1 or above the total slots (the message says how many
            slots each host has).
    """
    if np < 1:
        raise ValueError(f"-np must be >= 1, got {np}")
    available = total_slots(hosts)
    if np > available:
        listing = ", ".join(f"{h.host}:{h.slots}" for h in hosts)
        raise ValueError(f"-np {np} asks for more processes than the {available} slots of the "
                         f"hosts ({listing}); lower -np, add hosts, or raise their slots")
    placed = []
    left = np
    for h in hosts:
        if left == 0:
            break
        take = min(left, h.slots)
        placed.append(HostSlots(h.host, take))
        left -= take
    return placed
