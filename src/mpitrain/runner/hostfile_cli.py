"""``mpitrain-hostfile``: validate, convert, expand and check host lists.

Built on the same parser as ``mpitrainrun`` (:mod:`mpitrain.runner.hosts` and
:mod:`mpitrain.runner.allocation`), so a file this tool accepts is a file the launcher accepts.

Examples::

    mpitrain-hostfile validate hosts                   # line numbers on every error
    mpitrain-hostfile convert hosts --to mpich         # node1 slots=4 -> node1:4
    mpitrain-hostfile convert -H a:2,b:2 --to openmpi
    mpitrain-hostfile expand-slurm 'node[01-04,07]' --tasks-per-node '2(x3),1,4'
    mpitrain-hostfile generate --to openmpi -o hosts   # inside a Slurm/PBS/LSF job
    mpitrain-hostfile check hosts --ssh                # resolve, then ssh each host
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

from . import allocation
from .hosts import (
    FORMATS,
    HostfileError,
    HostSlots,
    format_hosts,
    parse_hostfile_text,
    parse_hosts_string,
    parse_slot_lines,
    read_hostfile,
    total_slots,
    with_slots,
)


def _add_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", help="a hostfile (any form); '-' reads stdin")
    parser.add_argument("-H", "--hosts", metavar="HOST[:SLOTS],...",
                        help="a horovodrun -H string instead of a file")
    parser.add_argument("--per-slot", action="store_true",
                        help="the file is a PBS/LSF node file: each line one slot (the default "
                             "reading already counts repeated bare names this way)")
    parser.add_argument("--slots-per-host", type=int, metavar="K",
                        help="give every host K slots")


def _load(args: argparse.Namespace) -> list[HostSlots]:
    if (args.file is None) == (args.hosts is None):
        raise HostfileError("give exactly one of FILE or -H HOSTS")
    if args.hosts is not None:
        hosts = parse_hosts_string(args.hosts)
    elif args.file == "-":
        text = sys.stdin.read()
        hosts = (parse_slot_lines(text.splitlines(), "<stdin>") if args.per_slot
                 else parse_hostfile_text(text, "<stdin>"))
    elif args.per_slot:
        with open(args.file, encoding="utf-8") as handle:
            hosts = parse_slot_lines(handle.read().splitlines(), args.file)
    else:
        hosts = read_hostfile(args.file)
    if args.slots_per_host is not None:
        if args.slots_per_host < 1:
            raise HostfileError(f"--slots-per-host {args.slots_per_host}: must be >= 1")
        hosts = with_slots(hosts, args.slots_per_host)
    return hosts


def _write(text: str, output: str | None) -> None:
    if output is None:
        sys.stdout.write(text)
        return
    tmp = f"{output}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, output)


def _cmd_validate(args: argparse.Namespace) -> int:
    hosts = _load(args)
    print(f"{args.file or '-H'}: ok, {len(hosts)} host(s), {total_slots(hosts)} slot(s)")
    for h in hosts:
        print(f"  {h.host}  {h.slots}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    _write(format_hosts(_load(args), args.to), args.output)
    return 0


def _cmd_expand_slurm(args: argparse.Namespace) -> int:
    if args.tasks_per_node:
        hosts = allocation.slurm_hosts(args.nodelist, args.tasks_per_node)
    else:
        hosts = [HostSlots(n, 1) for n in allocation.expand_nodelist(args.nodelist)]
    if args.slots_per_host is not None:
        hosts = with_slots(hosts, args.slots_per_host)
    if args.to == "names":
        _write("".join(f"{h.host}\n" for h in hosts), args.output)
    else:
        _write(format_hosts(hosts, args.to), args.output)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    found = allocation.detect()
    if found is None:
        raise HostfileError("not inside a Slurm, PBS or LSF allocation (no SLURM_JOB_NODELIST, "
                            "PBS_NODEFILE, LSB_MCPU_HOSTS or LSB_DJOB_HOSTFILE)")
    hosts = list(found.hosts)
    if args.slots_per_host is not None:
        hosts = with_slots(hosts, args.slots_per_host)
    _write(format_hosts(hosts, args.to), args.output)
    print(f"{found.scheduler} allocation: {len(hosts)} host(s), {total_slots(hosts)} slot(s)",
          file=sys.stderr)
    return 0


def _ssh_answers(host: str, timeout: float) -> str | None:
    """None when ``ssh host true`` works without a password, else why not."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}",
            "-o", "StrictHostKeyChecking=accept-new", host, "true"]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 5)
    except FileNotFoundError:
        return "no ssh client on this machine"
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g} s"
    if result.returncode != 0:
        return (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
    return None


def _cmd_check(args: argparse.Namespace) -> int:
    hosts = _load(args)
    failures = 0
    for h in hosts:
        try:
            address = socket.getaddrinfo(h.host, None)[0][4][0]
        except OSError as exc:
            print(f"{h.host}: does not resolve ({exc.strerror or exc})")
            failures += 1
            continue
        status = f"{h.host}: resolves to {address}"
        if args.ssh:
            problem = _ssh_answers(h.host, args.timeout)
            if problem is not None:
                print(f"{status}; ssh fails: {problem}")
                failures += 1
                continue
            status += "; ssh ok"
        print(status)
    print(f"{len(hosts) - failures} of {len(hosts)} host(s) ok")
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpitrain-hostfile", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Validate, convert, expand and check host lists for mpitrainrun and mpirun. "
                    "Forms: openmpi ('host slots=N'), mpich ('host:N'), horovod "
                    "('h1:N,h2:N') and plain (one line per slot, as in PBS/LSF node files).",
        epilog=__doc__.split("Examples::", 1)[1] if __doc__ else None)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    p = sub.add_parser("validate", help="parse a host list and report hosts and slots",
                       description="Parse a hostfile or -H string; errors name the line and "
                                   "token (duplicates, zero or empty slot counts, bad names).")
    _add_source(p)
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("convert", help="rewrite a host list in another form",
                       description="Read a hostfile or -H string and write it in another form.")
    _add_source(p)
    p.add_argument("--to", choices=FORMATS, required=True, help="output form")
    p.add_argument("-o", "--output", help="write here (atomically) instead of stdout")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("expand-slurm", help="expand a Slurm node list (and task counts)",
                       description="Expand a Slurm node list such as 'node[01-04,07],gpu-[1-2]', "
                                   "optionally paired with SLURM_TASKS_PER_NODE such as "
                                   "'2(x3),1'.")
    p.add_argument("nodelist", help="e.g. node[01-04,07],gpu-[1-2]")
    p.add_argument("--tasks-per-node", metavar="SPEC", help="e.g. 2(x3),1")
    p.add_argument("--slots-per-host", type=int, metavar="K", help="give every host K slots")
    p.add_argument("--to", choices=(*FORMATS, "names"), default="names",
                   help="output form (default: one name per line)")
    p.add_argument("-o", "--output", help="write here (atomically) instead of stdout")
    p.set_defaults(func=_cmd_expand_slurm)

    p = sub.add_parser("generate", help="write a hostfile for the current Slurm/PBS/LSF job",
                       description="Turn the allocation this command runs inside (Slurm, PBS or "
                                   "LSF) into a hostfile.")
    p.add_argument("--to", choices=FORMATS, default="openmpi", help="output form")
    p.add_argument("--slots-per-host", type=int, metavar="K", help="give every host K slots")
    p.add_argument("-o", "--output", help="write here (atomically) instead of stdout")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("check", help="check that hosts resolve (and answer over ssh)",
                       description="Resolve every host; with --ssh also run 'ssh HOST true' "
                                   "without a password prompt.  Exits 1 if any host fails.")
    _add_source(p)
    p.add_argument("--ssh", action="store_true", help="also check password-less ssh")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per ssh attempt")
    p.set_defaults(func=_cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mpitrain-hostfile``; 2 for unusable input, 1 for failed checks."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (HostfileError, OSError) as exc:
        print(f"mpitrain-hostfile: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
