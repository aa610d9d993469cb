"""Every command in the README and the docs/ pages runs, as written, on a tiny local target.

The ```bash blocks of README.md and then of docs/*.md (in name order) are parsed into
commands; plain ``` blocks are for commands too long to run here (hours) and for output.
``make demo`` is the demo (its CLI command runs in ``test_quick_demo_end_to_end``) and
``make test`` is CI. Every other command runs here: the docs' paths are replaced by tiny
ones, and the flags a tiny CPU run needs are appended (later flags override the YAML's and
the docs': CPU, float32, 2 steps, a draft vocabulary and aux layers the tiny target has).
A command added to a page without a runner here fails ``test_every_command_is_run``.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers.imports import recorded, recording_hook
from helpers.serve import vllm_server
from tiny_vllm import tiny_vllm_target

from speculators_peagle_plugin.engine.engine_start import every_core_binding
from tools import prepare_gpu

REPO = Path(__file__).parent.parent
TARGET = "/models/Llama-3.1-8B-Instruct"
CHECKPOINT = "ckpt/checkpoint-1000"
TINY_TRAIN = ["--device", "cpu", "--dtype", "float32", "--max-steps", "2",
              "--draft-vocab-size", "128", "--target-layer-ids", "1,2,3"]
EXTRA = {  # the flags each README command gets here
    "generate-data": ["--target-layer-ids", "1,2,3", "--max-new-tokens", "24"],
    "train": TINY_TRAIN,
    "torchrun": TINY_TRAIN,
    "check": [],
    "serve": ["--port", "{port}", "--max-model-len", "512", "--dtype", "float32",
              "--enforce-eager", "--max-num-seqs", "4"],
    "eval": ["--max-new-tokens", "16", "--concurrency", "4", "--kv-cache-gb", "1",
             "--in-process", "--enforce-eager", "--out", "{tmp}/eval"],
    "selftest": ["--device", "cpu", "--quick", "--json", "{tmp}/selftest.json"],
    "bench_sampler": ["--sizes", "512", "--repeats", "1"],
    "bench_train_step": ["--seq-lens", "128", "--steps", "1", "--warmup", "0",
                         "--partition-curve-seq-len", "128", "--partitions", "2",
                         "--long-seq-len", "0"],
    "side_by_side": ["--steps", "2"],
    # held out only: the served path is side_by_side's (eval.demo_run.served_acceptance)
    "ablate": ["--steps", "1", "--seeds", "0", "--no-serve"],
    "profile_step": ["-k", "2", "--prompts", "humaneval[120:123]", "--warmup", "1",
                     "--max-new-tokens", "8", "--kv-cache-gb", "1", "--out", "{tmp}/profile",
                     "--enforce-eager"],  # compiled engines: test_eval_vllm's sweep
}
SUBSTITUTE = {
    '"humaneval[120:164]"': "humaneval[120:122]",  # held-out slices, shortened
    "--prompts chat": "--prompts chat[:2]",
    "--prompts mt_bench": "--prompts mt_bench[:2]",
    "-k 2,4,8": "-k 2,8",
    "--nproc_per_node 8": "--nproc_per_node 2",
    "--draft-vocab-size 32000": "--draft-vocab-size 128",
    "--prompts prompts.jsonl --max-new-tokens 512": "--prompts prompts.jsonl[:4] "
    "--max-new-tokens 16",
}


DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme_commands() -> list[str]:
    """The bash commands of the README, then of the docs pages, continuation lines joined,
    comments dropped."""
    text = "\n".join(page.read_text() for page in DOC_PAGES)
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        block = block.replace("\\\n", " ")
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def kind(command: str) -> str:
    words = shlex.split(command)
    if words[0] == "make":
        return " ".join(words[:2])
    if words[1] == "vllm":
        return words[2]
    if words[0].endswith("/torchrun"):
        return "torchrun"
    if words[1:2] == ["-m"]:
        return words[2].rsplit(".", 1)[-1]
    return words[1]


def test_every_command_is_run():
    kinds = [kind(c) for c in readme_commands()]
    assert "make demo" == kinds[0] and "make test" in kinds
    unknown = [k for k in kinds if k not in EXTRA and k not in ("make demo", "make test")]
    assert not unknown, f"README/docs commands with no runner in this test: {unknown}"
    assert sorted(set(EXTRA)) == sorted(k for k in set(kinds) if k in EXTRA)


def test_make_targets_are_the_documented_ones():
    dry = subprocess.run(["make", "-n", "demo", "test"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert "speculators-peagle demo" in dry
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci  # .ci/run is the README's test command
    assert readme_commands()[:2] == ["make demo", "make test"]  # the README's two commands


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny vLLM-servable target as the README's target, and the README's prompts file."""
    root = tmp_path_factory.mktemp("readme")
    target = tiny_vllm_target(root / "target")
    prompts = [{"messages": [{"role": "user", "content": f"Count from {i} to {i + 9}."}]}
               for i in range(12)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (root / "configs").symlink_to(REPO / "configs")  # the README runs from the repo root
    return root, target


def prepared(command: str, root: Path, target: str, **fill) -> list[str]:
    for old, new in SUBSTITUTE.items():
        command = command.replace(old, new)
    bin_dir = f"{REPO / '.venv' / 'bin'}/"
    command = command.replace(TARGET, target).replace(".venv/bin/", bin_dir)
    words = shlex.split(command)
    return words + [w.format(tmp=root, **fill) for w in EXTRA[kind(command)]]


def run(words: list[str], root: Path, timeout: float = 900, env: dict | None = None) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": str(REPO), **(env or {})}
    done = subprocess.run(words, cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{shlex.join(words)}\n{done.stdout[-3000:]}{done.stderr[-5000:]}"
    return done.stdout


def commands_of(kinds: tuple[str, ...]) -> list[str]:
    return [c for c in readme_commands() if kind(c) in kinds]


@pytest.fixture(scope="module")
def trained(workspace):
    """The own-target steps in order: generate-data (README), then train into ckpt/ in one
    process (docs/training.md); the README's torchrun command trains into its own path."""
    root, target = workspace
    (gen,) = commands_of(("generate-data",))
    run(prepared(gen, root, target), root)
    assert (root / "data" / "state.json").is_file()
    (train,) = [c for c in commands_of(("train",)) if "--online" not in c]
    run(prepared(train, root, target), root)
    assert (root / "ckpt" / "checkpoint-2" / "model.safetensors").is_file()
    # The README's checkpoint-1000 stands for the last one: make it that one.
    (root / "ckpt" / "checkpoint-2").rename(root / CHECKPOINT)
    return root, target


@pytest.mark.slow
def test_torchrun_command_trains_on_two_ranks(trained):
    root, target = trained
    (cmd,) = commands_of(("torchrun",))
    words = prepared(cmd, root, target)
    words[words.index("--save-path") + 1] = "ckpt-ddp/"
    run(words, root)
    metrics = [json.loads(line) for line in open(root / "ckpt-ddp" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]


@pytest.mark.slow
def test_online_train_command_writes_no_hidden_states(workspace):
    root, target = workspace
    (online,) = [c for c in commands_of(("train",)) if "--online" in c]
    run(prepared(online, root, target), root)
    save = root / "ckpt-online"
    metrics = [json.loads(line) for line in open(save / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2] and all("target_share" in m for m in metrics)
    tensors = [p.relative_to(save) for p in save.rglob("*.safetensors")]
    assert tensors and all(p.parts[0].startswith("checkpoint-") for p in tensors), tensors


@pytest.mark.slow
def test_check_command_passes_the_trained_checkpoint(trained):
    root, target = trained
    (cmd,) = commands_of(("check",))
    assert "OK: vLLM can serve" in run(prepared(cmd, root, target), root)


@pytest.mark.slow
def test_vllm_serve_command_drafts_in_parallel(trained):
    root, target = trained
    (cmd,) = commands_of(("serve",))
    log = root / "serve.log"
    with vllm_server(lambda port: prepared(cmd, root, target, port=port), log, root) as base:
        body = json.dumps({"model": target, "prompt": "Count from 1 to 10.", "max_tokens": 24,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=300).read())
        assert reply["usage"]["completion_tokens"] == 24
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
        drafts = re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)", metrics, re.M)
        assert drafts and float(drafts.group(1)) > 0, "the server ran no speculative step"
        # the server took the README's config as given (the engine-level check is eval's)
        assert "'parallel_drafting':True" in log.read_text().replace(" ", "")


@pytest.mark.slow
def test_eval_command_measures_acceptance(trained):
    root, target = trained
    (cmd,) = commands_of(("eval",))
    out = run(prepared(cmd, root, target), root)
    record = json.loads((root / "eval" / "record.json").read_text())
    drafted = [r for r in record["runs"] if r["label"] == "checkpoint-1000"]
    assert sorted({(r["prompt_set"], r["k"]) for r in drafted}) == [
        ("humaneval[120:122]", 2), ("humaneval[120:122]", 8), ("mt_bench[:2]", 2),
        ("mt_bench[:2]", 8),
    ]
    assert {r["concurrency"] for r in drafted} == {4}
    assert {r["engine"]["compilation_mode"] for r in record["runs"] if r["engine"]} == {"NONE"}
    assert "measured on uncompiled engines" in out  # its speedups are not vllm serve's
    for r in drafted:  # MT-Bench's first two questions are writing ones
        assert r["per_category"] is None if r["prompt_set"] != "mt_bench[:2]" else (
            r["per_category"]["writing"]["acceptance_length"] == r["acceptance_length"]
        )
    assert record["recommendation"]
    assert all(1.0 <= r["acceptance_length"] <= r["k"] + 1 for r in drafted)
    assert (root / "eval" / "acceptance.png").stat().st_size > 0


@pytest.mark.slow
def test_selftest_command_passes_and_the_gpu_wheels_cover_its_imports(tmp_path):
    """The README's selftest, quick and profiled on CPU, with ours alone at a second length;
    every process it starts imports only what the GPU machine's wheels and image hold."""
    hook, imports = recording_hook(tmp_path)
    (cmd,) = commands_of(("selftest",))
    words = prepared(cmd, tmp_path, "") + ["--ours-seq-lens", "512", "--profile"]
    path = os.pathsep.join([str(hook), str(REPO)])
    out = run(words, tmp_path, env={"IMPORTS_DIR": str(imports), "PYTHONPATH": path})
    lines = out.splitlines()
    assert lines[0].startswith("versions: python") and "speculators 0.9" in lines[0]
    for name in ("attention chunked float32", "attention chunked bfloat16",
                 "training step float32", "training step bfloat16",
                 "partitioned step == flat step", "step ours 256 tokens",
                 "step ours 512 tokens", "step speculators 256 tokens"):
        assert f"PASS {name}: " in out, name
    assert "SKIP torchrun DDP: --quick" in out and "FAIL" not in out
    assert any(line.startswith("ratio 256 tokens: ours ") for line in lines)
    assert "selftest: 8 passed, 0 failed, 2 skipped" in out
    saved = json.loads((tmp_path / "selftest.json").read_text())
    assert saved["passed"] and saved["stack"]["device"] == "cpu"
    assert [c["status"] for c in saved["checks"]].count("PASS") == 8
    assert saved["speed"]["speculators"]["lengths"]["256"]["tokens_per_s"] > 0
    assert "512" not in saved["speed"]["speculators"]["lengths"]  # ours alone runs it
    for side in ("ours", "speculators"):  # one profiled step per side, beside the record
        table = (tmp_path / f"profile-{side}-256.txt").read_text()
        assert "Self CPU" in table and len(table.splitlines()) >= 10

    runs = recorded(imports)
    perf = [r for r in runs if r["argv"][0].endswith("perf.py")]
    assert len(perf) == 2, [r["argv"] for r in runs]  # one process per side
    assert not any(r["vllm"] for r in runs), "the selftest imported vLLM"
    used = {prepare_gpu.normalize(d) for r in runs for d in r["dists"]}
    covered = set(prepare_gpu.wheels_to_ship()) | prepare_gpu.GPU_IMAGE
    assert "speculators" in prepare_gpu.wheels_to_ship()
    assert used - covered - {prepare_gpu.OWN} == set()


@pytest.mark.parametrize("name", ["bench_sampler", "bench_train_step"])
def test_benchmark_commands_run_shortened(name, tmp_path):
    (cmd,) = commands_of((name,))
    words = prepared(cmd, tmp_path, "")
    words[words.index("-m") - 1] = sys.executable
    out = run(words, REPO, timeout=1200)
    # the first table: its row for the one size asked for holds our time, a number
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| "))
    header = [c.strip() for c in lines[first].strip("|").split("|")]
    row = [c.strip() for c in lines[first + 2].strip("|").split("|")]
    assert row[0] in ("512", "128"), lines[first + 2]
    ours = next(i for i, name in enumerate(header) if name.startswith("ours"))
    assert float(row[ours]) > 0, lines[first + 2]


@pytest.mark.slow
@pytest.mark.runs_first
def test_quick_demo_end_to_end_then_side_by_side(tmp_path):
    """``make demo`` runs ``speculators-peagle demo``: here its CI-sized run, every stage for
    real (SmolLM2 data, training, check, vLLM eval), then the side-by-side on its outputs."""
    run_dir = tmp_path / "demo"
    out = run([sys.executable, "-m", "speculators_peagle_plugin", "demo", "--quick",
               "--run-dir", str(run_dir)], REPO, timeout=2400)
    summary = json.loads((run_dir / "demo.json").read_text())
    assert list(summary["stage_seconds"]) == [
        "target", "prompts", "data", "train", "drafts", "check", "eval"
    ]
    record = json.loads(Path(summary["record"]).read_text())
    assert {r["label"] for r in record["runs"]} == {"trained-draft", "no draft"}
    assert {(r["k"], r["concurrency"]) for r in record["runs"]} == {(0, 1), (0, 2), (2, 1), (2, 2)}
    assert {r["concurrency"] for r in summary["recommendation"]} == {1, 2}
    assert "recommendation" in out and all(Path(p).is_file() for p in summary["plots"])
    assert f"run directory: {run_dir.resolve()}" in out
    assert (run_dir / "trained-draft" / "model.safetensors").is_file()
    binding = every_core_binding({})
    if binding is not None:  # a small machine: the eval's engines ran on every core
        logs = "".join(p.read_text() for p in (run_dir / "eval").glob("vllm_worker*.log"))
        assert f"core ids={sorted(map(int, binding.split(',')))}" in logs

    (cmd,) = commands_of(("side_by_side",))
    words = prepared(cmd, tmp_path, "")
    words[words.index("-m") - 1] = sys.executable
    run([*words, "--demo-dir", str(run_dir), "--out", str(tmp_path / "sbs")], REPO, timeout=2400)
    result = json.loads((tmp_path / "sbs" / "side_by_side.json").read_text())["results"]
    for side in ("ours", "theirs"):
        assert result[side]["steps"] == 2 and result[side]["peak_rss_gib"] > 0
        assert set(result[side]["acceptance"]) == set(summary["config"]["eval_prompts"])

    (cmd,) = commands_of(("ablate",))
    words = prepared(cmd, tmp_path, "")
    words[words.index("-m") - 1] = sys.executable
    heldout = summary["config"]["eval_prompts"][0]
    out = run([*words, "--demo-dir", str(run_dir), "--out", str(tmp_path / "ablate"),
               "--heldout", heldout], REPO, timeout=2400)
    record = json.loads((tmp_path / "ablate" / "ablation.json").read_text())
    assert [(c["variant"], c["seed"], c["steps"]) for c in record["cells"]] == [
        ("baseline", 0, 1), ("hard50", 0, 1)
    ]
    for cell in record["cells"]:
        assert cell["served"] == {} and cell["peak_rss_gib"] > 0
        assert list(cell["heldout"]) == [heldout]
        assert 0 <= cell["heldout"][heldout]["accuracy_per_depth"][0] <= 1
        recipe = yaml.safe_load((tmp_path / "ablate" / cell["variant"] / "train.yaml").read_text())
        assert recipe.get("hard_label_weight", 0.0) == (0.5 if cell["variant"] == "hard50" else 0)
    assert f"| held out {heldout}: " in out

    (cmd,) = commands_of(("profile_step",))
    words = prepared(cmd, tmp_path, "")
    words[words.index("-m") - 1] = sys.executable
    words[words.index("--draft") + 1] = str(run_dir / "trained-draft")
    run(words, REPO, timeout=1200)
    plain, drafted = json.loads((tmp_path / "profile" / "profile.json").read_text())["rows"]
    assert plain["k"] is None and plain["tokens_per_step"] == 1.0
    assert plain["ms_per_step"]["draft forward"] == 0 and plain["ms_per_step"]["target forward"] > 0
    assert drafted["k"] == 2 and 1.0 <= drafted["tokens_per_step"] <= 3.0
    assert drafted["ms_per_step"]["draft forward"] > 0
    assert drafted["ms_per_step"]["rejection sampling"] > 0
