"""``mpitrain.torch.nn``: drop-ins for torch.nn modules that communicate."""

from . import parallel

__all__ = ["parallel"]
