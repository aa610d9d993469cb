"""eval/ablate.py's arithmetic: variant parsing, mean and spread over seeds, the noise bar."""

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eval import ablate  # noqa: E402


def cell(variant, seed, acceptance, depth0, train_s):
    return {
        "variant": variant, "seed": seed, "train_s": train_s, "peak_rss_gib": 1.0,
        "served": {"mt_bench": {"acceptance_length": acceptance, "per_position": [0.5, 0.2]}},
        "heldout": {"chat": {"acceptance_length": 1 + depth0, "accuracy_per_depth": [depth0]}},
    }


def test_variants_parse_as_train_settings_with_yaml_values():
    assert ablate.parse_variant(["base"]) == ("base", {})
    name, overrides = ablate.parse_variant(
        ["deep", "num_depths=6", "max-anchors=null", "hard_label_weight=0.5"]
    )
    assert (name, overrides) == ("deep", {"num_depths": 6, "max_anchors": None,
                                          "hard_label_weight": 0.5})
    for bad in (["x", "num_depht=3"], ["x", "lr"], ["a b"]):
        with pytest.raises(SystemExit):
            ablate.parse_variant(bad)


@pytest.mark.parametrize("seed", range(3))
def test_summary_is_the_mean_and_sample_spread_and_the_bar_is_twice_the_larger(seed):
    import random

    rng = random.Random(seed)
    base = [1.5 + rng.uniform(-0.01, 0.01) for _ in range(3)]
    better = [1.7 + rng.uniform(-0.01, 0.01) for _ in range(3)]
    close = [b + rng.uniform(-0.001, 0.001) for b in base]
    cells = [cell("base", s, a, 0.4, 10.0 + s) for s, a in enumerate(base)]
    cells += [cell("better", s, a, 0.5, 12.0) for s, a in enumerate(better)]
    cells += [cell("close", s, a, 0.4, 9.0) for s, a in enumerate(close)]
    summary = ablate.summarise(cells, ["base", "better", "close"])
    got = summary["better"]["served mt_bench: acceptance length"]
    assert got["mean"] == pytest.approx(sum(better) / 3, abs=1e-12)
    assert got["std"] == pytest.approx(statistics.stdev(better), abs=1e-12) and got["n"] == 3
    assert summary["base"]["train s"]["std"] == pytest.approx(1.0)  # 10, 11, 12
    rows = {r.split("|")[1].strip(): r for r in ablate.table(summary, ["base", "better", "close"])
            .splitlines()[2:]}
    row = rows["served mt_bench: acceptance length"].split("|")
    assert "*)" in row[3] and f"Δ {sum(better) / 3 - sum(base) / 3:+.3f}" in row[3]
    assert "*" not in row[4]  # within twice the spread: not a win
    assert "served mt_bench: position 2" in rows and "held out chat: accuracy depth 0" in rows


def test_one_seed_never_clears_the_bar():
    cells = [cell("base", 0, 1.5, 0.4, 1.0), cell("other", 0, 2.5, 0.6, 1.0)]
    text = ablate.table(ablate.summarise(cells, ["base", "other"]), ["base", "other"])
    assert "Δ +1.000)" in text and "*" not in text


def test_only_the_demos_own_recipe_seed_and_steps_reuse_its_training():
    demo = {"steps_demo": None, "trained": {"checkpoint": "c", "train_s": 1.0, "seed": 42}}
    assert ablate.demo_trained_it(demo, {}, 42, None)
    assert not ablate.demo_trained_it(demo, {"tv_weight": 1.0}, 42, None)
    assert not ablate.demo_trained_it(demo, {}, 0, None)
    assert not ablate.demo_trained_it(demo, {}, 42, 100)
    assert not ablate.demo_trained_it({**demo, "trained": None}, {}, 42, None)


def test_a_variant_with_data_path_trains_and_is_judged_on_that_data(tmp_path, monkeypatch):
    import types

    import yaml

    demo_yaml = tmp_path / "demo.yaml"
    demo_yaml.write_text(yaml.safe_dump({"algorithm": "peagle", "num_depths": 4}))
    demo = {"target": str(tmp_path / "target"), "data": str(tmp_path / "demo-data"),
            "config": str(demo_yaml), "steps_demo": None,
            "trained": {"checkpoint": "c", "train_s": 1.0, "seed": 42}}
    trained, judged = [], []

    def fake_train(demo, config_yaml, data, save, seed, steps):
        trained.append(data)
        save.mkdir(parents=True)
        return {"checkpoint": str(save / "checkpoint-1"), "train_s": 1.0}

    def fake_heldout(checkpoint, config, path):
        judged.append(config.data.data_path)
        return {}

    monkeypatch.setattr(ablate, "_train", fake_train)
    monkeypatch.setattr(ablate, "served_acceptance", lambda demo, drafts, *a: {drafts[0]: {}})
    monkeypatch.setattr("speculators_peagle_plugin.training.heldout.heldout_metrics",
                        fake_heldout)
    args = types.SimpleNamespace(out=str(tmp_path / "out"), steps=None, eval_prompts=[], serve=True)
    other = tmp_path / "other-data"
    for variant in (("base", {}), ("t03", {"data_path": str(other)}), ("e3", {"epochs": 3})):
        ablate.run_cell(demo, args, variant, 0, {"humaneval": tmp_path / "heldout"})
    assert trained == [demo["data"], str(other), demo["data"]]
    assert judged == trained


@pytest.mark.parametrize("steps", [7, 1740])
def test_steps_given_are_trained_exactly_by_every_arm(tmp_path, monkeypatch, steps):
    """``max_steps`` only caps the epochs: an arm whose data packs into fewer rows would stop
    sooner, so --steps raises the epochs too (a variant's own ``epochs`` stays)."""
    import types

    import yaml

    from speculators_peagle_plugin.training.train_config import TrainConfig

    demo_yaml = tmp_path / "demo.yaml"
    demo_yaml.write_text(yaml.safe_dump({"algorithm": "peagle", "epochs": 3}))
    demo = {"target": str(tmp_path / "target"), "data": str(tmp_path / "demo-data"),
            "config": str(demo_yaml), "steps_demo": None, "trained": None}
    trained = {}

    def fake_train(demo, config_yaml, data, save, seed, steps):
        schedule = TrainConfig.from_sources(
            str(config_yaml), verifier_name_or_path="t", data_path="d", save_path=str(save)
        ).trainer.schedule
        trained[save.parent.parent.name] = (steps, schedule.epochs)
        save.mkdir(parents=True)
        return {"checkpoint": str(save / "checkpoint-1"), "train_s": 1.0}

    monkeypatch.setattr(ablate, "_train", fake_train)
    monkeypatch.setattr("speculators_peagle_plugin.training.heldout.heldout_metrics",
                        lambda *a: {})
    args = types.SimpleNamespace(out=str(tmp_path / "out"), steps=steps, eval_prompts=[],
                                 serve=False)
    for variant in (("base", {}), ("other", {"data_path": str(tmp_path / "other")}),
                    ("e5", {"epochs": 5}), ("long", {"max_steps": 2 * steps})):
        ablate.run_cell(demo, args, variant, 0, {})
    assert trained == {"base": (steps, steps), "other": (steps, steps), "e5": (steps, 5),
                       "long": (2 * steps, 2 * steps)}


def test_a_screened_cell_is_served_later_without_training_again(tmp_path, monkeypatch):
    import json
    import types

    import yaml

    demo_yaml = tmp_path / "demo.yaml"
    demo_yaml.write_text(yaml.safe_dump({"algorithm": "peagle", "num_depths": 4}))
    demo = {"target": str(tmp_path / "target"), "data": str(tmp_path / "demo-data"),
            "config": str(demo_yaml), "steps_demo": None, "trained": None}
    calls = []

    def fake_train(demo, config_yaml, data, save, seed, steps):
        calls.append("train")
        save.mkdir(parents=True)
        return {"checkpoint": str(save / "checkpoint-1"), "train_s": 1.0, "peak_rss_gib": 1.0}

    def fake_serve(demo, drafts, prompts, out):
        calls.append("serve")
        return {drafts[0]: {"mt_bench": {"acceptance_length": 1.4, "per_position": [0.4]}}}

    monkeypatch.setattr(ablate, "_train", fake_train)
    monkeypatch.setattr(ablate, "served_acceptance", fake_serve)
    monkeypatch.setattr(
        "speculators_peagle_plugin.training.heldout.heldout_metrics",
        lambda *a: {"accuracy_per_depth": [0.5], "acceptance_length": 1.5},
    )
    args = types.SimpleNamespace(out=str(tmp_path / "out"), steps=None, eval_prompts=["x"])
    variant = ("lr2", {"lr": 0.002})
    screened = ablate.run_cell(demo, types.SimpleNamespace(**vars(args), serve=False), variant,
                               0, {"chat": tmp_path / "heldout"})
    assert calls == ["train"] and screened["served"] == {}
    assert "served mt_bench: acceptance length" not in ablate.figures(screened)
    for _ in range(2):  # served once, then finished
        served = ablate.run_cell(demo, types.SimpleNamespace(**vars(args), serve=True), variant,
                                 0, {"chat": tmp_path / "heldout"})
    assert calls == ["train", "serve"]
    assert served["heldout"] == screened["heldout"] and served["served"]["mt_bench"]
    on_disk = json.loads((tmp_path / "out" / "lr2" / "seed-0" / "cell.json").read_text())
    assert on_disk == served


def _lane_demo(tmp_path, monkeypatch, cores):
    """ablate.main's inputs faked: ``cores`` to run on, a demo, held-out data, and a
    ``run_cell`` that writes a cell (recording the lane that ran it) unless it is there."""
    import json
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    monkeypatch.setattr(ablate, "demo_inputs", lambda path: {"eval_prompts": ["mt_bench"]})
    monkeypatch.setattr(ablate, "_heldout_data", lambda demo, spec, out: out / "heldout")
    ran = []

    def fake_run_cell(demo, args, variant, seed, heldout):
        done = ablate._cell_dir(args.out, variant[0], seed) / "cell.json"
        if not done.is_file():
            ran.append((variant[0], seed, args.lane))
            done.parent.mkdir(parents=True)
            done.write_text(json.dumps(cell(variant[0], seed, 1.5 + seed / 100, 0.5, 1.0)))
        return json.loads(done.read_text())

    monkeypatch.setattr(ablate, "run_cell", fake_run_cell)
    return ran


def _lanes_in_this_process(monkeypatch, failing=None) -> list:
    """Each lane run in this process (``ablate.main`` under its arguments) instead of a
    process of its own; the lane ``failing`` (``k/N``) exits 1 without running. Returns the
    ``(environment, cores)`` each lane was started with."""
    started = []

    class Lane:
        def __init__(self, cmd, env, cores, log):
            assert cmd[1:3] == ["-m", "eval.ablate"]
            started.append((env, cores))
            self.returncode = 1 if cmd[-1] == failing else 0
            if not self.returncode:
                saved, sys.argv = sys.argv, ["ablate", *cmd[3:]]
                try:
                    ablate.main()
                finally:
                    sys.argv = saved

        def poll(self):
            return self.returncode

    monkeypatch.setattr(ablate, "start_on_cores", Lane)
    return started


@pytest.mark.parametrize("lanes, cores", [(2, [0, 1]), (3, [2, 3, 5, 7])])
def test_lanes_run_each_cell_once_on_cores_of_their_own_and_the_parent_sums_up(
    tmp_path, monkeypatch, lanes, cores
):
    import json

    ran = _lane_demo(tmp_path, monkeypatch, cores)
    argv = ["ablate", "--variant", "a", "--variant", "b", "lr=0.002", "--seeds", "0,1,2",
            "--out", str(tmp_path / "out"), "--lanes", str(lanes)]
    started = _lanes_in_this_process(monkeypatch)
    monkeypatch.setattr(sys, "argv", argv)
    ablate.main()
    jobs = [(v, s) for s in (0, 1, 2) for v in ("a", "b")]
    assert sorted((v, s) for v, s, _ in ran) == sorted(jobs)
    for v, s, lane in ran:  # lane k runs the cells k, k + lanes, ... (seed-major)
        assert lane == f"{jobs.index((v, s)) % lanes}/{lanes}"
    # each lane's threads, its engines' binding and its affinity: the same cores, no two lanes'
    shares = [mine for _, mine in started]
    assert sorted(c for mine in shares for c in mine) == cores
    for env, mine in started:
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, mine))
        assert env["OMP_NUM_THREADS"] == str(len(mine))
    record = json.loads((tmp_path / "out" / "ablation.json").read_text())
    assert len(record["cells"]) == len(jobs)
    assert record["summary"]["b"]["served mt_bench: acceptance length"]["n"] == 3


def test_a_failed_lane_is_named_with_its_log_and_the_others_cells_are_kept(
    tmp_path, monkeypatch
):
    ran = _lane_demo(tmp_path, monkeypatch, [0, 1])
    _lanes_in_this_process(monkeypatch, failing="1/2")
    monkeypatch.setattr(sys, "argv", ["ablate", "--variant", "a", "--variant", "b", "lr=0.002",
                                      "--seeds", "0", "--out", str(tmp_path / "out"),
                                      "--lanes", "2"])
    with pytest.raises(SystemExit) as stop:
        ablate.main()
    log = tmp_path / "out" / "lanes" / "lane-1.log"
    assert str(stop.value) == (
        f"lane 1 (exit 1, log {log}) failed; rerun the same command to resume."
    )
    assert ran == [("a", 0, "0/2")]
    assert not (tmp_path / "out" / "ablation.json").exists()


@pytest.mark.parametrize("lanes", [0, 3])
def test_lanes_past_the_cores_are_refused_before_anything_runs(tmp_path, monkeypatch, lanes):
    _lane_demo(tmp_path, monkeypatch, [0, 1])
    monkeypatch.setattr(ablate, "demo_inputs", lambda path: pytest.fail("it ran"))
    monkeypatch.setattr(sys, "argv", ["ablate", "--out", str(tmp_path), "--lanes", str(lanes)])
    with pytest.raises(SystemExit) as stop:
        ablate.main()
    assert str(stop.value) == (
        f"--lanes {lanes}: a lane needs a core of its own and this machine has 2; use 1 to 2."
    )


def test_the_lanes_benchmark_rates_a_training_by_its_steps_after_the_warm_up(tmp_path):
    import json

    from eval import bench_lanes

    steps = [{"step": i + 1, "tokens": 100.0 + i, "wall_s": 2.0 * (i + 1) + i * i / 10}
             for i in range(8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    timed = steps[3:]  # after 3 warm-up steps: from the end of step 3 to the end of step 8
    expected = sum(r["tokens"] for r in timed) / (steps[-1]["wall_s"] - steps[2]["wall_s"])
    assert bench_lanes.rate(tmp_path, 3) == pytest.approx(expected)
    assert bench_lanes.rate(tmp_path, 0) == pytest.approx(
        sum(r["tokens"] for r in steps) / steps[-1]["wall_s"])
    with pytest.raises(SystemExit, match="has 8 steps; --steps must exceed --skip"):
        bench_lanes.rate(tmp_path, 8)
