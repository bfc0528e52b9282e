"""``horovod.common``: only its ``exceptions`` module has a counterpart (mpitrain.core.errors)."""
