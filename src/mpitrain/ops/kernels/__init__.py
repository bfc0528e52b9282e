"""Reduction kernels: numba on CPU (:mod:`.cpu`); the GPU issue adds its own beside it."""
