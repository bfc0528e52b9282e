"""``MNIST`` in place of torchvision's, which would download the real one (no network here):
scikit-learn's handwritten digits (1,797 8x8 images, shipped with scikit-learn), scaled up to
MNIST's 28x28 grey images with its labels, 1,500 for training and the rest for testing.
``download`` is accepted and ignored; ``root`` is not touched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

TRAIN = 1500


class MNIST:
    def __init__(self, root: str, train: bool = True, download: bool = False,
                 transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = (digits.images * (255.0 / 16.0)).astype(np.uint8)
        # 8x8 -> 24x24 (each pixel 3x3), centred in 28x28 like MNIST's 20x20 digit box.
        images = np.pad(images.repeat(3, axis=1).repeat(3, axis=2), ((0, 0), (2, 2), (2, 2)))
        part = slice(0, TRAIN) if train else slice(TRAIN, None)
        self.data, self.targets = images[part], digits.target[part].astype(np.int64)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image: Any = self.data[index]  # torchvision gives a PIL image; ToTensor takes either
        target: Any = int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


__all__ = ["MNIST"]
