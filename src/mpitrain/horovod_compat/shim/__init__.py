"""The directory put first on a Horovod script's module path; see :mod:`mpitrain.horovod_compat`.

Only the ``horovod`` package inside is meant to be imported, under that top-level name.
"""
