"""eval keeps what finished (``OUT/cells.jsonl``): a rerun measures only the missing cells.

No engine starts: a fake worker decodes, deterministically per prompt, counts the jobs it
runs and fails on the job numbered ``fail_at`` as a crashed vLLM would.
"""

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.demo import pipeline as demo
from speculators_peagle_plugin.engine.counters import SpecDecodeCounters
from speculators_peagle_plugin.evaluation import harness, report
from speculators_peagle_plugin.evaluation.cells import CELLS_FILE
from speculators_peagle_plugin.evaluation.eval_config import EvalConfig

SETS = ("chat[:2]", "chat[2:5]")  # 2 and 3 prompts


class FakeWorker:
    """A VllmWorker stand-in: a prompt's figures depend only on the prompt, K and the max
    new tokens. Logs every job; the job numbered ``fail_at`` (from 1) raises."""

    jobs: list = []
    fail_at: int | None = None

    def __init__(self, log_path, in_process=False, kv_cache_gb=None):
        self.fresh = True

    def run(self, job, on_event=None):
        FakeWorker.jobs.append(job)
        if len(FakeWorker.jobs) == FakeWorker.fail_at:
            raise RuntimeError("vLLM could not run the job: the engine core died")
        k = job.num_speculative_tokens or 0
        rngs = [random.Random(f"{p}|{k}|{job.max_tokens}") for p in job.prompts]
        histograms = [[r.randrange(5) for _ in range(k + 1)] for r in rngs] if k else None
        sizes = [r.randrange(1, job.max_tokens + 1) for r in rngs]
        on_event({"event": "progress", "done": len(sizes), "output_tokens": sum(sizes),
                  "wall_s": 1.0, "counters": None})
        engine, self.fresh = ({"k": k} if self.fresh else None), False
        return {
            "counters": SpecDecodeCounters.from_histograms(histograms).to_dict() if k else None,
            "output_tokens": sum(sizes),
            "wall_s": sum(0.01 * n / (1 + 0.3 * k) for n in sizes),
            "time_per_output_token_s": [0.01 / (1 + 0.3 * k)] * len(sizes),
            "accepted_histograms": histograms,
            "outputs": [[len(p), n] for p, n in zip(job.prompts, sizes, strict=True)],
            "engine": engine,
        }

    def close(self):
        pass


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """The harness with the fake worker, no draft check or plots; a draft directory."""
    monkeypatch.setattr(harness, "VllmWorker", FakeWorker)
    monkeypatch.setattr(
        harness, "_check_drafts", lambda config, echo: {d: [] for d in config.drafts}
    )
    monkeypatch.setattr(report, "write_plots", lambda record, out_dir: [])
    monkeypatch.setattr(harness, "stop_token_ids", lambda *a: set())
    monkeypatch.setattr(harness.time, "sleep", lambda s: None)
    # the engines take turns wherever the test says so, GPU or not
    monkeypatch.setattr(EvalConfig, "resolved_interleave", lambda self: self.interleave)
    FakeWorker.jobs, FakeWorker.fail_at = [], None
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    (draft / "model.safetensors").write_bytes(b"weights")
    return draft


def sweep(target, draft, out, fail_at=None, **overrides):
    """eval of no draft + K 1, 2 at c 1, 2 on SETS (12 cells) into ``out``; returns the record
    and the jobs the worker ran (or the RuntimeError raised at job ``fail_at``)."""
    FakeWorker.jobs, FakeWorker.fail_at = [], fail_at
    settings = dict(target=str(target), drafts=(str(draft),), prompt_sets=SETS, ks=(1, 2),
                    concurrency=(1, 2), max_new_tokens=8, output_dir=str(out))
    config = EvalConfig.from_sources(**{**settings, **overrides})
    if fail_at is not None:
        with pytest.raises(RuntimeError, match="engine core died"):
            harness.evaluate(config, echo=lambda line: None)
        return None, FakeWorker.jobs
    return harness.evaluate(config, echo=lambda line: None), FakeWorker.jobs


def saved(out: Path) -> list[list[tuple]]:
    """The units in cells.jsonl: per line, (K, concurrency, prompts) of each cell."""
    lines = (out / CELLS_FILE).read_text().splitlines()
    return [
        [(c["num_speculative_tokens"] or 0, c["batch_size"], c["prompts"])
         for c in json.loads(line)["key"]["cells"]]
        for line in lines
    ]


def comparable(record: dict) -> dict:
    """``record`` less its timing and resume fields (provenance, engine facts, resumed)."""
    record = json.loads(json.dumps(record))
    for name in ("provenance", "resumed_cells"):
        record.pop(name)
    record["config"].pop("output_dir")
    for run in record["runs"]:
        del run["engine"], run["resumed"]
    return record


# The plans, in the order the worker runs them (prompt sets a: 2 prompts, b: 3 prompts; a
# cell is (K, concurrency, prompts) in the lists below).
# In turns: a's c=1 cells one prompt each (K 0, 1, 2; 6 jobs), b's (9 jobs), then the c=2
# cells whole, by engine: K0 a, K0 b, K1 a, K1 b, K2 a, K2 b (jobs 16-21).
# One after another: by engine, each c=1 a, c=1 b, c=2 a, c=2 b (jobs 1-12).
CASES = {
    # in turns, crash in b's turns: only a's c=1 unit (3 cells on one line) was finished
    "turns, crash at 8": (True, 8, [[(0, 1, 2), (1, 1, 2), (2, 1, 2)]], 9 + 6, {0, 1, 2}),
    # in turns, crash on K1's first c=2 cell: both c=1 units and K0's c=2 cells finished;
    # the no-draft engine is not started again
    "turns, crash at 18": (
        True, 18,
        [[(0, 1, 2), (1, 1, 2), (2, 1, 2)], [(0, 1, 3), (1, 1, 3), (2, 1, 3)],
         [(0, 2, 2)], [(0, 2, 3)]],
        4, {1, 2},
    ),
    # one after another, crash on K1's c=1 b cell: K0's 4 cells and K1's c=1 a, alone each
    "whole, crash at 6": (
        False, 6, [[(0, 1, 2)], [(0, 1, 3)], [(0, 2, 2)], [(0, 2, 3)], [(1, 1, 2)]], 7, {1, 2},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_rerun_after_a_crash_measures_only_the_missing_cells(fake, target, tmp_path, case):
    in_turns, fail_at, units, rerun_jobs, rerun_engines = CASES[case]
    whole, whole_jobs = sweep(target, fake, tmp_path / "whole", interleave=in_turns)
    assert whole["resumed_cells"] == 0 and len(whole_jobs) == (21 if in_turns else 12)
    out = tmp_path / "out"
    sweep(target, fake, out, fail_at=fail_at, interleave=in_turns)
    assert saved(out) == units and not (out / "record.json").exists()
    record, jobs = sweep(target, fake, out, interleave=in_turns)
    assert len(jobs) == rerun_jobs
    assert {job.num_speculative_tokens or 0 for job in jobs} == rerun_engines
    assert record["resumed_cells"] == sum(map(len, units))
    assert [r["resumed"] for r in record["runs"]].count(True) == record["resumed_cells"]
    assert comparable(record) == comparable(whole)
    written = [json.loads((d / "record.json").read_text()) for d in (out, tmp_path / "whole")]
    assert comparable(written[0]) == comparable(written[1])
    # every cell is there now: a third run measures nothing and starts no engine
    again, jobs = sweep(target, fake, out, interleave=in_turns)
    assert jobs == [] and again["resumed_cells"] == 12
    assert comparable(again) == comparable(whole)


def test_a_line_cut_short_is_dropped_and_its_cell_measured_again(fake, target, tmp_path):
    out = tmp_path / "out"
    sweep(target, fake, out, fail_at=18)
    path = out / CELLS_FILE
    text = path.read_text()
    last = text.rstrip("\n").rsplit("\n", 1)[1]
    path.write_text(text[: len(text) - len(last) // 2 - 1])  # killed mid-write: K0 b c=2
    record, jobs = sweep(target, fake, out)
    assert [(j.num_speculative_tokens or 0, j.batch_size, len(j.prompts)) for j in jobs] == [
        (0, 2, 3), (1, 2, 2), (1, 2, 3), (2, 2, 2), (2, 2, 3)
    ]
    assert record["resumed_cells"] == 7
    lines = path.read_text().splitlines()
    assert len(lines) == 3 + 5 and all(json.loads(line) for line in lines)


def test_other_settings_or_another_draft_are_measured_again(fake, target, tmp_path):
    out = tmp_path / "out"
    sweep(target, fake, out)
    longer, jobs = sweep(target, fake, out, max_new_tokens=16)
    assert len(jobs) == 21 and longer["resumed_cells"] == 0
    # the old cells stay: back to the old settings, nothing is measured
    _, jobs = sweep(target, fake, out)
    assert jobs == []
    # a retrained draft at the same path: every cell with the draft is measured again, and
    # the c=1 baselines with it, since they took turns with it; the c=2 baselines stand
    (fake / "model.safetensors").write_bytes(b"retrained weights")
    retrained, jobs = sweep(target, fake, out)
    assert len(jobs) == 6 + 9 + 4 and retrained["resumed_cells"] == 2
    assert [(r["k"], r["concurrency"]) for r in retrained["runs"] if r["resumed"]] == [(0, 2)] * 2
    # a cell's key: the draft's hash, the exact prompts, and the engine's settings
    key = json.loads((out / CELLS_FILE).read_text().splitlines()[-1])["key"]["cells"][0]
    assert key["draft_sha256"] == report.checkpoint_hash(fake) and key["max_tokens"] == 8
    for name in ("prompt_set_sha256", "prompts_sha256", "target_config_sha256", "kv_cache_gb",
                 "vllm", "dtype", "enforce_eager", "max_num_seqs", "batch_size"):
        assert name in key


def test_a_demo_rerun_after_an_eval_failure_measures_only_the_missing_cells(
    fake, target, tmp_path, monkeypatch
):
    """The demo's eval stage, its eval command run in this process with the fake worker."""

    def command(args, echo, stage):
        result = CliRunner().invoke(main, args)
        if result.exit_code != 0:
            raise demo.DemoError(f"stage '{stage}' failed: {result.output}")

    monkeypatch.setattr(demo, "_command", command)
    config = demo.quick_config(run_dir=str(tmp_path / "run"))
    layout = demo.RunLayout(Path(config.run_dir))
    layout.root.mkdir()
    layout.trained_draft.symlink_to(fake)

    def eval_stage():
        stages = demo.Stages(layout.root, echo=lambda line: None)
        return demo._eval_stage(config, stages, layout, lambda line: None, target, "ckpt",
                                "float32")

    # in turns: each set's c=1 no draft and K=2 (1 prompt each, jobs 1-4), then c=2 whole:
    # K0 a, K0 b, K2 a, K2 b; the crash on K2's first c=2 cell leaves 6 of the 8 cells
    FakeWorker.jobs, FakeWorker.fail_at = [], 7
    with pytest.raises(demo.DemoError, match="stage 'eval' failed"):
        eval_stage()
    FakeWorker.jobs, FakeWorker.fail_at = [], None
    outputs = eval_stage()
    assert [(j.num_speculative_tokens, j.batch_size) for j in FakeWorker.jobs] == [(2, 2)] * 2
    record = json.loads(Path(outputs["record"]).read_text())
    assert record["resumed_cells"] == 6 and len(record["runs"]) == 8
    FakeWorker.jobs = []
    assert eval_stage() == outputs and FakeWorker.jobs == []  # finished: skipped
