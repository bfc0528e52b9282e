"""Test fixture, not shipped: ``import horovod.torch as hvd`` resolves to :mod:`mpitrain.torch`.

With ``tests/horovod_shim`` on ``PYTHONPATH``, Horovod's own scripts run unchanged on mpitrain
(tests/jobs/test_horovod_adasum_examples.py).  Nothing else of Horovod is provided.
"""
