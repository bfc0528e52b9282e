"""A stand-in for Horovod 0.28.1 in tests (Horovod does not build here): see horovod/torch."""
