"""An OpenAI-compatible fake of ``vllm serve`` in a process of its own, which a test can let
die mid-request.

``python fake_vllm.py PORT REQUESTS_LOG [DIE_AT]`` serves, on 127.0.0.1:PORT, the endpoints
``eval --server`` reads: ``/v1/models`` (model ``tiny``), ``/metrics`` (vLLM's spec-decode
counters, K=2) and a streamed ``/v1/completions`` that replies with the prompt reversed in
chunks of two tokens, counting one draft accepting one token per chunk. Each completion
request's prompt is appended to REQUESTS_LOG. The DIE_AT-th completion request (from 1)
sends half its stream, then the process kills itself with SIGKILL.

Each request runs in a thread of its own (``ThreadingHTTPServer``) and concurrent requests
overlap, so a request takes its ordinal and updates the counters under one lock: read back
from the shared counter later, two requests that arrived together would both see the later
count, and neither would be the DIE_AT-th.

:func:`fake_vllm` runs it for the length of a ``with`` block.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def metrics_page(drafts: int, accepted: int) -> str:
    """vLLM's spec-decode counters as its PrometheusStatLogger writes them, K=2, the second
    position never accepted."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry, labels = CollectorRegistry(), ["engine", "model_name"]
    for name, value in (("num_drafts", drafts), ("num_draft_tokens", 2 * drafts),
                        ("num_accepted_tokens", accepted)):
        Counter(f"vllm:spec_decode_{name}", name, labels, registry=registry).labels(
            "0", "tiny").inc(value)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per position",
                      [*labels, "position"], registry=registry)
    per_pos.labels("0", "tiny", "0").inc(accepted)
    per_pos.labels("0", "tiny", "1").inc(0)
    return generate_latest(registry).decode()


class Handler(BaseHTTPRequestHandler):
    counts = {"drafts": 0, "accepted": 0, "completions": 0}
    lock = threading.Lock()
    log_path: Path
    die_at: int | None = None

    def log_message(self, *args):
        pass

    def _head(self, length: int, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def do_GET(self):
        if self.path == "/v1/models":
            body = json.dumps({"data": [{"id": "tiny"}]}).encode()
            kind = "application/json"
        else:
            with self.lock:
                drafts, accepted = self.counts["drafts"], self.counts["accepted"]
            body = metrics_page(drafts, accepted).encode()
            kind = "text/plain"
        self._head(len(body), kind)
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.counts["completions"] += 1
            ordinal = self.counts["completions"]
            with open(self.log_path, "a") as log:
                log.write(json.dumps(request["prompt"]) + "\n")
        reply = list(reversed(request["prompt"]))[: request["max_tokens"]]
        chunks = [reply[i : i + 2] for i in range(0, len(reply), 2)]
        body = "".join(f"data: {json.dumps({'choices': [{'token_ids': c}]})}\n\n" for c in chunks)
        body = (body + "data: [DONE]\n\n").encode()
        self._head(len(body), "text/event-stream")
        if ordinal == self.die_at:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        with self.lock:
            self.counts["drafts"] += len(chunks)
            self.counts["accepted"] += len(chunks)
        self.wfile.write(body)


@contextmanager
def fake_vllm(port: int, requests_log: Path, die_at: int | None = None):
    """The fake server on ``port`` until the block ends; yields its process."""
    command = [sys.executable, __file__, str(port), str(requests_log)]
    server = subprocess.Popen([*command, *([str(die_at)] if die_at else [])])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "no fake server"
                time.sleep(0.05)
        yield server
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    Handler.log_path = Path(sys.argv[2])
    Handler.die_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
