"""Test fixture, not shipped: a stand-in for torchvision, which has no CPU build here.

``torchvision.models`` has one small model (see :mod:`.models`), so that Horovod's
``pytorch_synthetic_benchmark.py`` runs unchanged with ``--model tiny_cnn``;
``torchvision.datasets.MNIST`` is scikit-learn's digits at MNIST's size (no download) and
``torchvision.transforms`` the three transforms Horovod's MNIST examples use.
"""

from . import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
