"""Device helpers that compile into the kernel calling them, for whatever GPU it targets.

numba's ``cuda.jit(device=True)`` dispatchers (and ``register_jitable``/``overload``, which
build one) type a call by compiling the helper for the *current device*: a kernel calling one
cannot be compiled without a CUDA driver, not even with ``numba.cuda.compile_ptx(...,
cc=(9, 0))``.  A helper made by :func:`device_helper` is a numba intrinsic instead: its type is
given by a rule, and its code is compiled by the calling kernel's own target context
(``compile_internal``), linked into that kernel and inlined by NVVM, exactly as a device
function's call would be.  So a kernel built from these helpers compiles ahead of time for any
compute capability on a machine with no GPU, which is how CI checks the generated code.

In numba's CUDA simulator kernels run as Python, so a helper stays the plain function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from numba import config as numba_config


def _simulated() -> bool:
    return bool(getattr(numba_config, "ENABLE_CUDASIM", False))


def device_helper(returns: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Decorate a helper written in plain Python so CUDA kernels can call it.

    Args:
        returns: maps the numba types of the arguments to the numba type of the result
            (``types.none`` for a helper that only stores); returning None rejects the
            argument types (a typing error in the calling kernel).

    Returns:
        A decorator; what it returns is callable from a kernel compiled for any target, and
        from Python only in the simulator (where it is the function itself).
    """
    def decorate(fn: Callable[..., Any]) -> Any:
        if _simulated():
            return fn
        from numba.cuda.extending import intrinsic  # optional numba.cuda (numba-cuda)

        def typer(typingctx: Any, *args: Any) -> Any:
            result = returns(*args)
            if result is None:
                return None
            signature = result(*args)

            def codegen(context: Any, builder: Any, sig: Any, llargs: Any) -> Any:
                return context.compile_internal(builder, fn, sig, llargs)

            return signature, codegen

        # numba folds a call's arguments with the typer's signature: give it fn's parameters
        # (after the typing context) rather than *args.
        context_parameter = inspect.Parameter("typingctx", inspect.Parameter.POSITIONAL_ONLY)
        typer.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [context_parameter, *inspect.signature(fn).parameters.values()])
        typer.__name__ = typer.__qualname__ = fn.__name__
        typer.__doc__ = fn.__doc__
        return intrinsic(typer)

    return decorate


__all__ = ["device_helper"]
