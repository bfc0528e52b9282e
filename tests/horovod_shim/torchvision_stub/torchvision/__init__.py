"""Test fixture, not shipped: a stand-in for torchvision, which has no CPU build here.

Only ``torchvision.models`` exists, with one small model (see :mod:`.models`), so that
Horovod's ``pytorch_synthetic_benchmark.py`` runs unchanged with ``--model tiny_cnn``.
"""

from . import models

__all__ = ["models"]
