"""The hvd face's framework-neutral parts: what ``import mpitrain as hvd`` offers beside the
framework packages (``mpitrain.torch``, ``mpitrain.tensorflow``, ...).

:mod:`.api` gathers the names; :mod:`.tensor_ops` runs the collectives on any array kind;
:mod:`.files` and :mod:`.scopes` are the checkpoint and process-set helpers;
:mod:`.torch_adapters` registers torch.distributed's backend at ``init()`` once torch is
loaded; :mod:`.info` is ``mpitrain-info``.  Adapters: they reach the engine only through the
front door (:mod:`mpitrain.collectives`).
"""
