"""``eval.bench_served``: its figures from a metrics log, the token-id copy, and (slow) the
whole benchmark shortened on the tiny target with real ``vllm serve`` processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.training import run_cli
from tiny_vllm import LAYER_IDS, PROMPTS, tiny_vllm_target

from eval import bench_served

REPO = Path(__file__).resolve().parents[1]


def write_metrics(path: Path, walls, tokens, losses) -> Path:
    lines = [
        json.dumps({"step": i + 1, "wall_s": w, "tokens": t, "loss": loss, "data_share": 0.25})
        for i, (w, t, loss) in enumerate(zip(walls, tokens, losses, strict=True))
    ]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_figures_time_the_steps_after_the_warmup(tmp_path):
    metrics = write_metrics(tmp_path / "m.jsonl", [1.0, 2.0, 4.0], [10, 10, 30], [3, 2, 1])
    got = bench_served.figures(metrics, warmup=1)
    assert got["tokens_per_s"] == pytest.approx(40 / 3)  # steps 2-3: 40 tokens in 3 s
    assert got["steps"] == 3 and got["final_loss"] == 1 and got["data_share"] == 0.25
    assert bench_served.figures(metrics, warmup=0)["tokens_per_s"] == pytest.approx(50 / 4)
    with pytest.raises(SystemExit, match="no step after the 3 warm-up"):
        bench_served.figures(metrics, warmup=3)


def test_losses_are_compared_with_the_files_arm_at_the_same_seed():
    cells = [
        {"arm": "files", "seed": 0, "losses": [3.0, 2.0]},
        {"arm": "files", "seed": 1, "losses": [5.0, 4.0]},
        {"arm": "2 servers", "seed": 0, "losses": [3.0, 2.5]},
        {"arm": "2 servers", "seed": 1, "losses": [5.0, 4.0]},
    ]
    bench_served.compare_losses(cells)
    assert [c["max_loss_diff"] for c in cells] == [0.0, 0.0, 0.5, 0.0]
    assert bench_served.arm_name(0) == "files" and bench_served.arm_name(1) == "1 server"


def test_the_token_copy_leaves_the_hidden_states_out(tmp_path):
    data = tmp_path / "data"
    (data / "hidden_states").mkdir(parents=True)
    (data / "hidden_states" / "hs_0.safetensors").write_bytes(b"x")
    (data / "data-00000-of-00001.arrow").write_bytes(b"rows")
    out = bench_served.token_ids_only(data, tmp_path / "tokens")
    assert sorted(p.name for p in out.iterdir()) == ["data-00000-of-00001.arrow"]
    (data / "more").write_text("")
    assert bench_served.token_ids_only(data, out) == out and not (out / "more").exists()


def test_the_state_bytes_are_counted_per_token_of_the_rows(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"seq_len": [3, 5]}).save_to_disk(str(tmp_path))
    (tmp_path / "hidden_states" / "0").mkdir(parents=True)
    (tmp_path / "hidden_states" / "0" / "a.safetensors").write_bytes(b"x" * 80)
    (tmp_path / "hidden_states" / "b.safetensors").write_bytes(b"x" * 16)
    assert bench_served.state_bytes_per_token(tmp_path) == 96 / 8


def test_the_arms_run_files_then_online_then_each_server_count():
    args = bench_served._parse_args(["--servers", "2", "1", "--online"])
    assert bench_served.arms(args) == ["files", "online", "1 server", "2 servers"]
    assert bench_served.arms(bench_served._parse_args([])) == ["files", "1 server", "2 servers"]


def test_inputs_come_from_the_flags_together_or_the_demo_dir(tmp_path):
    args = bench_served._parse_args(["--target", "t", "--demo-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="go together"):
        bench_served.bench_inputs(args)
    with pytest.raises(SystemExit, match="holds no finished demo"):
        bench_served.bench_inputs(bench_served._parse_args(["--demo-dir", str(tmp_path)]))


@pytest.mark.slow
def test_the_benchmark_runs_shortened_on_the_tiny_target(tmp_path):
    """Files, the target in process and 1 server, 2 steps (one engine start): the same
    losses (the in-process target's states round otherwise than vLLM's)."""
    tiny_vllm_target(tmp_path / "target", seed=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:4]))
    layers = ",".join(map(str, LAYER_IDS))
    code, out = run_cli(
        f"generate-data --target {tmp_path}/target --prompts {prompts} --output {tmp_path}/data "
        f"--max-new-tokens 12 --target-layer-ids {layers} --draft-vocab-size 64".split()
    )
    assert code == 0, out
    (tmp_path / "train.yaml").write_text(
        "draft_vocab_size: 64\nnum_depths: 3\ntotal_seq_len: 128\nlr: 0.01\nseed: 3\n"
        "device: cpu\ndtype: float32\noptimizer: adamw\n"  # as test_served_states.train
    )
    cmd = [sys.executable, "-m", "eval.bench_served"] + (
        f"--target {tmp_path}/target --data {tmp_path}/data --config {tmp_path}/train.yaml "
        f"--steps 2 --warmup 1 --servers 1 --enforce-eager --online --out {tmp_path}/out"
    ).split()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    record = json.loads((tmp_path / "out" / "bench_served.json").read_text())
    assert record["arms"] == ["files", "online", "1 server"] and record["seeds"] == [3]
    assert record["state_bytes_per_token"] > 0
    assert record["provenance"]["argv"] and record["steps"] == 2
    cells = record["cells"]
    arms = [(c["arm"], c["steps"]) for c in cells]
    assert arms == [("files", 2), ("online", 2), ("1 server", 2)]
    for cell in cells:
        assert cell["tokens_per_s"] > 0
        rel = 1e-3 if cell["arm"] == "online" else 1e-5
        assert cell["losses"] == pytest.approx(cells[0]["losses"], rel=rel, abs=1e-6)
    assert "| 1 server | 3 | 2 |" in done.stdout
