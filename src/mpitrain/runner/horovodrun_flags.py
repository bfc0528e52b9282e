"""horovodrun's flags that Horovod users keep in their job scripts, for ``mpitrainrun``.

Each becomes what the MPI launcher needs (``--output-filename`` becomes Open MPI's
``--output dir=``, ``--ssh-port`` its ssh agent's ``-p``, ...), or is accepted with a note where
it has no meaning here (``--gloo``: mpitrain always runs over MPI), or is refused with the way to
get the same result.  ``--config-file`` reads horovodrun's YAML file into the same options.  The
table of horovodrun flags and their mpitrainrun spelling is in the launcher's docs page.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from typing import Any

from .mpi_command import Flavor

# mpitrainrun's ``--mpi FLAVOR`` choices; any other word after ``--mpi`` is not a flavor, so the
# ``--mpi`` before it is horovodrun's bare flag (see normalize_argv).
MPI_CHOICES = ("auto", *(flavor.value for flavor in Flavor))

# horovodrun's flags that change nothing here, accepted so that its job scripts run unchanged:
# flag -> (why, for --help; the note printed when the flag is given).
_ACCEPTED = {
    "--gloo": ("mpitrain always runs over MPI",
               "mpitrain runs over MPI only (no Gloo controller); running over MPI"),
    "--disable-cache": ("mpitrainrun caches no checks",
                        "mpitrainrun caches no start-up checks; nothing to disable"),
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the horovodrun-compatible options to ``parser``."""
    group = parser.add_argument_group(
        "horovodrun compatibility",
        "horovodrun's flags, mapped to the MPI launcher (see the docs' horovodrun table)")
    group.add_argument("--horovod-compat", action="store_true",
                       help="run an unchanged Horovod script: `import horovod.torch as hvd` "
                            "(and horovod.tensorflow, .keras) resolve to mpitrain")
    _add_launcher_flags(group)
    group.add_argument("--config-file", metavar="FILE",
                       help="horovodrun's YAML configuration (params, autotune, timeline, "
                            "stall_check, logging); options given on the command line win")
    for flag, (why, _) in _ACCEPTED.items():
        group.add_argument(flag, action="store_true",
                           help=f"accepted for horovodrun scripts: {why}")
    group.add_argument("--mpi-controller", action="store_true", help=argparse.SUPPRESS)


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """horovodrun's bare ``--mpi`` (choose the MPI controller) is mpitrainrun's
    ``--mpi FLAVOR`` without a flavor: keep ``--mpi openmpi`` as it is, read the bare flag as
    horovodrun's.  Only options before the command are looked at."""
    out: list[str] = []
    items = list(argv)
    for index, item in enumerate(items):
        if item == "--mpi" and (index + 1 == len(items) or items[index + 1] not in MPI_CHOICES):
            out.append("--mpi-controller")
            continue
        out.append(item)
        if not item.startswith("-") and (index == 0 or not items[index - 1].startswith("-")):
            return out + items[index + 1:]  # the command starts here: leave it alone
    return out


def notes(args: argparse.Namespace) -> list[str]:
    """One line for each accepted flag that changes nothing here."""
    return [f"{flag}: {note}" for flag, (_, note) in _ACCEPTED.items()
            if getattr(args, flag[2:].replace("-", "_"))]  # the flag's argparse dest


def _add_launcher_flags(group: argparse._ArgumentGroup) -> None:
    """Add the flags that :func:`launcher_args` and :func:`binding` turn into launcher arguments."""
    group.add_argument("--output-filename", metavar="DIR",
                       help="write each rank's stdout and stderr under DIR (Open MPI: "
                            "DIR/<job>/rank.N/stdout; MPICH: DIR/rank.N.stdout)")
    group.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                       dest="prefix_timestamp", action="store_true",
                       help="timestamp each line of the ranks' output (Open MPI)")
    group.add_argument("-p", "--ssh-port", type=int, metavar="PORT",
                       help="ssh port of the hosts")
    group.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                       help="ssh private key to reach the hosts with")
    group.add_argument("--binding-args", metavar="'ARGS'",
                       help="process binding arguments for the launcher, replacing mpitrain's "
                            "'--bind-to none' (mpitrain shares cores out itself), e.g. "
                            "--binding-args='--bind-to core'")


def launcher_args(args: argparse.Namespace, flavor: Flavor | None, srun: bool) -> list[str]:
    """What the output and ssh flags add to the launcher's command line.

    Raises:
        ValueError: a flag the chosen MPI launcher cannot honour, with what to use instead.
    """
    out: list[str] = []
    ssh = _ssh_options(args)
    if srun:
        if ssh:
            raise ValueError("-p/--ssh-port and -i/--ssh-identity-file: srun starts the ranks "
                             "inside the Slurm allocation without ssh; drop them")
        if args.prefix_timestamp:
            raise ValueError("--prefix-output-with-timestamp: srun cannot timestamp output; "
                             "use --launcher mpirun with Open MPI, or pipe through `ts`")
        if args.output_filename:
            base = args.output_filename.rstrip("/")
            out += [f"--output={base}/rank.%t.stdout", f"--error={base}/rank.%t.stderr"]
        return out
    if flavor is Flavor.OPENMPI:
        outputs = []
        if args.output_filename:
            outputs.append(f"dir={args.output_filename}")
        if args.prefix_timestamp:
            outputs.append("timestamp")
        if outputs:
            out += ["--output", ",".join(outputs)]
        if ssh:
            out += ["--prtemca", "plm_ssh_args", ssh]
        return out
    if args.prefix_timestamp:
        raise ValueError("--prefix-output-with-timestamp needs Open MPI's launcher; with "
                         f"{flavor.value if flavor else 'this launcher'} pipe the output "
                         "through `ts` (moreutils) instead")
    if args.output_filename:
        base = args.output_filename.rstrip("/")
        out += ["-outfile-pattern", f"{base}/rank.%r.stdout",
                "-errfile-pattern", f"{base}/rank.%r.stderr"]
    if ssh:
        out += ["-bootstrap-exec-args", ssh]
    return out


def binding(args: argparse.Namespace) -> list[str] | None:
    """The user's binding arguments, or None to keep mpitrain's default (no binding)."""
    return shlex.split(args.binding_args) if args.binding_args else None


def _ssh_options(args: argparse.Namespace) -> str:
    parts = []
    if args.ssh_port is not None:
        parts += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        parts += ["-i", args.ssh_identity_file]
    return shlex.join(parts)


# horovodrun's YAML sections: key -> (mpitrainrun's option dest, how to convert); a dest of
# None is accepted and has no meaning here (noted), as horovodrun's own GPU-library knobs.
_CONFIG: dict[str, dict[str, tuple[str | None, Any]]] = {
    "params": {"fusion_threshold_mb": ("fusion_threshold_mb", float),
               "cycle_time_ms": ("cycle_time_ms", float),
               "cache_capacity": ("cache_capacity", int),
               "hierarchical_allreduce": ("hierarchical_allreduce", bool),
               "hierarchical_allgather": (None, bool)},
    "autotune": {"enabled": ("autotune", bool),
                 "log_file": ("autotune_log_file", str),
                 "warmup_samples": ("autotune_warmup_samples", int),
                 "steps_per_sample": ("autotune_steps_per_sample", int),
                 "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", int),
                 "gaussian_process_noise": (None, float)},
    "timeline": {"filename": ("timeline_filename", str),
                 "mark_cycles": ("timeline_mark_cycles", bool)},
    "stall_check": {"enabled": ("no_stall_check", lambda v: not bool(v)),
                    "warning_time_seconds": ("stall_check_warning_time_seconds", float),
                    "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", float)},
    "library_options": {"mpi_threads_disable": (None, bool), "num_nccl_streams": (None, int),
                        "ccl_bgt_affinity": (None, int), "gloo_timeout_seconds": (None, int)},
    "logging": {"level": ("log_level", lambda v: str(v).upper()),
                "with_timestamp": (None, bool)},
}


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Fill ``args`` from ``--config-file``: an option the command line gave keeps its value
    (it still holds something other than its default).  Returns notes for keys without a
    meaning here.

    Raises:
        ValueError: the file cannot be read or parsed, or names an unknown section or key.
    """
    path = args.config_file
    try:
        import yaml  # optional: only horovodrun's YAML config file needs it
    except ImportError:
        raise ValueError(f"--config-file {path}: reading YAML needs PyYAML: pip install pyyaml"
                         ) from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config-file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config-file {path}: expected a mapping of sections, got "
                         f"{type(data).__name__}")
    noted = []
    controller = data.pop("controller", None)
    if controller is not None:
        if str(controller).lower() not in ("mpi", "gloo"):
            raise ValueError(f"--config-file {path}: controller {controller!r} is neither mpi "
                             "nor gloo")
        if str(controller).lower() == "gloo":
            args.gloo = True
    for section, values in data.items():
        keys = _CONFIG.get(section)
        if keys is None:
            raise ValueError(f"--config-file {path}: unknown section {section!r}; known: "
                             f"{', '.join(['controller', *_CONFIG])}")
        for key, value in (values or {}).items():
            if key not in keys:
                raise ValueError(f"--config-file {path}: unknown key {section}.{key}; known in "
                                 f"{section}: {', '.join(keys)}")
            dest, convert = keys[key]
            if dest is None:
                noted.append(f"--config-file: {section}.{key} has no meaning in mpitrain; "
                             "ignored")
            elif getattr(args, dest) == parser.get_default(dest):
                try:
                    converted = convert(value)
                except (TypeError, ValueError):
                    converted = None
                if converted is None or (isinstance(converted, (int, float))
                                         and not isinstance(converted, bool) and converted < 0):
                    raise ValueError(f"--config-file {path}: {section}.{key}: {value!r} is "
                                     "not a valid value")
                setattr(args, dest, converted)
    return noted
