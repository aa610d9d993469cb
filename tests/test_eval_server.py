"""eval --server: vLLM's Prometheus counters read back, cells measured over HTTP, and the
eval command against fake servers (fast) and a real ``vllm serve`` (slow)."""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.serve import last_core, vllm_server
from prometheus_client import CollectorRegistry, Counter, generate_latest
from tiny_vllm import trained_target_and_draft

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.engine.counters import SpecDecodeCounters
from speculators_peagle_plugin.evaluation.server import (
    ServerError,
    probe_server,
    run_server_cell,
)

REPO = Path(__file__).parent.parent


def metrics_page(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int],
                 engines: int = 1) -> str:
    """A /metrics page written by prometheus_client as vLLM's PrometheusStatLogger writes
    it: each counter labelled by engine and model, the per-position one also by position."""
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    for name, value in zip(names, (drafts, draft_tokens, accepted), strict=True):
        counter = Counter(f"vllm:spec_decode_{name}", name, labels, registry=registry)
        for e in range(engines):
            counter.labels(str(e), "m").inc(value)
    per = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per pos",
                  labels + ["position"], registry=registry)
    for e in range(engines):
        for pos, value in enumerate(per_pos):
            per.labels(str(e), "m", str(pos)).inc(value)
    plain = Counter("vllm:prompt_tokens", "prompt tokens", labels, registry=registry)
    plain.labels("0", "m").inc(7)
    return generate_latest(registry).decode()


@pytest.mark.parametrize("engines", [1, 2])
def test_counters_are_read_from_the_prometheus_page(engines):
    got = SpecDecodeCounters.from_prometheus(metrics_page(5, 15, 7, [4, 2, 1], engines))
    want = SpecDecodeCounters(5 * engines, 15 * engines, 7 * engines, [4 * engines, 2 * engines,
                                                                      1 * engines])
    assert got == want
    assert got.acceptance_length == pytest.approx(1 + 7 / 5)


def test_a_server_without_a_draft_has_no_counters():
    registry = CollectorRegistry()
    Counter("vllm:prompt_tokens", "prompt tokens", ["engine"], registry=registry).labels("0").inc()
    assert (
        SpecDecodeCounters.from_prometheus(generate_latest(registry).decode()).accepted_per_pos
        == []
    )


class FakeVllm(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that drafts K=2: each request replies with the prompt
    reversed, in chunks of two tokens, and counts one draft per chunk accepting one."""

    state = {"drafts": 0, "accepted": 0, "requests": []}
    drafting = True

    def log_message(self, *args):
        pass

    def _send(self, body: bytes, kind="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        s = self.state
        if self.path == "/v1/models":
            self._send(json.dumps({"data": [{"id": "tiny"}]}).encode())
        elif self.path == "/metrics":
            page = metrics_page(s["drafts"], 2 * s["drafts"], s["accepted"], [s["accepted"], 0])
            if not self.drafting:  # vLLM registers no spec-decode counter without a draft
                page = "\n".join(line for line in page.splitlines() if "spec_decode" not in line)
            self._send(page.encode(), "text/plain")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.state["requests"].append(body)
        reply = list(reversed(body["prompt"]))[: body["max_tokens"]]
        chunks = [reply[i : i + 2] for i in range(0, len(reply), 2)]
        self.state["drafts"] += len(chunks)
        self.state["accepted"] += len(chunks)
        lines = [f"data: {json.dumps({'choices': [{'token_ids': c}]})}\n\n" for c in chunks]
        self._send(("".join(lines) + "data: [DONE]\n\n").encode(), "text/event-stream")


class PlainVllm(FakeVllm):
    """The same server without a draft."""

    state = {"drafts": 0, "accepted": 0, "requests": []}
    drafting = False


def serve(handler) -> tuple[ThreadingHTTPServer, str]:
    handler.state = {"drafts": 0, "accepted": 0, "requests": []}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.fixture
def fake_server():
    httpd, url = serve(FakeVllm)
    yield url
    httpd.shutdown()


@pytest.fixture
def fake_servers():
    """A drafting and a plain fake server: their URLs."""
    (drafting, url), (plain, plain_url) = serve(FakeVllm), serve(PlainVllm)
    yield url, plain_url
    drafting.shutdown()
    plain.shutdown()


@pytest.mark.parametrize("concurrency", [1, 3])
def test_a_cell_on_a_server(fake_server, concurrency):
    server = probe_server(fake_server + "/", "mine")
    assert (server.url, server.label, server.model, server.k) == (fake_server, "mine", "tiny", 2)
    FakeVllm.state.update(drafts=10, accepted=4)  # traffic before the cell is not counted
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9]]
    seen = []
    result = run_server_cell(server, prompts, concurrency, 4, {0}, on_progress=seen.append)
    assert result["outputs"] == [[5, 4, 3, 2], [8, 7, 6], [9]]
    assert result["output_tokens"] == 8 and len(seen) == 3 and seen[-1]["output_tokens"] == 8
    assert result["counters"] == {"num_drafts": 5, "num_draft_tokens": 10,
                                  "num_accepted_tokens": 5, "accepted_per_pos": [5, 0]}
    assert len(result["time_per_output_token_s"]) == 2  # a one-token reply has no interval
    sent = FakeVllm.state["requests"][0]
    assert sent["temperature"] == 0.0 and sent["stop_token_ids"] == [0] and sent["stream"]
    assert sent["model"] == "tiny" and sent["return_token_ids"]


@pytest.mark.parametrize("url", ["http://127.0.0.1:9", "127.0.0.1:8000"])
def test_an_unusable_server_is_one_sentence(url):
    with pytest.raises(ServerError) as info:
        probe_server(url)
    message = str(info.value)
    assert message.count(". ") == 0 and message.endswith(".") and "--server" in message


# ------------------------------------------------------------------ the eval command


def eval_servers(target, out, *args):
    argv = ["eval", "--target", target, "--prompts", "chat[:3]", "--max-new-tokens", "4",
            "--concurrency", "1,2", "--out", str(out), *args]
    return CliRunner().invoke(main, argv)


@pytest.mark.parametrize("labelled", [True, False])
def test_eval_on_servers_gives_the_engines_table_record_and_plots(target, fake_servers,
                                                                   tmp_path, labelled):
    drafting, plain = fake_servers
    args = ["--server", drafting, "--server", plain]
    labels = ["drafted", "plain"]
    if labelled:
        args += ["--label", labels[0], "--label", labels[1]]
    else:  # both report the model "tiny": told apart by their addresses
        labels = [f"tiny @ {url.split('://')[1]}" for url in fake_servers]
    result = eval_servers(target, tmp_path / "run", *args)
    assert result.exit_code == 0, result.output
    assert f"{labels[1]} ({plain}) reports no spec-decode counters, so it does not draft" in (
        result.output
    )
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert [s["label"] for s in record["servers"]] == labels
    assert [s["k"] for s in record["servers"]] == [2, 0]
    assert record["drafts"] == [] and record["config"]["servers"] == [drafting, plain]
    cells = {(r["label"], r["concurrency"]): r for r in record["runs"]}
    assert set(cells) == {(label, c) for label in labels for c in (1, 2)}
    for c in (1, 2):
        mine, base = cells[(labels[0], c)], cells[(labels[1], c)]
        assert (mine["k"], base["k"], mine["backend"], mine["server"]) == (2, 0, "server", drafting)
        # three prompts' replies of at most 4 tokens, one draft per two-token chunk
        drafts = sum((min(len(p), 4) + 1) // 2 for p in mine["outputs"])
        assert mine["counters"]["num_drafts"] == drafts and base["counters"] is None
        assert mine["per_position"] == [1.0, 0.0] and mine["acceptance_length"] == 2.0
        assert mine["speedup"] == pytest.approx(mine["tokens_per_s"] / base["tokens_per_s"])
        assert mine["same_as_baseline"] == 1.0 and mine["tpot_s"]["mean"] > 0
    rec = {r["concurrency"]: r for r in record["recommendation"]}
    assert set(rec) == {1, 2} and all(r["server"] == drafting for r in rec.values())
    assert all(r["speculative_config"] is None for r in rec.values())
    assert "its K=2 " in result.output and "accept len" in result.output
    for name in ("acceptance.png", "speedup.png"):
        assert (tmp_path / "run" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "run").glob("vllm_worker*"))  # no engine of its own


@pytest.mark.parametrize(
    ("case", "sentence"),
    [
        ("unreachable", "could not read http://127.0.0.1:9/v1/models"),
        ("labels", "give one --label per --server, in the same order (2 server(s), 1 label(s))"),
        ("same label", "each --label must name one server"),
        ("label alone", "--label names a --server"),
        ("draft", "--draft cannot be used with --server"),
        ("k", "-k cannot be used with --server"),
        ("engine flags", "--dtype, --in-process cannot be used with --server"),
    ],
)
def test_servers_that_cannot_be_measured_are_one_sentence(target, fake_servers, tmp_path, case,
                                                          sentence):
    drafting, plain = fake_servers
    two = ["--server", drafting, "--server", plain]
    args = {
        "unreachable": ["--server", drafting, "--server", "http://127.0.0.1:9"],
        "labels": [*two, "--label", "a"],
        "same label": [*two, "--label", "a", "--label", "a"],
        "label alone": ["--label", "a"],
        "draft": [*two, "--draft", str(tmp_path)],
        "k": [*two, "-k", "2"],
        "engine flags": [*two, "--dtype", "bfloat16", "--in-process"],
    }[case]
    result = eval_servers(target, tmp_path / "run", *args)
    assert result.exit_code == 1
    (line,) = result.output.splitlines()
    assert line.startswith("Error: ") and sentence in line and line.endswith(".")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------ a real vllm serve


@pytest.mark.slow
def test_eval_on_real_servers_gives_our_engines_acceptance(tmp_path_factory, tmp_path,
                                                           monkeypatch):
    """Two `vllm serve` of a tiny target, with a trained P-EAGLE draft (K=3) and without:
    `eval --server` reads the acceptance our own engine measures on the same prompts
    (greedy, float32, one request in flight), the same replies, and the no-draft row."""
    # our engine on the servers' core (helpers.serve), one thread as theirs
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", last_core())
    target, draft, _ = trained_target_and_draft(tmp_path_factory.getbasetemp() / "trained-k3", 3)
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3,
                       "parallel_drafting": True})

    def serve_command(*extra):
        return lambda port: [
            sys.executable, "-m", "speculators_peagle_plugin", "vllm", "serve", target,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
            "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "2", *extra,
        ]

    cell = ["--target", target, "--prompts", "chat[:4]", "--max-new-tokens", "24",
            "--concurrency", "1"]
    env = {"PYTHONPATH": str(REPO)}
    with (
        vllm_server(serve_command("--speculative-config", spec), tmp_path / "draft.log",
                    tmp_path, env) as drafting,
        vllm_server(serve_command(), tmp_path / "plain.log", tmp_path, env) as plain,
    ):
        served = CliRunner().invoke(main, ["eval", *cell, "--server", drafting, "--server", plain,
                                           "--label", "drafted", "--label", "plain",
                                           "--out", str(tmp_path / "served")])
    assert served.exit_code == 0, served.output
    assert "plain (" in served.output and "does not draft" in served.output
    engine = ["--draft", str(draft), "-k", "3", "--no-baseline", "--enforce-eager",
              "--in-process", "--kv-cache-gb", "1"]
    ours = CliRunner().invoke(main, ["eval", *cell, *engine, "--out", str(tmp_path / "ours")])
    assert ours.exit_code == 0, ours.output
    runs = json.loads((tmp_path / "served" / "record.json").read_text())["runs"]
    (mine,) = json.loads((tmp_path / "ours" / "record.json").read_text())["runs"]
    by_label = {r["label"]: r for r in runs}
    server, base = by_label["drafted"], by_label["plain"]
    print(f"acceptance: server {server['acceptance_length']:.4f} {server['per_position']}, "
          f"engine {mine['acceptance_length']:.4f} {mine['per_position']}")
    assert 1.2 < mine["acceptance_length"] < 4  # neither trivial nor perfect
    assert server["k"] == 3 and base["k"] == 0 and base["counters"] is None
    assert round(server["acceptance_length"], 2) == round(mine["acceptance_length"], 2)
    assert [round(p, 2) for p in server["per_position"]] == [
        round(p, 2) for p in mine["per_position"]
    ]
    assert server["outputs"] == mine["outputs"] == base["outputs"]
    assert server["same_as_baseline"] == 1.0 and server["speedup"] > 0
    assert server["tpot_s"]["mean"] > 0 and base["tpot_s"]["mean"] > 0
