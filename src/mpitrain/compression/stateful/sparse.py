"""Top-k and scaled-sign (1-bit) compression, each with error feedback.

Both keep, per rank and tensor, the part of ``M = grad + error`` they did not send and add it
to the next step's gradient (Stich et al. 2018 for top-k, Seide et al. 2014 and Karimireddy et
al. 2019 for signs), which is what makes them converge.  Neither result is a sum of the ranks'
tensors, so both travel by allgather: every rank sends its compressed tensors, receives
everyone's, and decodes the average itself, in the same order on every rank (the same bits
everywhere).  Their traffic grows with the number of ranks, unlike PowerSGD's allreduce:
they suit a few nodes on a slow link.

* :class:`TopK`: the ``ratio`` largest entries of each tensor by magnitude, as (int32 index,
  value) pairs: ``8 * k`` bytes for float32 instead of ``4 * n``.
* :class:`OneBit`: the sign of each entry, 8 to a byte, and one float32 scale per tensor (the
  mean magnitude, so the sent tensor has M's l1 norm): 1/32 of float32's bytes.
* :class:`TwoBit`: MXNet's 2-bit scheme (the KVStore's ``{"type": "2bit", "threshold": t}``):
  entries of M at or above ``t`` are sent as ``t``, at or below ``-t`` as ``-t``, the rest as
  0, four to a byte; the error memory is float32 whatever the gradient's type, as MXNet's.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from .base import GradientReducer, compressible

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
# The eight +1/-1 values each byte stands for: decoding is one row lookup per byte (12x faster
# than testing every bit of 4 ranks' 1.1M signs separately: 21 -> 1.8 ms on one core).
_SIGNS_OF_BYTE = ((torch.arange(256, dtype=torch.uint8).view(-1, 1) & _BITS) > 0).to(
    torch.float32) * 2 - 1


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """Bit i of the result is 1 where ``values[i] >= 0`` (most significant bit first)."""
    n = values.numel()
    bits = values.reshape(-1) >= 0
    pad = (-n) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    eights = bits.view(-1, 8).to(torch.uint8)
    packed = eights[:, 0] << 7
    for j in range(1, 8):
        packed |= eights[:, j] << (7 - j)
    return packed


def unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """+1/-1 of ``n`` entries from :func:`pack_signs`' bytes."""
    table = _SIGNS_OF_BYTE.to(device=packed.device, dtype=dtype)
    return table.index_select(0, packed.reshape(-1).long()).view(-1)[:n]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in 0..3 -> four per byte (padded with zeros)."""
    pad = (-codes.numel()) % 4
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    quads = codes.view(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def unpack_codes(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes` for rows of packed bytes: (rows, bytes) -> (rows, n)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & 3
    return codes.reshape(packed.shape[0], -1)[:, :n]


class _ErrorFeedback(GradientReducer):
    """What top-k and sign share: the error memory and the split into taken and plain."""

    kind = ""

    def __init__(self) -> None:
        super().__init__()
        self.errors: dict[str, list[torch.Tensor]] = {}

    def _with_error(self, tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
        """M = grad + error for each tensor (a new tensor; the gradients are outputs)."""
        errors = self.errors.get(key)
        if errors is None or len(errors) != len(tensors):
            return [t.detach().clone() for t in tensors]
        return [t + e for t, e in zip(tensors, errors)]

    def reduce(self, tensors: Sequence[torch.Tensor], key: str = "grads",
               last: bool = True, average: bool = True) -> None:
        tensors = list(tensors)
        taken = [t for t in tensors if compressible(t) and t.numel() > 0]
        plain = [t for t in tensors if not (compressible(t) and t.numel() > 0)]
        if taken:
            ms = self._with_error(taken, key)
            sent = self._exchange(taken, ms, key, self.world if average else 1)
            self.errors[key] = [m - s for m, s in zip(ms, sent)]
        self.average_plainly(plain, key, average)

    @abstractmethod
    def _exchange(self, outputs: list[torch.Tensor], ms: list[torch.Tensor], key: str,
                  divisor: int) -> list[torch.Tensor]:
        """Send compressed ``ms``, write the decoded sum over ``divisor`` into ``outputs``,
        return what this rank's compression kept of each M (its error is the rest)."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "wire_bytes": self.wire_bytes,
                "errors": {k: [e.clone() for e in v] for k, v in self.errors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"not a {self.kind} state (kind {state.get('kind')!r})")
        self.errors = {k: [e.clone() for e in v] for k, v in state["errors"].items()}
        self.wire_bytes = int(state.get("wire_bytes", 0))


class TopK(_ErrorFeedback):
    """Send the ``ratio`` largest-magnitude entries of each tensor (at least one)."""

    kind = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        super().__init__()
        if not 0 < ratio <= 1:
            raise ValueError(f"top-k ratio must be in (0, 1], got {ratio!r}")
        self.ratio = ratio

    def __repr__(self) -> str:
        return f"Compression.topk(ratio={self.ratio})"

    def _exchange(self, outputs: list[torch.Tensor], ms: list[torch.Tensor], key: str,
                  divisor: int) -> list[torch.Tensor]:
        flats = [m.reshape(-1) for m in ms]
        ks = [max(1, math.ceil(self.ratio * f.numel())) for f in flats]
        indices = [torch.topk(f.abs(), k, sorted=False).indices for f, k in zip(flats, ks)]
        values = [f[i] for f, i in zip(flats, indices)]
        # Indices into all tensors laid end to end, so one scatter decodes everything.
        starts = [0]
        for f in flats[:-1]:
            starts.append(starts[-1] + f.numel())
        gathered = self.allgather([torch.cat([(i + s).to(torch.int32)
                                              for i, s in zip(indices, starts)]),
                                   torch.cat(values)], key, "topk")
        total = torch.zeros(sum(f.numel() for f in flats), dtype=flats[0].dtype,
                            device=flats[0].device)
        # One scatter per rank, in rank order: a rank's own indices are distinct, so no
        # scatter adds twice into one entry, and every entry sums its contributions in rank
        # order, bit for bit the same on every rank and every device. (One scatter of all
        # ranks at once is that on CPU, but CUDA's index_add_ adds duplicates by atomics in
        # any order: at 4 ranks on an H200 the ranks' sums differed in the last bits.)
        per_rank = sum(ks)
        everyone = gathered[0].to(torch.int64).view(self.world, per_rank)
        for r, rank_values in enumerate(gathered[1].view(self.world, per_rank)):
            total.index_add_(0, everyone[r], rank_values)
        if divisor != 1:
            total /= divisor
        sent = []
        for out, flat, start, idx, val in zip(outputs, flats, starts, indices, values):
            out.copy_(total[start:start + flat.numel()].view_as(out))
            mine = torch.zeros_like(flat)
            mine[idx] = val
            sent.append(mine.view_as(out))
        return sent


class OneBit(_ErrorFeedback):
    """Send each entry's sign and one scale per tensor (its mean magnitude)."""

    kind = "onebit"

    def __repr__(self) -> str:
        return "Compression.onebit()"

    def _exchange(self, outputs: list[torch.Tensor], ms: list[torch.Tensor], key: str,
                  divisor: int) -> list[torch.Tensor]:
        scales = torch.stack([m.abs().mean().to(torch.float32) for m in ms])
        packed = [pack_signs(m) for m in ms]
        gathered = self.allgather([torch.cat(packed), scales], key, "signs")
        all_bits = gathered[0].view(self.world, -1)
        all_scales = gathered[1].view(self.world, -1)
        # Every rank's signs at once: (world, 8 * bytes) of +1/-1.
        signs = unpack_signs(all_bits, 8 * all_bits.numel(), torch.float32).view(self.world, -1)
        sent = []
        at = 0
        for i, (out, m, p) in enumerate(zip(outputs, ms, packed)):
            n = m.numel()
            block = signs[:, 8 * at:8 * at + n]
            total = torch.zeros(n, dtype=torch.float32, device=m.device)
            for r in range(self.world):  # rank order: the same sums on every rank
                total += all_scales[r, i] * block[r]
            out.copy_((total / divisor if divisor != 1 else total).view_as(out))
            sent.append((scales[i] * block[self.process_rank()]).to(m.dtype).view_as(m))
            at += p.numel()
        return sent


class TwoBit(_ErrorFeedback):
    """MXNet's 2-bit quantisation with a threshold (see the module docstring)."""

    kind = "2bit"

    def __init__(self, threshold: float = 0.5) -> None:
        super().__init__()
        if not threshold > 0:
            raise ValueError(f"2bit threshold must be positive, got {threshold!r}")
        self.threshold = float(threshold)

    def __repr__(self) -> str:
        return f"TwoBit(threshold={self.threshold})"

    def _with_error(self, tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
        ms = [t.detach().to(torch.float32) for t in tensors]
        errors = self.errors.get(key)
        if errors is None or len(errors) != len(ms):
            return [m.clone() for m in ms]
        return [e + m for e, m in zip(errors, ms)]

    def _exchange(self, outputs: list[torch.Tensor], ms: list[torch.Tensor], key: str,
                  divisor: int) -> list[torch.Tensor]:
        t = self.threshold
        signs = [(m >= t).to(torch.int8) - (m <= -t).to(torch.int8) for m in ms]
        codes = [(s == 1).to(torch.uint8) * 3 + (s == -1).to(torch.uint8) * 2 for s in signs]
        packed = [pack_codes(c.flatten()) for c in codes]
        gathered = self.allgather([torch.cat(packed)], key, "2bit")[0].view(self.world, -1)
        sent = []
        at = 0
        for out, m, s, p in zip(outputs, ms, signs, packed):
            every = unpack_codes(gathered[:, at:at + p.numel()], m.numel())
            counts = ((every == 3).sum(0, dtype=torch.int64)
                      - (every == 2).sum(0, dtype=torch.int64))
            total = counts.to(torch.float64) * t
            if divisor != 1:
                total /= divisor
            out.copy_(total.to(out.dtype).view_as(out))
            sent.append(s.to(torch.float32).view_as(m) * t)
            at += p.numel()
        return sent
