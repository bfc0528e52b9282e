"""``mpitrainrun``'s rendezvous options, in torchrun's spelling, and their checks.

``--nnodes N --nproc-per-node K --rdzv-endpoint HOST:PORT`` (with ``--rdzv-id``,
``--node-rank``, ``--rdzv-timeout``, and torchrun's ``--rdzv-backend c10d`` and ``--rdzv-conf``
accepted) turn ``mpitrainrun`` into a node agent, started once on every node by a scheduler
that has no MPI launcher (:mod:`.rdzv_launch`).  Each flag also has its underscore form
(``--nproc_per_node``), so a torchrun task line changes only in its program name.
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass

from .arg_numbers import bounded, nonneg_int, pos_int
from .rdzv_link import DEFAULT_HEARTBEAT_TIMEOUT_S

DEFAULT_PORT = 29400  # torchrun's
DEFAULT_TIMEOUT_S = 600.0  # torchrun's c10d join timeout
DEFAULT_ID = "none"  # torchrun's
# --rdzv-conf keys: torchrun's join_timeout and is_host, and our heartbeat timeout.
CONF_KEYS = ("join_timeout", "is_host", "heartbeat_timeout")

# (dest, flag) of every rendezvous option, for "X needs --rdzv-endpoint" messages.
_FLAGS = (("nnodes", "--nnodes"), ("nproc_per_node", "--nproc-per-node"),
          ("rdzv_id", "--rdzv-id"), ("node_rank", "--node-rank"),
          ("rdzv_timeout", "--rdzv-timeout"), ("local_addr", "--local-addr"),
          ("rdzv_backend", "--rdzv-backend"),
          ("rdzv_conf", "--rdzv-conf"))
# Options of the launch with a host list that a rendezvous decides itself.
_EXCLUSIVE = (("np", "-np", "the rendezvous starts --nnodes x --nproc-per-node processes"),
              ("hosts", "-H", "the nodes are those whose agents come to the rendezvous"),
              ("hostfile", "--hostfile",
               "the nodes are those whose agents come to the rendezvous"),
              ("npernode", "-npernode", "give --nproc-per-node"),
              ("host_discovery_script", "--host-discovery-script",
               "a running MPI job cannot take in new nodes"),
              ("elastic_restart", "--elastic-restart",
               "the agents of a failed job have exited; the scheduler restarts the task"),
              ("ssh_port", "-p/--ssh-port", "the daemons start through the agents, not ssh"),
              ("ssh_identity_file", "-i/--ssh-identity-file",
               "the daemons start through the agents, not ssh"))


# torchrun's timeouts: a wait of no time would fail every join at once.
_seconds = bounded(float, "a number of seconds", 0.0, strict=True, unit=" seconds")


def _nnodes(text: str) -> int:
    if ":" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r}: torchrun's MIN:MAX node range does not apply, an MPI job's size is "
            "fixed when it starts; give the number of nodes")
    return pos_int(text)


def _nproc(text: str) -> int:
    if text in ("gpu", "cpu", "auto", "xpu"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give the number of processes per node (torchrun's {text!r} is not "
            "read here)")
    return pos_int(text)


def add_rendezvous_options(parser: argparse.ArgumentParser) -> None:
    """Add the rendezvous group to ``mpitrainrun``'s parser."""
    group = parser.add_argument_group(
        "rendezvous: where there is no MPI launcher (no ssh between nodes, no PMI), start "
        "'mpitrainrun --nnodes N --nproc-per-node K --rdzv-endpoint HOST:PORT train.py' once "
        "on every node; the agents meet at the endpoint and start one MPI job across them "
        "(torchrun's spelling; the _ forms such as --nproc_per_node work too).  Set "
        "MPITRAIN_RDZV_SECRET to the same value on every node so that only they can join or "
        "serve it; see docs/guide/rendezvous.md")
    group.add_argument("--nnodes", type=_nnodes, metavar="N",
                       help="number of nodes, each running this same command")
    group.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                       type=_nproc, metavar="K", help="processes (ranks) on this node")
    group.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                       metavar="HOST[:PORT]",
                       help=f"where the agents meet (port {DEFAULT_PORT} if left out): the "
                            "agent on the machine that owns HOST's address (or the one with "
                            "--node-rank 0) serves it and runs the MPI launcher")
    group.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", metavar="ID",
                       help=f"the job's id, the same on all its nodes (default {DEFAULT_ID!r}): "
                            "an agent of another id at the same endpoint is turned away")
    group.add_argument("--node-rank", "--node_rank", dest="node_rank", type=nonneg_int,
                       metavar="R", help="this node's rank, 0..N-1 (default: the serving node "
                                         "is 0, the others follow by host name)")
    group.add_argument("--rdzv-timeout", "--rdzv_timeout", dest="rdzv_timeout", type=_seconds,
                       metavar="S", help="give up when not all N agents have come within S "
                                         f"seconds of this one's start (default "
                                         f"{DEFAULT_TIMEOUT_S:g})")
    group.add_argument("--local-addr", "--local_addr", dest="local_addr", metavar="ADDR",
                       help="this node's address for the job (default: the one its route to "
                            "the endpoint uses); on a node with several networks, pick one")
    group.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
                       choices=("c10d",),
                       help="accepted for torchrun's task lines; mpitrain's own rendezvous "
                            "plays c10d's part")
    group.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", metavar="K=V,...",
                       help="join_timeout=S (as --rdzv-timeout), is_host=true|false (serve the "
                            "endpoint or not, overriding the address check), "
                            "heartbeat_timeout=S (a node silent this long counts as lost; "
                            f"default {DEFAULT_HEARTBEAT_TIMEOUT_S:g})")


@dataclass(frozen=True)
class RendezvousOptions:
    """The rendezvous the command line asks for."""

    nnodes: int
    nproc: int
    host: str
    port: int
    rdzv_id: str
    node_rank: int | None
    timeout_s: float
    heartbeat_timeout_s: float
    is_host: bool | None  # None: decide by the endpoint's address and --node-rank
    local_addr: str | None = None

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6addr]:port`` -> (host, port).

    Raises:
        ValueError: no host, or a port that is not 1..65535.
    """
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"--rdzv-endpoint {text!r}: write an IPv6 address as [ADDR]:PORT")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise ValueError(f"--rdzv-endpoint {text!r}: write an IPv6 address as [ADDR]:PORT")
    else:
        host, port_text = text, ""
    if not host:
        raise ValueError(f"--rdzv-endpoint {text!r} names no host")
    if not port_text:
        return host, DEFAULT_PORT
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(f"--rdzv-endpoint {text!r}: port {port_text!r} is not 1..65535")
    return host, port


def _parse_conf(text: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in CONF_KEYS:
            raise ValueError(f"--rdzv-conf {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(CONF_KEYS)}")
        conf[key] = value
    return conf


def _conf_seconds(key: str, text: str) -> float:
    try:
        return _seconds(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--rdzv-conf {key}={text}: {exc}") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` can only be reached from its own machine (by its spelling)."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rendezvous_options(args: argparse.Namespace) -> RendezvousOptions | None:
    """The rendezvous asked for, or None when the command line asks for none.

    Raises:
        ValueError: a rendezvous option without --rdzv-endpoint, a missing --nnodes or
            --nproc-per-node, an option that contradicts the rendezvous (-np, -H, ...), a bad
            endpoint or --rdzv-conf item, a --node-rank outside 0..N-1, or a loopback endpoint
            for more than one node.
    """
    given = [flag for dest, flag in _FLAGS if getattr(args, dest, None) is not None]
    if getattr(args, "rdzv_endpoint", None) is None:
        if given:
            raise ValueError(f"{', '.join(given)} without --rdzv-endpoint HOST:PORT: the "
                             "rendezvous launch needs the address where the nodes meet")
        return None
    for dest, flag, why in _EXCLUSIVE:
        if getattr(args, dest, None) not in (None, False):
            raise ValueError(f"{flag} does not go with --rdzv-endpoint: {why}")
    if getattr(args, "launcher", "auto") == "srun":
        raise ValueError("--launcher srun does not go with --rdzv-endpoint: the rendezvous "
                         "starts the MPI job without srun")
    if args.nnodes is None or args.nproc_per_node is None:
        raise ValueError("--rdzv-endpoint needs --nnodes N and --nproc-per-node K")
    if args.rdzv_id is not None and not args.rdzv_id.strip():
        raise ValueError(f"--rdzv-id {args.rdzv_id!r} is empty: give the job's id, the same on "
                         "every node")
    host, port = parse_endpoint(args.rdzv_endpoint)
    if args.nnodes > 1 and is_loopback(host):
        raise ValueError(f"--rdzv-endpoint {args.rdzv_endpoint}: a loopback address reaches "
                         "only its own machine, so the other nodes could never arrive; give "
                         "the first node's host name or address")
    if args.node_rank is not None and args.node_rank >= args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}")
    conf = _parse_conf(args.rdzv_conf or "")
    timeout = args.rdzv_timeout
    if "join_timeout" in conf:
        join = _conf_seconds("join_timeout", conf["join_timeout"])
        if timeout is not None and timeout != join:
            raise ValueError(f"--rdzv-timeout {timeout:g} and --rdzv-conf join_timeout={join:g} "
                             "disagree: give one")
        timeout = join
    heartbeat = (_conf_seconds("heartbeat_timeout", conf["heartbeat_timeout"])
                 if "heartbeat_timeout" in conf else DEFAULT_HEARTBEAT_TIMEOUT_S)
    is_host: bool | None = None
    if "is_host" in conf:
        value = conf["is_host"].lower()
        if value not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"--rdzv-conf is_host={conf['is_host']}: give true or false")
        is_host = value in ("1", "true", "yes")
    return RendezvousOptions(
        nnodes=args.nnodes, nproc=args.nproc_per_node, host=host, port=port,
        rdzv_id=args.rdzv_id if args.rdzv_id is not None else DEFAULT_ID,
        node_rank=args.node_rank, timeout_s=timeout if timeout is not None else DEFAULT_TIMEOUT_S,
        heartbeat_timeout_s=heartbeat, is_host=is_host, local_addr=args.local_addr)


__all__ = ["CONF_KEYS", "DEFAULT_ID", "DEFAULT_PORT", "DEFAULT_TIMEOUT_S", "RendezvousOptions",
           "add_rendezvous_options", "is_loopback", "parse_endpoint", "rendezvous_options"]
