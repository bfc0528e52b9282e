"""The three transforms Horovod's MNIST examples use, as torchvision defines them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, value: Any) -> Any:
        for transform in self.transforms:
            value = transform(value)
        return value


class ToTensor:
    """An 8-bit grey image (H x W array or PIL image) as a 1 x H x W float tensor in [0, 1]."""

    def __call__(self, image: Any) -> torch.Tensor:
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).unsqueeze(0)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std


__all__ = ["Compose", "Normalize", "ToTensor"]
