"""Which hosts an elastic job may use now: the discovery script, the blacklist, the placement.

``mpitrainrun --host-discovery-script S`` runs ``S`` (a shell command) every few seconds.  It
prints the usable hosts, one per line, as ``host`` or ``host:slots`` (Horovod's format; a bare
host gets ``--slots`` slots).  A host on which a rank failed is blacklisted: never used again,
or, with ``--blacklist-cooldown-range A B``, for a cooldown that starts near A seconds and
doubles with each further failure of that host, capped at B (Horovod's resurrection of
blacklisted hosts).  Placement fills hosts in a stable order: hosts keep their place across
restarts and new ones come last, so the oldest hosts keep the lowest ranks.
"""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .hosts import HostfileError, HostSlots, check_host_name


class DiscoveryError(RuntimeError):
    """The discovery script failed or printed something that is not a host list."""


def parse_discovery_output(text: str, default_slots: int, script: str = "") -> dict[str, int]:
    """``host[:slots]`` lines -> {host: slots}, in the order first listed (blank lines and
    ``#`` comments ignored; a host listed twice keeps its last count)."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, sep, count = line.partition(":")
        try:
            check_host_name(host)
            slots = int(count) if sep else default_slots
        except (HostfileError, ValueError):
            raise DiscoveryError(f"host discovery {script!r}, line {number}: {raw!r} is not "
                                 "'host' or 'host:slots'") from None
        if slots < 1:
            raise DiscoveryError(f"host discovery {script!r}, line {number}: {raw!r} has "
                                 f"{slots} slots; give at least 1")
        hosts[host] = slots
    return hosts


@dataclass
class DiscoveryScript:
    """Runs the user's discovery command (through the shell, as Horovod does)."""

    script: str
    default_slots: int = 1
    timeout_s: float = 30.0

    def find(self) -> dict[str, int]:
        """The hosts and slots the script lists now.

        Raises:
            DiscoveryError: the script failed, timed out, or printed a malformed line.
        """
        try:
            done = subprocess.run(self.script, shell=True, capture_output=True, text=True,
                                  timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"host discovery {self.script!r} did not finish in "
                                 f"{self.timeout_s:g} s") from None
        if done.returncode != 0:
            raise DiscoveryError(f"host discovery {self.script!r} exited with status "
                                 f"{done.returncode}: {done.stderr.strip()[-300:]}")
        return parse_discovery_output(done.stdout, self.default_slots, self.script)


@dataclass
class Blacklist:
    """Hosts on which a rank failed; permanently, or for a growing cooldown.

    Args:
        cooldown: ``(A, B)`` seconds, or None for a permanent blacklist.
        clock: the time source (seconds); injectable for tests.
        jitter: ``f() -> [0, 1)``, spreading the cooldowns of hosts that failed together.
    """

    cooldown: tuple[float, float] | None = None
    clock: Callable[[], float] = time.monotonic
    jitter: Callable[[], float] = random.random
    _until: dict[str, float] = field(default_factory=dict)
    _failures: dict[str, int] = field(default_factory=dict)

    def add(self, host: str) -> float | None:
        """Blacklist ``host`` after a failure; returns its cooldown in seconds (None: for
        good)."""
        count = self._failures[host] = self._failures.get(host, 0) + 1
        if self.cooldown is None:
            self._until[host] = float("inf")
            return None
        low, high = self.cooldown
        delay = min(high, max(low, low * 2 ** (count - 1) + self.jitter() * low))
        self._until[host] = self.clock() + delay
        return delay

    def blocks(self, host: str) -> bool:
        """Whether ``host`` may not be used now."""
        return self.clock() < self._until.get(host, float("-inf"))

    def blocked(self) -> list[str]:
        """The hosts blacklisted now, sorted."""
        return sorted(h for h in self._until if self.blocks(h))


def order_hosts(available: Sequence[str], previous: Sequence[str]) -> list[str]:
    """Hosts in assignment order: those of ``previous`` still available keep their order,
    new ones follow in the order listed."""
    kept = [h for h in previous if h in available]
    return kept + [h for h in available if h not in kept]


def place(hosts: Mapping[str, int], order: Sequence[str], limit: int) -> list[HostSlots]:
    """Fill ``order``'s hosts up to ``limit`` processes (fewer when there are fewer slots)."""
    placed: list[HostSlots] = []
    left = limit
    for host in order:
        if left <= 0:
            break
        take = min(hosts[host], left)
        placed.append(HostSlots(host, take))
        left -= take
    return placed


__all__ = ["Blacklist", "DiscoveryError", "DiscoveryScript", "order_hosts",
           "parse_discovery_output", "place"]
