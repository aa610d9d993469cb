"""The demo's record of stages (demo/stages.py): skip finished work, refuse other settings,
and count the time of every attempt of a resumed stage."""

import json
import time

import pytest

from speculators_peagle_plugin.demo.stages import SPENT_FILE, STATE_FILE, Stages


def test_stages_skip_finished_work_and_refuse_other_settings(tmp_path):
    calls = []

    def work(tag):
        def run():
            calls.append(tag)
            return {"file": str(tmp_path / f"{tag}.txt")}

        return run

    exists = lambda out: True  # noqa: E731
    stages = Stages(tmp_path, echo=lambda s: None)
    assert stages.run("a", {"x": 1}, work("a1"), exists)["file"].endswith("a1.txt")
    again = Stages(tmp_path, echo=lambda s: None)  # a new invocation reads stages.json
    assert again.run("a", {"x": 1}, work("a2"), exists)["file"].endswith("a1.txt")
    assert calls == ["a1"] and again.ran == {}
    with pytest.raises(ValueError, match=r"'a' stage made with other settings \(x\)"):
        again.run("a", {"x": 2}, work("a3"), exists)
    again.run("a", {"x": 1}, work("a4"), lambda out: False)  # outputs gone: redo
    assert calls == ["a1", "a4"]

    def broken():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        again.run("b", {}, broken, exists)
    assert "b" not in json.loads((tmp_path / STATE_FILE).read_text())


def test_a_resumed_stage_records_the_time_of_every_attempt(tmp_path):
    spent = tmp_path / SPENT_FILE
    seen = []  # the time spent so far, as the ticker (every 0.05 s) wrote it mid-attempt

    def interrupted():
        time.sleep(0.5)
        seen.append(json.loads(spent.read_text())["train"]["seconds"])
        raise KeyboardInterrupt

    def finishing():
        time.sleep(0.1)
        return {}

    def attempt(name, inputs, work, **kw):
        Stages(tmp_path, echo=lambda s: None, **kw).run(name, inputs, work, lambda out: True)

    for n in (1, 2):  # two interrupted attempts, each adding on
        with pytest.raises(KeyboardInterrupt):
            attempt("train", {"x": 1}, interrupted, tick_s=0.05)
        assert 0.05 + 0.5 * (n - 1) <= seen[-1] <= 0.5 * n + 0.3  # counted once each
    second = json.loads(spent.read_text())["train"]["seconds"]
    assert second >= 1.0

    attempt("train", {"x": 1}, finishing)
    record = json.loads((tmp_path / STATE_FILE).read_text())
    assert record["train"]["seconds"] >= second + 0.1
    assert not spent.exists()  # nothing unfinished is left

    def failing():
        time.sleep(0.3)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):  # a failure counts too; other inputs start again
        attempt("data", {"n": 1}, failing)
    assert json.loads(spent.read_text())["data"]["seconds"] >= 0.3
    attempt("data", {"n": 2}, finishing)
    assert json.loads((tmp_path / STATE_FILE).read_text())["data"]["seconds"] < 0.3
