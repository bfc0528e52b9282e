"""torch.distributed.ReduceOp -> what mpitrain's engine runs.

SUM, AVG (floating tensors only), PRODUCT, MIN and MAX map onto the engine's own reductions;
PREMUL_SUM becomes a Sum with the factor as the engine's prescale.  The bitwise ops (BAND, BOR,
BXOR) on integer and bool tensors have no MPI-data-plane kernel: they run as one allgather of
every rank's tensor followed by a local fold, which is exact and still a single collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...core.dtypes import ReduceOp

_RED: Any = dist.ReduceOp.RedOpType  # the stubs do not list the members
_ENGINE_OPS = {
    _RED.SUM: ReduceOp.SUM,
    _RED.AVG: ReduceOp.AVERAGE,
    _RED.PRODUCT: ReduceOp.PRODUCT,
    _RED.MIN: ReduceOp.MIN,
    _RED.MAX: ReduceOp.MAX,
    _RED.PREMUL_SUM: ReduceOp.SUM,
}
_BITWISE = {
    _RED.BAND: torch.bitwise_and,
    _RED.BOR: torch.bitwise_or,
    _RED.BXOR: torch.bitwise_xor,
}


@dataclass(frozen=True)
class Reduction:
    """How to run one torch reduction: an engine op with a prescale, or a bitwise fold."""

    name: str
    engine_op: ReduceOp | None = None
    prescale: float = 1.0
    fold: Any = None  # torch.bitwise_* for BAND/BOR/BXOR

    def check(self, tensor: torch.Tensor) -> None:
        """Reject dtypes the reduction is not defined on.

        Raises:
            TypeError: AVG on a non-floating tensor, or a bitwise op on a floating one.
        """
        floating = tensor.is_floating_point()
        if self.name == "AVG" and not floating:
            raise TypeError(f"ReduceOp.AVG needs a floating tensor, got {tensor.dtype}; "
                            "use SUM and divide")
        if self.fold is not None and floating:
            raise TypeError(f"ReduceOp.{self.name} needs an integer or bool tensor, got "
                            f"{tensor.dtype}")

    def apply_fold(self, gathered: torch.Tensor) -> torch.Tensor:
        """Fold rows of ``gathered`` (one per rank) with the bitwise op."""
        out = gathered[0].clone()
        for row in gathered[1:]:
            out = self.fold(out, row)
        return out


def resolve(op: Any) -> Reduction:
    """Translate a torch ReduceOp (object or enum value).

    Raises:
        ValueError: an op this backend does not know.
    """
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", str(kind))
    if kind in _BITWISE:
        return Reduction(name, fold=_BITWISE[kind])
    if kind not in _ENGINE_OPS:
        raise ValueError(f"the mpitrain backend does not support reduce op {op!r}")
    prescale = 1.0
    if kind == _RED.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError("ReduceOp.PREMUL_SUM needs a factor; build it with "
                             "torch.distributed._make_nccl_premul_sum(factor)")
        prescale = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    return Reduction(name, engine_op=_ENGINE_OPS[kind], prescale=prescale)


__all__ = ["Reduction", "resolve"]
