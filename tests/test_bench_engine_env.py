"""``eval.bench_engine_env``: its arms, a cell read from an eval record, and the table."""

import pytest

from eval import bench_engine_env as bench


def run(k, concurrency, tokens_per_s, start=None, acceptance=None):
    return {"k": k, "concurrency": concurrency, "tokens_per_s": tokens_per_s,
            "acceptance_length": acceptance,
            "engine": {"start_s": start} if start is not None else None}


def test_an_arm_names_its_variables_and_a_bare_name_sets_none():
    assert bench.parse_arm("both=VLLM_CPU_OMP_THREADS_BIND=0-1,X=a=b") == (
        "both", {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "X": "a=b"})
    assert bench.parse_arm("auto=") == ("auto", {})
    for bad in ("=X=1", "name=X", "name=X=1,Y"):
        with pytest.raises(SystemExit, match="expected NAME=VAR=VALUE"):
            bench.parse_arm(bad)


def test_the_default_arms_bind_every_allowed_core_in_one_of_them():
    arms = bench.default_arms()
    assert arms["auto"] == {"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_USE_AOT_COMPILE": "1"}
    assert arms["ours"] == {}
    cores = arms["all cores"]["VLLM_CPU_OMP_THREADS_BIND"].split(",")
    assert len(cores) >= 1 and all(c.isdigit() for c in cores)


def test_a_cell_pairs_each_concurrency_s_draft_with_its_plain_run():
    record = {"runs": [run(0, 1, 10.0, start=50.0), run(4, 1, 15.0, start=70.0, acceptance=2.0),
                       run(0, 16, 80.0), run(4, 16, 60.0, acceptance=1.9)]}
    cell = bench.cell_of(record, wall_s=300.0)
    assert cell["wall_s"] == 300.0 and cell["start_s"] == [50.0, 70.0]
    assert cell["c1"] == {"plain_tok_s": 10.0, "draft_tok_s": 15.0, "speedup": 1.5,
                          "acceptance_length": 2.0}
    assert cell["c16"]["speedup"] == pytest.approx(0.75)


def test_the_table_gives_each_arm_s_mean_and_spread_over_its_repeats():
    record = {"runs": [run(0, 1, 10.0, start=50.0), run(4, 1, 15.0, start=70.0)]}
    slow = bench.cell_of(record, 300.0)
    record["runs"][1]["tokens_per_s"] = 12.0
    fast = bench.cell_of(record, 200.0)
    text = bench.table({"auto": {}, "all cores": {}, "unrun": {}},
                       {"auto": [slow, fast], "all cores": [fast]})
    lines = text.splitlines()
    assert lines[0].startswith("| arm | repeats | eval wall (s) |")
    assert lines[2] == "| auto | 2 | 250 +- 71 | 60 +- 0 | 10.0 +- 0.0 | 1.35 +- 0.21x |"
    assert lines[3] == "| all cores | 1 | 200 | 60 | 10.0 | 1.20x |"
    assert len(lines) == 4  # an arm without cells has no row
