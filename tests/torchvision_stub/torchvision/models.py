"""``tiny_cnn``: an ImageNet-shaped classifier (3x224x224 images, 1000 classes) small enough
for a CPU test, in place of torchvision's ResNets."""

from torch import nn


def tiny_cnn(num_classes: int = 1000) -> nn.Module:
    """Two strided convolutions with batch norm, global pooling, a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=7, stride=4, padding=3, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 16, kernel_size=3, stride=4, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, num_classes),
    )


__all__ = ["tiny_cnn"]
