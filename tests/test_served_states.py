"""``train --vllm-endpoint``: hidden states of rows without them from a real ``vllm serve``
of the tiny target (``extract_hidden_states`` and our connector), started here.

The oracle is the offline path on the same rows: ``generate-data`` wrote the target's states
to disk, and training on its token ids alone, with the states fetched from the server, must
log the same loss at every step. One extract server per module: the test that kills it runs
last.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from datasets import load_from_disk
from helpers.serve import vllm_server
from helpers.training import config_for, refusal, run_cli, train_args
from safetensors.torch import load_file
from tiny_vllm import LAYER_IDS, LAYERS, PROMPTS, tiny_vllm_target

from speculators_peagle_plugin.common.errors import UserError
from speculators_peagle_plugin.datagen import served_states
from speculators_peagle_plugin.training.checkpoint import checkpoint_dirs
from speculators_peagle_plugin.training.loop import build_training
from speculators_peagle_plugin.training.prefetch import RowsAhead
from speculators_peagle_plugin.training.progress import METRICS_FILE
from speculators_peagle_plugin.training.train_config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
DRAFT_VOCAB = 64
FAST = ["--max-retries", "1", "--generation-validation-retries", "1",
        "--max-consecutive-generation-failures", "1", "--request-timeout", "60"]


def serve(target: str, hs_dir: Path, extract: bool = True):
    """The docs' server command (:func:`served_states.serve_command`), or a plain one."""
    launcher = (sys.executable, "-m", "speculators_peagle_plugin", "vllm")
    command = served_states.serve_command(target, LAYER_IDS, LAYERS, str(hs_dir),
                                          launcher=launcher)
    if not extract:
        command = command[:command.index("--speculative-config")]
    return lambda port: [*command, "--host", "127.0.0.1", "--port", str(port),
                         "--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
                         "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The target, another model of its shapes, generate-data's rows with their states
    (``data/``) and without (``tokens/``)."""
    root = tmp_path_factory.mktemp("served")
    tiny_vllm_target(root / "target", seed=0)
    tiny_vllm_target(root / "other", seed=1)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:4]))
    code, out = run_cli([
        "generate-data", "--target", str(root / "target"), "--prompts", str(prompts),
        "--output", str(root / "data"), "--max-new-tokens", "12",
        "--target-layer-ids", ",".join(map(str, LAYER_IDS)), "--draft-vocab-size",
        str(DRAFT_VOCAB),
    ])
    assert code == 0, out
    shutil.copytree(root / "data", root / "tokens", ignore=shutil.ignore_patterns("hidden_states"))
    return root


@pytest.fixture(scope="module")
def server(workdir):
    """``(base URL, the directory its connector writes)`` of the module's extract server."""
    hs_dir = workdir / "server-states"
    env = {"PYTHONPATH": str(REPO)}
    with vllm_server(serve(str(workdir / "target"), hs_dir), workdir / "serve.log", workdir,
                     env) as base:
        yield base, hs_dir


# AdamW: Muon's bfloat16 Newton-Schulz lifts the served states' last-bit differences from
# the files' past the rounding these tests allow within a step or two.
def train(workdir, save, data="tokens", *extra, verifier="target"):
    return run_cli([
        "train", "--verifier-name-or-path", str(workdir / verifier), "--data-path",
        str(workdir / data), "--save-path", str(save), "--draft-vocab-size", str(DRAFT_VOCAB),
        "--num-depths", "3", "--total-seq-len", "128", "--seed", "3", "--lr", "0.01",
        "--max-steps", "3", "--log-freq", "1", "--device", "cpu", "--optimizer", "adamw", *extra,
    ])


@pytest.fixture(scope="module")
def on_the_files(workdir, tmp_path_factory):
    """The save directory of ``train`` on the rows with their states (``data/``): the run
    every served run is held to, trained once for the module."""
    save = tmp_path_factory.mktemp("files")
    code, out = train(workdir, save, "data")
    assert code == 0, out
    return save


def losses(save) -> list[float]:
    return [json.loads(line)["loss"] for line in open(save / METRICS_FILE)]


def plain_blocks(page: str) -> list[str]:
    """The plain ``` blocks of a page, continuation lines joined, spaces collapsed."""
    blocks, inside, lines = [], False, None
    for line in page.splitlines():
        if line.startswith("```"):
            if inside and lines is not None:
                blocks.append(" ".join(" ".join(lines).replace("\\ ", " ").split()))
            inside = not inside
            lines = [] if inside and line == "```" else None
        elif lines is not None:
            lines.append(line)
    return blocks


def test_the_docs_give_the_server_command():
    blocks = plain_blocks((REPO / "docs" / "training.md").read_text())
    for launcher in (("speculators-peagle", "vllm"), ("vllm",)):
        command = served_states.serve_command(
            "/models/Llama-3.1-8B-Instruct", (2, 16, 29), 32, "/shared/hidden-states",
            launcher=launcher,
        )
        assert any(shlex.join(command) in block for block in blocks), command


# ------------------------------------------------ rows without states, no server needed


@pytest.mark.parametrize("order, late", [(("bad", "good", "bad"), {0, 2}),
                                         (("good", "bad", "bad"), {0})])
def test_failures_in_a_row_are_counted_in_the_data_order_not_the_answer_order(
    tmp_path, order, late
):
    """Rows are fetched ahead, together; a good row between two bad ones resets the count
    even when its answer comes first, and two bad rows in a row stop training even when the
    good row before them answers last."""
    config = served_states.GenerationConfig(
        generation_validation_retries=0, max_consecutive_generation_failures=2
    )
    states = served_states.ServedHiddenStates(tmp_path, "target", (0,), 4, 8, config)
    states.attach([{"input_ids": [k, k + 1]} for k in range(len(order))], [2] * len(order))
    states.endpoints = [served_states.Endpoint("http://server/v1", None)]

    def fetch_once(endpoint, token_ids):
        i = int(token_ids[0])
        time.sleep(0.3 if i in late else 0.0)  # the rows in `late` answer last
        if order[i] == "bad":
            raise ValueError("they hold non-finite hidden states")
        return {"token_ids": token_ids, "hidden_states": torch.zeros(len(token_ids), 2, 4)}

    states._fetch_once = fetch_once
    states.prefetch(range(len(order)))
    taken = [states.get_cached(0), states.get_cached(1)]
    if order[1] == "bad":
        with pytest.raises(served_states.ServerFailed, match=r"2 row\(s\) in a row failed"):
            states.get_cached(2)
    else:
        taken.append(states.get_cached(2))
        assert [isinstance(t, dict) for t in taken] == [k == "good" for k in order]



@pytest.fixture(scope="module")
def partial(tiny_workdir_once, tmp_path_factory):
    """The tiny work directory with rows 1 and 3 lacking their hidden-state files."""
    root = shutil.copytree(tiny_workdir_once, tmp_path_factory.mktemp("partial") / "w")
    for i in (1, 3):
        (root / "data" / "hidden_states" / f"hs_{i}.safetensors").unlink()
    return root


def test_skip_and_warn_train_without_the_rows_that_lack_states(partial, tmp_path, caplog):
    skip = build_training(config_for(partial, tmp_path / "s", on_missing="skip", max_steps=1))
    assert set(skip.batches.samples) == set(range(16)) - {1, 3}
    assert skip.batches.data.online.endpoints == []  # no server was contacted
    with caplog.at_level("WARNING"):
        warn = build_training(config_for(partial, tmp_path / "w", on_missing="warn"))
    assert warn.batches.samples == skip.batches.samples
    assert "lacks the hidden states of 2 of 16 rows (first: hs_1.safetensors)" in caplog.text


def test_on_missing_raise_refuses_the_rows_that_lack_states(partial, tmp_path):
    args = train_args(partial, tmp_path / "save", "--max-steps", "1", "--on-missing", "raise")
    line = refusal(*run_cli(args))
    assert "lacks the hidden states of 2 of 16 rows (first: hs_1.safetensors)" in line, line


def test_speculators_generation_group_sets_our_keys(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "train:\n  verifier:\n    verifier_name_or_path: t\n  data:\n    data_path: d\n"
        "  generation:\n    vllm_endpoint: http://h:9000/v1\n    on_missing: warn\n"
        "    max_retries: 0\n    request_timeout: 5\n"
    )
    gen = TrainConfig.from_sources(tmp_path / "run.yaml").generation
    assert gen.vllm_endpoint == ("http://h:9000/v1",) and gen.on_missing == "warn"
    assert (gen.max_retries, gen.request_timeout) == (0, 5.0)
    assert gen.generation_validation_retries == 2 and gen.max_consecutive_generation_failures == 20
    flat = TrainConfig.from_sources(verifier_name_or_path="t", data_path="d",
                                    vllm_endpoint="http://h:9001/v1")
    assert flat.generation.vllm_endpoint == ("http://h:9001/v1",)  # one URL for the list
    for bad in ({"vllm_endpoint": ("h:8000",)}, {"max_consecutive_generation_failures": 0},
                {"on_missing": "ask"}, {"request_timeout": 0}):
        with pytest.raises(UserError):
            served_states.GenerationConfig(**bad)


# ------------------------------------------------------------ a real vllm serve


@pytest.mark.slow
def test_a_wrong_endpoint_another_model_or_no_extraction_is_one_sentence_before_training(
    workdir, tmp_path
):
    nowhere = f"http://127.0.0.1:{psutil_free_port()}"
    line = refusal(*train(workdir, tmp_path / "a", "tokens", "--vllm-endpoint", nowhere))
    assert f"holds token ids but no hidden states (4 rows), and no vLLM server answers at " \
           f"{nowhere}/v1" in line and "--online" in line, line
    with vllm_server(serve(str(workdir / "other"), tmp_path / "hs", extract=False),
                     tmp_path / "plain.log", tmp_path, {"PYTHONPATH": str(REPO)}) as plain:
        line = refusal(*train(workdir, tmp_path / "b", "tokens", "--vllm-endpoint", plain))
        assert f"The vLLM server at {plain}/v1 serves {workdir / 'other'}" in line, line
        assert f"not the verifier {workdir / 'target'}" in line, line
        line = refusal(*train(workdir, tmp_path / "c", "tokens", "--vllm-endpoint", plain,
                              verifier="other"))
        assert f"The vLLM server at {plain}/v1 does not extract hidden states" in line, line
    for save in "abc":
        assert not checkpoint_dirs(tmp_path / save)


@pytest.mark.slow
def test_training_from_a_server_logs_the_losses_of_training_on_the_files(
    workdir, server, on_the_files, tmp_path
):
    base, hs_dir = server
    code, out = train(workdir, tmp_path / "served", "tokens", "--vllm-endpoint", base)
    assert code == 0, out
    offline, served = losses(on_the_files), losses(tmp_path / "served")
    print(f"losses: files {offline}, server {served}")
    assert len(offline) == len(served) == 3
    assert served == pytest.approx(offline, rel=1e-5, abs=1e-6)
    assert not (workdir / "tokens" / "hidden_states").exists()
    assert not list(hs_dir.glob("*.safetensors"))  # fetched files are deleted once read


@pytest.mark.slow
def test_a_fetched_state_of_other_tokens_is_one_sentence_naming_row_and_server(
    workdir, server, tmp_path, monkeypatch
):
    base, _ = server
    checks = []

    def wrong_after_the_check(loaded, token_ids, shape_tail):
        checks.append(len(token_ids))  # the first is the check before training
        return "" if len(checks) == 1 else "holds token ids that differ from its dataset row"

    monkeypatch.setattr(served_states, "sample_problem", wrong_after_the_check)
    line = refusal(*train(workdir, tmp_path / "save", "tokens", "--vllm-endpoint", base, *FAST))
    assert re.search(r"The hidden states of row \d+ from the vLLM server at "
                     + re.escape(base) + r"/v1 failed \(they hold token ids that differ", line)
    assert len(checks) >= 3 and not checkpoint_dirs(tmp_path / "save")  # 2 attempts, no step


@pytest.mark.slow
def test_a_row_that_fails_every_attempt_is_dropped_and_training_goes_on(
    workdir, server, on_the_files, tmp_path, monkeypatch
):
    base, _ = server
    victim = list(map(int, load_from_disk(str(workdir / "tokens"))[0]["input_ids"]))
    tried = []

    def the_victim_fails(loaded, token_ids, shape_tail):
        fails = token_ids.tolist() == victim
        tried.append(fails)
        return "holds non-finite hidden states" if fails else ""

    monkeypatch.setattr(served_states, "sample_problem", the_victim_fails)
    code, out = train(workdir, tmp_path / "save", "tokens", "--vllm-endpoint", base, *FAST[:2],
                      "--generation-validation-retries", "1",
                      "--max-consecutive-generation-failures", "2")
    assert code == 0, out
    dropped = [json.loads(line)["tokens"] for line in open(tmp_path / "save" / METRICS_FILE)]
    full = [json.loads(line)["tokens"] for line in open(on_the_files / METRICS_FILE)]
    short = [f - d for f, d in zip(full, dropped, strict=True) if f != d]
    assert short and set(short) == {len(victim) - 1}  # the steps with the victim lack it
    assert sum(tried) == 2 * len(short)  # two attempts each time


@pytest.mark.slow
def test_two_ranks_from_a_server_log_the_losses_of_two_ranks_on_the_files(
    workdir, server, tmp_path
):
    """torchrun, 2 ranks, each fetching the rows of its own packed rows."""
    base, _ = server

    def torchrun(save, data, *extra):
        args = ["train", "--verifier-name-or-path", str(workdir / "target"), "--data-path",
                str(workdir / data), "--save-path", str(save), "--draft-vocab-size",
                str(DRAFT_VOCAB), "--num-depths", "3", "--total-seq-len", "128", "--seed", "3",
                "--max-steps", "1", "--log-freq", "1", "--device", "cpu", "--optimizer", "adamw",
                *extra]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(psutil_free_port()), "-m", "speculators_peagle_plugin",
               *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr[-5000:]
        return losses(save)

    served = torchrun(tmp_path / "served", "tokens", "--vllm-endpoint", base)
    assert served == pytest.approx(torchrun(tmp_path / "files", "data"), rel=1e-5, abs=1e-6)


def psutil_free_port() -> int:
    from helpers.serve import free_port

    return free_port()


def listening_pid(base: str) -> int:
    port = int(base.rsplit(":", 1)[1])
    (pid,) = {c.pid for c in psutil.net_connections("tcp")
              if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    return pid


@pytest.fixture
def own_server(workdir, tmp_path):
    """A server of the target for one test alone (one that kills it: under xdist's work
    stealing any test of the module may run after it, on the module's server)."""
    env = {"PYTHONPATH": str(REPO)}
    with vllm_server(serve(str(workdir / "target"), tmp_path / "server-states"),
                     tmp_path / "serve.log", workdir, env) as base:
        yield base, tmp_path / "server-states"


@pytest.mark.slow
def test_zz_a_server_killed_mid_run_retries_then_one_sentence_and_the_rerun_resumes(
    workdir, own_server, on_the_files, tmp_path, monkeypatch
):
    """It kills its own server before the second step's rows are read. The rerun fetches
    from a new server at another address."""
    base, _ = own_server
    attempts, fetch_row, read = [], served_states.ServedHiddenStates._fetch_row, RowsAhead._read

    def killing_before_step_two(self, step):
        if step == 1:
            os.killpg(os.getpgid(listening_pid(base)), signal.SIGKILL)
        return read(self, step)

    def counting(self, index, token_ids, failures):
        attempts.append(index)
        return fetch_row(self, index, token_ids, failures)

    monkeypatch.setattr(RowsAhead, "_read", killing_before_step_two)
    monkeypatch.setattr(served_states.ServedHiddenStates, "_fetch_row", counting)
    save = tmp_path / "save"
    line = refusal(*train(workdir, save, "tokens", "--vllm-endpoint", base,
                          "--checkpoint-freq", "0.01", *FAST))
    assert re.search(r"The hidden states of row \d+ from the vLLM server at "
                     + re.escape(base) + r"/v1 failed \(", line), line
    assert "after 2 attempt(s)" in line and "--max-consecutive-generation-failures" in line
    row = int(re.search(r"row (\d+)", line).group(1))
    assert attempts.count(row) == 2  # tried twice
    (kept,) = checkpoint_dirs(save)
    assert kept.name == "checkpoint-1" and load_file(kept / "model.safetensors")
    assert not [p for p in save.rglob("*") if ".tmp" in p.name]
    assert len(losses(save)) == 1
    # The same command, at a new server's address, resumes to the run on the files.
    monkeypatch.undo()
    with vllm_server(serve(str(workdir / "target"), tmp_path / "hs"), tmp_path / "again.log",
                     tmp_path, {"PYTHONPATH": str(REPO)}) as again:
        code, out = train(workdir, save, "tokens", "--vllm-endpoint", again,
                          "--checkpoint-freq", "0.01", *FAST)
    assert code == 0, out
    assert losses(save) == pytest.approx(losses(on_the_files), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("planted", ["server", "bug"])
def test_a_server_fault_at_the_probe_is_one_sentence_and_a_bug_keeps_its_traceback(
    monkeypatch, tmp_path, planted
):
    from speculators.data_generation.vllm_client import InvalidResponseError

    states = served_states.ServedHiddenStates(
        tmp_path, "target", (1, 2), 8, 16, served_states.GenerationConfig()
    )
    states.attach([{"input_ids": [1, 2, 3]}], [3])
    endpoint = served_states.Endpoint("http://127.0.0.1:9", object(), "target")
    monkeypatch.setattr(served_states, "connect", lambda *a: endpoint)

    def fetch_once(endpoint, token_ids):
        raise InvalidResponseError("bad reply") if planted == "server" else TypeError("ours")

    monkeypatch.setattr(states, "_fetch_once", fetch_once)
    expected = served_states.ServerRefused if planted == "server" else TypeError
    with pytest.raises(expected) as raised:
        states.connect()
    assert ("http://127.0.0.1:9" in str(raised.value)) == (planted == "server")
