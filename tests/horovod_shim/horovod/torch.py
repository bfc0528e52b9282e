"""Test fixture: this module *is* :mod:`mpitrain.torch` (every name, and later additions)."""

import sys

import mpitrain.torch

sys.modules[__name__] = mpitrain.torch
