"""``speculators-peagle selftest``: it passes here, a planted bug fails it, bad input is one
sentence, and the GPU machine's wheels cover everything it imports."""


import math
import sys

import pytest
import torch
from click.testing import CliRunner

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.kernels import block_sparse
from speculators_peagle_plugin.selftest import checks, command
from speculators_peagle_plugin.selftest.shapes import SHAPES
from speculators_peagle_plugin.training import draft_loss, peagle_trainer
from tools import prepare_gpu


def test_shipped_wheels_leave_out_what_the_gpu_machine_has():
    ship = prepare_gpu.wheels_to_ship()
    assert not set(ship) & {"torch", "transformers", "triton", "safetensors", "pyarrow", "numpy"}
    assert "vllm" not in ship and ship["speculators"].startswith("0.9")
    assert "pydantic" in ship and "pydantic-core" in ship  # speculators' config; not in the image


def test_gpu_command_installs_offline_then_bisects_and_runs_the_cuda_selftest():
    command_line = prepare_gpu.gpu_command("runs/gpu-wheels")
    install, runs = command_line.split(" && ")
    assert "pip install" in install and "--no-deps --no-index runs/gpu-wheels/*.whl" in install
    bisect, run = runs.removeprefix("{ ").removesuffix("; }").split("; ")
    assert bisect == 'timeout 300 python3 -m tools.gpu_bisect --out "${OUT:-.}"'
    assert run.startswith("timeout 270 python3 -m speculators_peagle_plugin.selftest "
                          "--device cuda ")
    assert "--shape llama8b --seq-lens 8192,32768 --ours-seq-lens 65536,131072 " in run
    assert run.endswith("--profile --json \"${OUT:-.}/selftest-cuda.json\"")


def test_the_bisect_runs_an_arm_and_records_each_length(monkeypatch):
    """On the CPU (the tool's plumbing; its arms matter on CUDA): every step's loss, the
    speed, and an arm's switches put back by the test."""
    from speculators_peagle_plugin.kernels import attention, flex
    from tools import gpu_bisect

    monkeypatch.setattr(draft_loss, "REGION_DEVICES", draft_loss.REGION_DEVICES)
    monkeypatch.setattr(attention, "cod_block_mask", attention.cod_block_mask)
    monkeypatch.setattr(flex, "flex_inputs", flex.flex_inputs)
    monkeypatch.setitem(gpu_bisect.ARMS, "every switch", (False, True, False))
    record = gpu_bisect.run_arm("every switch", "tiny", [128, 256], device="cpu")
    assert draft_loss.REGION_DEVICES == () and record["full_width"] and not record["region"]
    q = torch.zeros(1, 4, 2).transpose(1, 2)
    assert not record["contiguous"] and flex.flex_inputs(q, q, q)[0] is q
    assert list(record["lengths"]) == [128, 256]
    for length in record["lengths"].values():
        assert len(length["losses"]) == gpu_bisect.STEPS and length["tokens_per_s"] > 0
        assert len(length["grad_norms"]) == gpu_bisect.STEPS and "error" not in length
        assert all(math.isfinite(x) and x > 0 for x in length["losses"] + length["grad_norms"])


def test_an_arm_cut_by_its_timeout_keeps_the_steps_it_printed():
    from tools import gpu_bisect

    child = [sys.executable, "-c", "import time; print('  arm: 8192 tokens, step 0: loss 1.0', "
             "flush=True); print('noise', flush=True); time.sleep(60)"]
    record, stdout = gpu_bisect.arm_record("as shipped", child, 5)
    assert record == {"arm": "as shipped", "error": "timed out after 5 s",
                      "steps": ["arm: 8192 tokens, step 0: loss 1.0"]}
    assert "noise" in stdout
    done = [sys.executable, "-c", "print('ARM ' + '{\"arm\": \"x\"}')"]
    assert gpu_bisect.arm_record("x", done, 30)[0] == {"arm": "x"}
    record, _ = gpu_bisect.arm_record("x", [sys.executable, "-c", "raise SystemExit(3)"], 30)
    assert record["exit"] == 3 and record["arm"] == "x"


def run_cli(args):
    result = CliRunner().invoke(main, ["selftest", *args])
    return result.exit_code, result.output


def test_a_planted_off_by_one_in_the_attention_kernel_fails(monkeypatch):
    """The band of each query loses its last key. Without speculators only the attention
    checks run (one sentence says so); they alone catch it."""
    right = block_sparse._band_mask

    def off_by_one(chunk, dtype):
        return right(chunk._replace(hi=torch.maximum(chunk.hi - 1, chunk.lo)), dtype)

    monkeypatch.setattr(block_sparse, "_band_mask", off_by_one)
    monkeypatch.setattr(command, "speculators_problem", lambda: "speculators is not usable here.")
    code, out = run_cli(["--device", "cpu", "--quick"])
    assert code == 1, out
    assert "FAIL attention chunked float32: " in out and "FAIL attention chunked bfloat16" in out
    assert "SKIP draft, step and speed checks: speculators is not usable here." in out
    assert out.strip().splitlines()[-1] == "selftest: 0 passed, 2 failed, 1 skipped"


def test_without_the_plant_the_attention_checks_pass(monkeypatch):
    monkeypatch.setattr(command, "speculators_problem", lambda: "speculators is not usable here.")
    code, out = run_cli(["--device", "cpu", "--quick"])
    assert code == 0, out
    assert out.strip().splitlines()[-1] == "selftest: 2 passed, 0 failed, 1 skipped"


def scaled_kl(fused):
    def wrong(*args, **kwargs):
        loss, hits = fused(*args, **kwargs)
        return loss * 1.001, hits

    return wrong


def context_cut(units):
    def wrong(b, anchor, depth, supervised, doc, segments, reach):
        return units(b, anchor, depth, supervised, doc, segments, min(reach, 2))

    return wrong


@pytest.mark.parametrize(("name", "plant", "fails"), [
    ("fused_linear_kl", scaled_kl, "training step float32"),
    ("row_units", context_cut, "partitioned step == flat step"),
    (None, None, None),  # nothing planted: nothing fails
])
def test_a_planted_wrong_loss_or_plan_fails_its_step_check(monkeypatch, name, plant, fails):
    """A loss 0.1% too large (inside bfloat16's tolerance), or segments that read too
    little context (the flat step is right): the check meant for it FAILs, alone."""
    if name:
        owner = draft_loss if name == "fused_linear_kl" else peagle_trainer
        monkeypatch.setattr(owner, name, plant(getattr(owner, name)))
    found = checks.step_checks(SHAPES["tiny"], torch.device("cpu"), range(1), 61)
    failed = [c.name for c in found if c.status == "FAIL"]
    assert failed == ([fails] if fails else []), [c.line() for c in found]


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "cuda"], "this machine has no CUDA device; use --device cpu."),
    (["--seq-lens", "8k"], "--seq-lens '8k' is not a comma-separated list of integers."),
    (["--seq-lens", "4096,8"], "give row lengths of 16 tokens or more."),
    (["--json", "/no/such/dir/x.json"], "--json /no/such/dir/x.json: its directory does not"),
    (["--ours-seq-lens", "65536,x"], "--ours-seq-lens '65536,x' is not a comma-separated list"),
    (["--profile"], "--profile writes its tables beside the record: give --json too."),
    (["--shape", "llama70b"], "Invalid value for '--shape'"),
])
def test_bad_input_is_one_sentence_and_exit_code_not_zero(args, message):
    if args[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out = run_cli(args)
    assert code != 0 and message in out, out
    assert "Traceback" not in out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quick_cuda_selftest_passes(tmp_path):
    code, out = run_cli(["--device", "cuda", "--quick", "--json", str(tmp_path / "r.json")])
    assert code == 0, out
    assert "PASS attention flex float32" in out and "PASS attention chunked float32" in out


def test_longest_row_search_doubles_then_bisects_to_an_eighth():
    """The CUDA-only search, driven by a step that runs out of memory past 5000 tokens."""
    from speculators_peagle_plugin.selftest import perf

    tried = []

    def step(batch, index):
        tried.append(batch["input_ids"].shape[1])
        if tried[-1] > 5000:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return 1.0

    found = perf.longest_row(step, SHAPES["tiny"], 1024, torch.device("cpu"), torch.float32, 60)
    assert tried == [2048, 4096, 8192, 6144, 5120]
    assert found["tokens"] == 4096 and found["first_failing"] == 5120 and found["complete"]

    def broken(batch, index):
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")

    with pytest.raises(RuntimeError, match="CUBLAS"):  # any other error is not "too long"
        perf.longest_row(broken, SHAPES["tiny"], 1024, torch.device("cpu"), torch.float32, 60)


def test_flex_that_does_not_compile_fails_its_checks_and_one_broken_check_only_itself(
    monkeypatch,
):
    """On CUDA: flex attention's compile failing FAILs both flex checks (training would run
    the slower path) and names why; an exception in one path and precision FAILs it alone."""
    from speculators_peagle_plugin.kernels import flex

    def fake(name, impl, precision, shape, device, masks):
        if name == "attention chunked bfloat16":
            raise RuntimeError("expected scalar type Float but found BFloat16\nmore")
        if impl == "flex":  # what the flex path records when Inductor fails
            flex.compile_failures[(precision, 4, 2, 64, 64)] = "LoweringException: launcher()"
        return checks.Check(name, "PASS", "fine")

    monkeypatch.setattr(checks, "_attention_check", fake)
    monkeypatch.setattr(flex, "compile_failures", {})
    assert checks.flex_compile_check().status == "PASS"
    found = checks.attention_checks(SHAPES["tiny"], torch.device("cuda"), range(1), 30)
    status = {c.name: c.status for c in found}
    assert status == {"attention flex float32": "FAIL", "attention flex bfloat16": "FAIL",
                      "attention chunked float32": "PASS", "attention chunked bfloat16": "FAIL"}
    flex_detail = found[0].detail
    assert "did not compile (float32, 4/2 heads of 64: LoweringException" in flex_detail
    assert "bfloat16, 4/2" in found[1].detail and "float32, 4/2" not in found[1].detail
    summary = checks.flex_compile_check()
    assert summary.status == "FAIL" and "bfloat16, 4/2 heads of 64: Lowering" in summary.detail
    assert found[3].detail == "RuntimeError: expected scalar type Float but found BFloat16"
    assert "traceback" in found[3].data


def test_speculators_side_whose_default_loss_fails_is_measured_with_its_eager_loss():
    """Its fused loss has no CPU kernel: the step runs its eager loss from then on and
    says so; the loss is finite."""
    from speculators_peagle_plugin.selftest import perf

    step = perf._theirs(SHAPES["tiny"], torch.device("cpu"), "none", loss_impl="fused")
    row = perf.make_row(SHAPES["tiny"], 64, torch.device("cpu"), torch.float32)
    first, second = step(row, 0), step(row, 1)
    assert step.note.startswith("its fused loss failed here (") and "eager loss" in step.note
    assert all(torch.isfinite(torch.tensor(x)) for x in (first, second))
    eager = perf._theirs(SHAPES["tiny"], torch.device("cpu"), "none")
    eager(row, 0)
    assert eager.note is None


def test_a_sides_note_names_only_the_compile_failures_of_its_own_steps(monkeypatch):
    """Failures the checks recorded before (another dtype, the narrow draft) are not the
    speed row's: its note names only those its steps added."""
    from speculators_peagle_plugin.kernels import flex
    from speculators_peagle_plugin.selftest import perf

    def fake_ours(shape, device, autocast, window):
        def step(batch, index):
            flex.compile_failures[("bfloat16", 32, 8, 128, 128)] = "NoValidChoicesError: x"
            return 1.0
        return step

    monkeypatch.setattr(flex, "compile_failures", {("float32", 8, 2, 128, 128): "earlier"})
    monkeypatch.setattr(perf, "_ours", fake_ours)
    spec = {"side": "ours", "shape": "tiny", "device": "cpu", "seq_lens": [64], "warmup": 0,
            "steps": 1, "search_s": 0}
    note = perf.measure_side(spec)["note"]
    assert note == ("did not compile (bfloat16, 32/8 heads of 128: NoValidChoicesError: x); "
                    "the exact fallback ran")


@pytest.mark.slow
def test_without_quick_the_torchrun_checks_pass_on_two_cpu_ranks():
    """DDP and FSDP, two CPU ranks each: gradients and loss match one process on the same rows
    (the path --quick leaves out, and the one a GPU run takes with 2+ devices)."""
    from speculators_peagle_plugin.selftest.distributed_checks import distributed_checks
    from speculators_peagle_plugin.selftest.shapes import SHAPES

    checks = distributed_checks(SHAPES["tiny"], torch.device("cpu"), seq_len=128, warmup=0,
                                steps=1, quick=False)
    assert [(c.name, c.status) for c in checks] == [
        ("torchrun DDP", "PASS"), ("torchrun FSDP", "PASS")], [c.detail for c in checks]
    for check in checks:
        assert check.data["ranks"] == 2 and check.data["speed"]["tokens_per_s"] > 0
