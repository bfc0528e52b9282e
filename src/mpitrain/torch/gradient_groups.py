"""Horovod's ``groups=`` argument of DistributedOptimizer: its validation, and the split of
the parameters into groups that are each reduced as one grouped request."""

from __future__ import annotations

import torch

# ``groups=`` once checked: a number of groups, or lists of parameters (None: no groups).
Groups = int | list[list[torch.Tensor]] | None


def check_groups(groups: object) -> Groups:
    """``groups`` as given, checked (a copy of the lists).

    Raises:
        ValueError: not a positive integer or a list of lists of distinct tensors.
    """
    if groups is None:
        return None
    if isinstance(groups, bool):
        raise ValueError(f"groups must be a positive integer or a list of lists of tensors, "
                         f"got {groups!r}")
    if isinstance(groups, int):
        if groups <= 0:
            raise ValueError(f"groups must be a positive integer or a list of lists of "
                             f"tensors, got {groups}")
        return groups
    if not isinstance(groups, (list, tuple)):
        raise ValueError(f"groups must be a positive integer or a list of lists of tensors, "
                         f"got {type(groups).__name__}")
    seen: set[int] = set()
    out: list[list[torch.Tensor]] = []
    for i, group in enumerate(groups):
        if not isinstance(group, (list, tuple)):
            raise ValueError(f"groups[{i}] must be a list of tensors, got "
                             f"{type(group).__name__}")
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"groups must consist of torch.Tensor; groups[{i}] holds a "
                                 f"{type(p).__name__}")
            if id(p) in seen:
                raise ValueError("a parameter can only appear once in groups; one appears "
                                 f"again in groups[{i}]")
            seen.add(id(p))
        out.append(list(group))
    return out


def split_groups(groups: int | list[list[torch.Tensor]], all_params: list[torch.Tensor],
                 names: dict[torch.Tensor, str]) -> list[tuple[torch.Tensor, ...]]:
    """The non-empty groups of trainable parameters that ``groups`` (from
    :func:`check_groups`) asks for; every trainable parameter lands in exactly one.

    Raises:
        ValueError: a group holds a tensor that is not one of ``all_params``.
    """
    trainable = [p for p in all_params if p.requires_grad]
    if isinstance(groups, int):
        # The same split on every rank: order by name, which every rank knows alike.
        ordered = sorted(trainable, key=lambda p: names[p])
        n = min(groups, len(ordered)) or 1
        size, extra = divmod(len(ordered), n)
        split, start = [], 0
        for i in range(n):
            stop = start + size + (1 if i < extra else 0)
            split.append(tuple(ordered[start:stop]))
            start = stop
    else:
        known = {id(p) for p in all_params}
        for i, g in enumerate(groups):
            if any(id(p) not in known for p in g):
                raise ValueError(f"groups[{i}] holds a tensor that is not a parameter of "
                                 "the optimizer")
        # Frozen parameters get no hook; leaving them out keeps groups completable.
        split = [tuple(p for p in g if p.requires_grad) for g in groups]
        listed = {p for g in split for p in g}
        split += [(p,) for p in trainable if p not in listed]
    return [group for group in split if group]


__all__ = ["Groups", "check_groups", "split_groups"]
