"""Every MPITRAIN_* environment variable, read once at init() into a frozen Config.

Each variable has one canonical ``MPITRAIN_`` name and may have documented foreign aliases
(``HOROVOD_*``, ``PERSEUS_*``) so that existing launch scripts keep working.  The canonical
name wins over an alias; an explicit argument to :func:`mpitrain.init` wins over both.  A value
that does not parse produces one warning naming the variable and the value, and the default
is used instead: a typo in a launch script must not crash a 1,000-rank job at start-up.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ranks_text

MiB = 1024 * 1024

ALLREDUCE_ALGORITHMS = ("auto", "shm", "ring", "hierarchical", "mpi")

# The designs of MPITRAIN_DETERMINISTIC (docs/guide/deterministic.md): "rank-order" folds every
# element over the ranks in rank order, once; "fixed-point" sums every element as integers on a
# shared per-element exponent, which makes the sum independent of the order and the world size
# too.  ``1`` picks DETERMINISTIC_DEFAULT (chosen by the measurements in that guide).
DETERMINISTIC_MODES = ("rank-order", "fixed-point")
DETERMINISTIC_DEFAULT = "rank-order"


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1/true/false, got {text!r}")


def _parse_nonneg_int(text: str) -> int:
    value = int(text.strip())
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def _parse_pos_int(text: str) -> int:
    value = int(text.strip())
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _parse_nonneg_float(text: str) -> float:
    value = float(text.strip())
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"must be >= 0, got {value}")
    return value


def _parse_algorithm(text: str) -> str:
    value = text.strip().lower()
    if value not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"must be one of {', '.join(ALLREDUCE_ALGORITHMS)}")
    return value


def _parse_deterministic(text: str) -> str:
    """``""`` (off), or one of :data:`DETERMINISTIC_MODES`."""
    value = text.strip().lower()
    if value in ("0", "false", "no", "off", ""):
        return ""
    if value in ("1", "true", "yes", "on"):
        return DETERMINISTIC_DEFAULT
    if value not in DETERMINISTIC_MODES:
        raise ValueError(f"must be 0, 1, {' or '.join(DETERMINISTIC_MODES)}")
    return value


def _parse_str(text: str) -> str:
    return text.strip()


def _parse_auto_bool(text: str) -> str:
    value = text.strip().lower()
    if value in ("auto", ""):
        return "auto"
    if value in ("1", "true", "yes", "on"):
        return "1"
    if value in ("0", "false", "no", "off"):
        return "0"
    raise ValueError("must be auto, 1 or 0")


def _parse_log_level(text: str) -> str:
    value = text.strip().upper()
    levels = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
    if value not in levels:
        raise ValueError(f"must be one of {', '.join(levels)}")
    return value


@dataclass(frozen=True)
class Variable:
    """One environment variable: where it lands in Config, how it parses, what it means."""

    field: str
    name: str
    parse: Callable[[str], Any]
    help: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    """Run-time settings, read once from the environment at init() and handed down."""

    fusion_threshold: int = 64 * MiB
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    round_ride_bytes: int = 256
    timeline: str = ""
    timeline_mark_cycles: bool = False
    stall_check_disable: bool = False
    stall_check_time_seconds: float = 60.0
    stall_shutdown_time_seconds: float = 0.0
    deadlock_time_seconds: float = 10.0
    allreduce_algorithm: str = "auto"
    allreduce_calibrate: bool = True
    calibration_cache: str = "~/.cache/mpitrain/allreduce-choices.json"
    hierarchical_allreduce: bool = False
    hierarchical_pipeline: int = 0
    hierarchical_half_duplex: bool = True
    adasum_hierarchical: bool = False
    allreduce_streams: int = 1
    deterministic: str = ""  # "" (off) or one of DETERMINISTIC_MODES
    local_size: int = 0
    bind_device: bool = True
    cuda_aware_mpi: str = "auto"
    set_cpu_threads: bool = True
    malloc_trim_threshold: int = 1 << 30
    gc_freeze: bool = True
    abort_on_error: bool = True
    start_timeout: float = 0.0
    log_level: str = "WARNING"
    allow_singleton: bool = False
    elastic_min_np: int = 0
    elastic_reset_limit: int = 0
    elastic_state_file: str = ""
    elastic_commit_to_file: bool = True
    elastic_control_dir: str = ""
    autotune: bool = False
    autotune_log: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_max_samples: int = 20
    # The Config fields whose value was given (environment or override) rather than defaulted:
    # autotune leaves those alone, as Horovod does with a variable the user set.
    explicit: frozenset[str] = frozenset()

    @property
    def logs_info(self) -> bool:
        """Whether rank 0 says what it decided (autotune, auto's calibration): INFO or lower."""
        return self.log_level in ("TRACE", "DEBUG", "INFO")


VARIABLES: tuple[Variable, ...] = (
    Variable("fusion_threshold", "MPITRAIN_FUSION_THRESHOLD", _parse_nonneg_int,
             "Bytes per fused bucket; 0 disables fusion.", ("HOROVOD_FUSION_THRESHOLD",)),
    Variable("cycle_time_ms", "MPITRAIN_CYCLE_TIME", _parse_nonneg_float,
             "Milliseconds between negotiation cycles while requests are pending.",
             ("HOROVOD_CYCLE_TIME",)),
    Variable("cache_capacity", "MPITRAIN_CACHE_CAPACITY", _parse_nonneg_int,
             "Negotiated requests remembered so that repeats skip the full exchange; 0 disables.",
             ("HOROVOD_CACHE_CAPACITY",)),
    Variable("round_ride_bytes", "MPITRAIN_ROUND_RIDE_BYTES", _parse_nonneg_int,
             "Bytes per rank of small repeated CPU allreduces carried in the negotiation round "
             "itself (sets of two ranks), which then needs no collective of its own; 0 "
             "disables."),
    Variable("timeline", "MPITRAIN_TIMELINE", _parse_str,
             "Path of a Chrome-trace JSON file written by rank 0.", ("HOROVOD_TIMELINE",)),
    Variable("timeline_mark_cycles", "MPITRAIN_TIMELINE_MARK_CYCLES", _parse_bool,
             "Mark every negotiation cycle in the timeline.", ("HOROVOD_TIMELINE_MARK_CYCLES",)),
    Variable("stall_check_disable", "MPITRAIN_STALL_CHECK_DISABLE", _parse_bool,
             "Turn the stall inspector off.", ("HOROVOD_STALL_CHECK_DISABLE",)),
    Variable("stall_check_time_seconds", "MPITRAIN_STALL_CHECK_TIME_SECONDS", _parse_nonneg_float,
             "Warn when some ranks have waited this long for others to submit a tensor.",
             ("HOROVOD_STALL_CHECK_TIME_SECONDS",)),
    Variable("stall_shutdown_time_seconds", "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS",
             _parse_nonneg_float,
             "Fail stalled requests (ending the job) after this long; 0 never.",
             ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",)),
    Variable("deadlock_time_seconds", "MPITRAIN_DEADLOCK_TIME_SECONDS", _parse_nonneg_float,
             "Fail every pending request, on every rank, once every rank has waited this long "
             "with nothing submitted or completed anywhere (a deadlock); 0 never."),
    Variable("allreduce_algorithm", "MPITRAIN_ALLREDUCE_ALGORITHM", _parse_algorithm,
             "auto|shm|ring|hierarchical|mpi: force one allreduce algorithm."),
    Variable("allreduce_calibrate", "MPITRAIN_ALLREDUCE_CALIBRATE", _parse_bool,
             "Across nodes, auto times mpi/hierarchical/ring on the first large allreduces of "
             "each size and keeps the fastest (the link decides); 0: the fixed size table."),
    Variable("calibration_cache", "MPITRAIN_CALIBRATION_CACHE", _parse_str,
             "File where rank 0 keeps auto's choices across runs, per node layout, link and "
             "size class, so a job started again runs no trials; empty or 0: keep none."),
    Variable("hierarchical_allreduce", "MPITRAIN_HIERARCHICAL_ALLREDUCE", _parse_bool,
             "Prefer the hierarchical allreduce across nodes (same as algorithm=hierarchical).",
             ("HOROVOD_HIERARCHICAL_ALLREDUCE",)),
    Variable("hierarchical_pipeline", "MPITRAIN_HIERARCHICAL_PIPELINE", _parse_nonneg_int,
             "Overlap the hierarchical allreduce's node-local and cross-node steps over this "
             "many chunks of at least 1 MiB (0: one step after another)."),
    Variable("hierarchical_half_duplex", "MPITRAIN_HIERARCHICAL_HALF_DUPLEX", _parse_bool,
             "Between two nodes of an even rank count, the hierarchical allreduce's cross step "
             "goes one way at a time (0: the ring, both ways at once)."),
    Variable("adasum_hierarchical", "MPITRAIN_ADASUM_HIERARCHICAL", _parse_bool,
             "op=Adasum averages within each node first, then Adasum across nodes (Horovod's "
             "GPU/NCCL form; scale the learning rate by local_size); default: Adasum over all "
             "ranks, as Horovod on CPU."),
    Variable("allreduce_streams", "MPITRAIN_ALLREDUCE_STREAMS", _parse_pos_int,
             "Parallel channels a large bucket is split across, each with its own communicator.",
             ("PERSEUS_ALLREDUCE_STREAMS", "HOROVOD_NUM_STREAMS")),
    Variable("deterministic", "MPITRAIN_DETERMINISTIC", _parse_deterministic,
             "0|1|rank-order|fixed-point: floating-point Sum/Average results depend only on "
             "each rank's inputs, whatever the fusion, algorithm, channels, node layout and "
             "timing; rank-order: the inputs folded in rank order; fixed-point: also whatever "
             "the rank order and world size; 1: " + DETERMINISTIC_DEFAULT + " "
             "(docs/guide/deterministic.md)."),
    Variable("local_size", "MPITRAIN_LOCAL_SIZE", _parse_nonneg_int,
             "Pretend each node holds this many consecutive ranks (testing hierarchical code on "
             "one machine); 0 uses the real layout."),
    Variable("bind_device", "MPITRAIN_BIND_DEVICE", _parse_bool,
             "Bind each process to GPU local_rank % device_count at init()."),
    Variable("cuda_aware_mpi", "MPITRAIN_CUDA_AWARE_MPI", _parse_auto_bool,
             "auto|1|0: hand device buffers to MPI (auto asks the MPI library at init); "
             "otherwise CUDA tensors are staged through pinned host memory."),
    Variable("set_cpu_threads", "MPITRAIN_SET_CPU_THREADS", _parse_bool,
             "Give each rank cores // ranks-on-this-machine torch threads unless OMP_NUM_THREADS "
             "is set."),
    Variable("malloc_trim_threshold", "MPITRAIN_MALLOC_TRIM_THRESHOLD", _parse_nonneg_int,
             "Bytes of freed memory glibc's malloc keeps mapped for reuse, with chunks up to "
             "32 MiB served from its heap, set at init(): a training step's large temporaries "
             "then reuse pages instead of faulting them in again every step. 0, or glibc's own "
             "MALLOC_*_ variables or GLIBC_TUNABLES set: malloc is left as it is."),
    Variable("gc_freeze", "MPITRAIN_GC_FREEZE", _parse_bool,
             "At init(), move the objects Python's cyclic collector tracks then (the imports: "
             "270,000 with torch) into its permanent generation, so that a full collection "
             "examines only what was created since (0.6 ms instead of 112 ms with torch); "
             "0 leaves the collector as it is."),
    Variable("abort_on_error", "MPITRAIN_ABORT_ON_ERROR", _parse_bool,
             "An uncaught exception on any rank aborts the whole job, naming the rank "
             "(before init() too, once the script has started MPI)."),
    Variable("start_timeout", "MPITRAIN_START_TIMEOUT", _parse_nonneg_float,
             "Seconds from each process's start by which every rank must have reached init(); "
             "past it the job ends naming the ranks that did not (mpitrainrun "
             "--start-timeout); 0: wait as long as it takes (a rank that ended is noticed "
             "anyway).", ("HOROVOD_START_TIMEOUT",)),
    Variable("log_level", "MPITRAIN_LOG_LEVEL", _parse_log_level,
             "TRACE|DEBUG|INFO|WARNING|ERROR|FATAL.", ("HOROVOD_LOG_LEVEL",)),
    Variable("allow_singleton", "MPITRAIN_ALLOW_SINGLETON", _parse_bool,
             "Run as a world of one even when the launcher (torchrun, srun without PMI, another "
             "MPI's mpirun) says it started more processes; each then trains alone. Off: init() "
             "refuses such a job on every process."),
    Variable("elastic_min_np", "MPITRAIN_ELASTIC_MIN_NP", _parse_nonneg_int,
             "Elastic training ends the job, naming the lost ranks and hosts, when fewer than "
             "this many ranks survive a failure (mpitrainrun --min-np); 0: any number."),
    Variable("elastic_reset_limit", "MPITRAIN_ELASTIC_RESET_LIMIT", _parse_nonneg_int,
             "Elastic training ends the job after this many recoveries (mpitrainrun "
             "--reset-limit); 0: no limit."),
    Variable("elastic_state_file", "MPITRAIN_ELASTIC_STATE_FILE", _parse_str,
             "Restart-mode elastic training (mpitrainrun --elastic-restart, or an MPI without "
             "ULFM): rank 0 writes every commit here, atomically, and a restarted job resumes "
             "from it."),
    Variable("elastic_commit_to_file", "MPITRAIN_ELASTIC_COMMIT_TO_FILE", _parse_bool,
             "With a state file: write every commit to it (restart mode); 0: only when the job "
             "stops at a commit to be restarted on new hosts (mpitrainrun sets this)."),
    Variable("elastic_control_dir", "MPITRAIN_ELASTIC_CONTROL_DIR", _parse_str,
             "Set by mpitrainrun --host-discovery-script: the directory where it tells the job "
             "that hosts changed and the job's rank 0 records rosters, losses and stops."),
    Variable("autotune", "MPITRAIN_AUTOTUNE", _parse_bool,
             "Tune fusion threshold, cycle time, allreduce algorithm and channels on the running "
             "job (rank 0 times, every rank applies its choice at the same cycle), then keep the "
             "best; a variable set explicitly is not tuned.", ("HOROVOD_AUTOTUNE",)),
    Variable("autotune_log", "MPITRAIN_AUTOTUNE_LOG", _parse_str,
             "CSV file where rank 0 writes one row per autotune sample and the frozen choice.",
             ("HOROVOD_AUTOTUNE_LOG",)),
    Variable("autotune_warmup_samples", "MPITRAIN_AUTOTUNE_WARMUP_SAMPLES", _parse_nonneg_int,
             "Autotune samples measured and discarded before the first trial.",
             ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES",)),
    Variable("autotune_steps_per_sample", "MPITRAIN_AUTOTUNE_STEPS_PER_SAMPLE", _parse_pos_int,
             "Training steps (a tensor name coming back) per autotune sample.",
             ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",)),
    Variable("autotune_max_samples", "MPITRAIN_AUTOTUNE_MAX_SAMPLES", _parse_pos_int,
             "Autotune trials (settings measured) before the best is frozen.",
             ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",)),
)


def _lookup(var: Variable, environ: Mapping[str, str]) -> tuple[str, str] | None:
    for name in (var.name, *var.aliases):
        if name in environ:
            return name, environ[name]
    return None


def load(environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
    """Read every variable from ``environ`` (default: ``os.environ``) into a Config.

    Args:
        environ: the environment to read.
        overrides: explicit values for Config fields; they beat the environment.

    Returns:
        A frozen Config.

    Raises:
        TypeError: an override names no Config field.
    """
    env = os.environ if environ is None else environ
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"unknown config field(s): {sorted(unknown)}")
    values: dict[str, Any] = {}
    for var in VARIABLES:
        found = _lookup(var, env)
        if found is None:
            continue
        name, raw = found
        try:
            values[var.field] = var.parse(raw)
        except ValueError as exc:
            warnings.warn(f"mpitrain: ignoring {name}={raw!r} ({exc}); using the default "
                          f"{getattr(Config, var.field)!r}", RuntimeWarning, stacklevel=2)
    values.update(overrides)
    values["explicit"] = frozenset(values)
    if values.get("hierarchical_allreduce") and values.get("allreduce_algorithm", "auto") == "auto":
        values["allreduce_algorithm"] = "hierarchical"
    return Config(**values)


# Settings every rank must share: each decides which collectives run, in which pieces and over
# which communicators (fusion, the response cache, the algorithm, its chunks and channels, the
# deterministic mode's own collectives, the node layout, the elastic limits).  Ranks that
# differ would wait for each other in different collectives.  Autotune is not among them:
# every rank follows rank 0's, as in Horovod.  A remote host's ranks see only what the
# launcher forwards (Open MPI's mpirun passes a variable to other hosts only with -x), so a
# setting exported in one shell
# can reach some ranks and not others.
MUST_AGREE: tuple[str, ...] = (
    "fusion_threshold", "cache_capacity", "round_ride_bytes", "allreduce_algorithm",
    "allreduce_calibrate", "hierarchical_pipeline", "hierarchical_half_duplex",
    "adasum_hierarchical", "allreduce_streams", "deterministic", "local_size",
    "elastic_min_np", "elastic_reset_limit")


def disagreements(per_rank: Sequence[Sequence[Any]]) -> list[str]:
    """One line per :data:`MUST_AGREE` setting whose value differs between ranks.

    ``per_rank[r]`` holds rank r's values of :data:`MUST_AGREE`, in that order.  Each line
    names the variable and every value with the ranks that hold it, e.g.
    ``MPITRAIN_ALLREDUCE_ALGORITHM: 'ring' on ranks 0-1, 'auto' on ranks 2-3``.
    """
    names = {var.field: var.name for var in VARIABLES}
    lines = []
    for i, field in enumerate(MUST_AGREE):
        holders: dict[Any, list[int]] = {}
        for rank, values in enumerate(per_rank):
            holders.setdefault(values[i], []).append(rank)
        if len(holders) > 1:
            lines.append(f"{names[field]}: " + ", ".join(
                f"{value!r} on {ranks_text(ranks)}" for value, ranks in holders.items()))
    return lines


def describe() -> list[tuple[str, str, str]]:
    """Return (name, default, help) rows for every variable, aliases included in the help."""
    rows = []
    for var in VARIABLES:
        help_text = var.help
        if var.aliases:
            help_text += f" Aliases: {', '.join(var.aliases)}."
        rows.append((var.name, repr(getattr(Config, var.field)), help_text))
    return rows
