"""eval --server: vLLM's Prometheus counters read back, and cells measured over HTTP."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from speculators_peagle_plugin.engine.counters import SpecDecodeCounters
from speculators_peagle_plugin.evaluation.server import (
    ServerError,
    probe_server,
    run_server_cell,
)


def metrics_page(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int],
                 engines: int = 1) -> str:  # fmt: skip
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
                  labels + ["position"], registry=registry)  # fmt: skip
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
                                                                      1 * engines])  # fmt: skip
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


@pytest.fixture
def fake_server():
    FakeVllm.state = {"drafts": 0, "accepted": 0, "requests": []}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


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
                                  "num_accepted_tokens": 5, "accepted_per_pos": [5, 0]}  # fmt: skip
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
