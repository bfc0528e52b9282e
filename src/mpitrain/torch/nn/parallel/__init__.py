"""``mpitrain.torch.nn.parallel.DistributedDataParallel``: torch's DDP on mpitrain's engine."""

from .distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
