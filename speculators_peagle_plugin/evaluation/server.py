"""``eval --server``: the eval's figures measured against running vLLM servers.

A user who already serves a draft (``vllm serve TARGET --speculative-config ...``) points
the eval at it instead of starting engines. Each request goes to the server's
OpenAI-compatible ``/v1/completions`` as token ids (the prompt rendered with the target's
chat template, as the eval renders it for its own engines), greedy, streamed, with the
stop tokens the eval's own engines use. The acceptance figures are the difference of the
server's spec-decode counters (vLLM's Prometheus ``/metrics``, the counters ``LLM.get_metrics``
reads in-process) read before and after each cell, so other traffic on the server during
a cell is counted too: measure on a server no one else uses. Tokens/s is output tokens
over the cell's wall time, as for the eval's engines; time per output token is each
request's streaming interval (first to last token) over its tokens after the first.

A server whose ``/metrics`` has no spec-decode counter does not draft: it is the
baseline the drafting servers' speedups are measured against.

``eval --server URL [--label NAME] ...`` (:func:`run_servers`) measures every (server,
concurrency, prompt set) cell, one server after another, and the harness builds the same
table, record and figures from them as from its own engines' cells.

Example::

    servers = probe_servers(["http://127.0.0.1:8000", "http://127.0.0.1:8001"], [], print)
    result = run_server_cell(servers[0], prompts, concurrency=4, max_tokens=128, stop_ids={2})
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..common.errors import UserError
from ..engine.counters import SpecDecodeCounters
from .cells import FinishedCells
from .eval_config import SweepConfig
from .report import cell_tag, progress_callback, run_entry

__all__ = ["Server", "ServerError", "probe_server", "probe_servers", "run_server_cell",
           "run_servers"]

TIMEOUT_S = 600.0  # one request, streamed: long enough for a slow CPU server's longest reply
RETRIES = 3  # tries of a cell whose server stops answering
RETRY_WAIT_S = 5.0  # before a cell's second try; doubled before each later one


class ServerError(UserError):
    """A server that cannot be measured, in one sentence."""


class ServerGone(ServerError):
    """A server that stopped answering: refused or dropped the connection, or cut a reply
    short. ``reason``: what the connection reported."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Server:
    """A running vLLM server: its base URL and the label its rows get.

    Filled in by :func:`probe_server`: ``model`` (the served model's id) and ``k`` (the
    draft's K, from its per-position counters; 0 = no draft).
    """

    url: str
    label: str
    model: str = ""
    k: int = 0


def _get(url: str, timeout: float = 30.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.read()
    except (OSError, http.client.HTTPException) as exc:  # URLError is an OSError
        reason = getattr(exc, "reason", exc)
        error = ServerError if isinstance(exc, urllib.error.HTTPError) else ServerGone
        raise error(
            f"could not read {url} ({reason}); start the vLLM server or correct --server.",
            *([] if error is ServerError else [str(reason)]),
        ) from None


def _reason(exc: OSError) -> str:
    """Why a request failed: an HTTP error's message from the server (vLLM's JSON
    ``{"error": {"message": ...}}``), else the connection's reason."""
    if isinstance(exc, urllib.error.HTTPError):
        try:
            body = json.loads(exc.read())
            message = body.get("error", body).get("message")
        except (ValueError, AttributeError, OSError):
            message = None
        return f"HTTP {exc.code}: {message or exc.reason}".rstrip(".")
    return str(getattr(exc, "reason", exc))


def read_counters(url: str) -> SpecDecodeCounters | None:
    """The server's spec-decode counters now (None: it does not draft)."""
    text = _get(url.rstrip("/") + "/metrics").decode()
    counters = SpecDecodeCounters.from_prometheus(text)
    return counters if counters.accepted_per_pos else None


def probe_server(url: str, label: str | None = None) -> Server:
    """The server at ``url``, with its model id and K; :class:`ServerError` if unusable.

    Its label is ``label``, else the model id it reports.
    """
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ServerError(f"--server takes a URL such as http://127.0.0.1:8000, got {url!r}.")
    raw = _get(url + "/v1/models")
    try:
        models = json.loads(raw)["data"]
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"{url}/v1/models is not an OpenAI-compatible model list.") from None
    if not models:
        raise ServerError(f"the server at {url} serves no model.")
    counters = read_counters(url)
    k = len(counters.accepted_per_pos) if counters else 0
    model = models[0]["id"]
    return Server(url, label or model, model, k)


def probe_servers(urls: Sequence[str], labels: Sequence[str], echo: Callable[[str], None]
                  ) -> list[Server]:
    """Every server of ``eval --server``, labelled; each one that does not draft is named in
    a sentence (its rows are the no-draft baseline).

    Servers left to the model ids they report, and reporting the same one, are told apart by
    their URLs: two servers of ``t`` at ports 8000 and 8001 -> ``t @ 127.0.0.1:8000``,
    ``t @ 127.0.0.1:8001``.
    """
    servers = [probe_server(url, label) for url, label in zip(urls, labels or [None] * len(urls),
                                                              strict=True)]
    if not labels:
        models = [s.model for s in servers]
        servers = [dataclasses.replace(s, label=f"{s.model} @ {s.url.split('://', 1)[1]}")
                   if models.count(s.model) > 1 else s for s in servers]
    for s in servers:
        if not s.k:
            echo(f"{s.label} ({s.url}) reports no spec-decode counters, so it does not draft: "
                 "its rows are the no-draft baseline.")
    return servers


def _complete(server: Server, prompt: list[int], max_tokens: int, stop_ids: set[int],
              ignore_eos: bool) -> dict:
    """One greedy request, streamed: its token ids and the time each chunk arrived."""
    body = {
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "return_token_ids": True, "ignore_eos": ignore_eos,
        "stop_token_ids": [] if ignore_eos else sorted(stop_ids),
    }
    request = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    tokens, stamps, done = [], [], False
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            for raw in reply:
                line = raw.decode().strip()
                done = done or line == "data: [DONE]"
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[5:]).get("choices", []):
                    new = choice.get("token_ids") or []
                    if new:
                        tokens += new
                        stamps.append((time.perf_counter(), len(new)))
    except urllib.error.HTTPError as exc:
        raise ServerError(
            f"the request to {server.url}/v1/completions failed ({_reason(exc)}); see the "
            "server's log."
        ) from None
    except (OSError, http.client.HTTPException) as exc:  # URLError is an OSError
        done, reason = False, _reason(exc) if isinstance(exc, OSError) else repr(exc)
    except json.JSONDecodeError:
        done, reason = False, "a line of the reply was cut short"
    else:
        reason = "the reply ended before its [DONE]"
    if not done:
        raise ServerGone(
            f"the request to {server.url}/v1/completions failed ({reason}); see the server's "
            "log.", reason,
        )
    tpot, after_first = None, len(tokens) - (stamps[0][1] if stamps else 0)
    if after_first > 0:
        tpot = (stamps[-1][0] - stamps[0][0]) / after_first
    return {"tokens": tokens, "tpot": tpot}


def run_server_cell(server: Server, prompts: Sequence[list[int]], concurrency: int,
                    max_tokens: int, stop_ids: set[int], ignore_eos: bool = False,
                    on_progress: Callable[[dict], None] | None = None) -> dict:
    """Every prompt on ``server`` with ``concurrency`` requests in flight; the raw result
    the eval's engines give (:func:`~.report.summarize` reads it)."""
    before = read_counters(server.url) if server.k else None
    lock, done = threading.Lock(), {"n": 0, "tokens": 0}
    start = time.perf_counter()

    def one(prompt: list[int]) -> dict:
        reply = _complete(server, prompt, max_tokens, stop_ids, ignore_eos)
        with lock:
            done["n"] += 1
            done["tokens"] += len(reply["tokens"])
            if on_progress is not None:
                on_progress({"done": done["n"], "output_tokens": done["tokens"],
                             "wall_s": time.perf_counter() - start, "counters": None})
        return reply

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        replies = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    counters = None
    if before is not None:
        counters = (read_counters(server.url) - before).to_dict()
    return {
        "output_tokens": sum(len(r["tokens"]) for r in replies),
        "wall_s": wall,
        "counters": counters,
        "time_per_output_token_s": [r["tpot"] for r in replies if r["tpot"] is not None],
        "accepted_histograms": None,
        "outputs": [r["tokens"] for r in replies],
        "engine": {"server": server.url, "model": server.model},
        "pieces": 1,
    }


def server_cell_key(server: Server, prompt_set: str, set_sha256: str | None,
                    ids: Sequence[list[int]], concurrency: int, max_tokens: int,
                    stop_ids: set[int], ignore_eos: bool) -> dict:
    """The key a server's cell is kept under (:mod:`.cells`): the server (URL, the model it
    serves, its K), the prompt set and the sha256 of the exact token ids, and the request's
    settings. eval cannot hash the draft a server runs: a server restarted at the same URL
    with another draft of the same K is taken for the old one (use another ``--out``)."""
    digest = hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()
    return {"cells": [{
        "backend": "server", "server": server.url, "model": server.model, "k": server.k,
        "prompt_set": prompt_set, "prompt_set_sha256": set_sha256, "prompts": len(ids),
        "prompts_sha256": digest, "batch_size": concurrency, "max_tokens": max_tokens,
        "stop_token_ids": sorted(stop_ids), "ignore_eos": ignore_eos,
    }]}


def _tried(measure: Callable[[], dict], server: Server, tag: str, write) -> dict:
    """``measure()``, tried ``RETRIES`` times in all while its server does not answer; the
    waits between tries double from ``RETRY_WAIT_S``."""
    for attempt in range(RETRIES):
        try:
            return measure()
        except ServerGone as exc:
            if attempt + 1 == RETRIES:
                raise ServerGone(
                    f"the server at {server.url} stopped answering during {tag} and did not "
                    f"come back in {RETRIES} tries ({exc.reason})", exc.reason,
                ) from None
            wait = RETRY_WAIT_S * 2**attempt
            write(f"{server.url} stopped answering during {tag} ({exc.reason}); trying the "
                  f"cell again in {wait:.0f} s ({attempt + 2} of {RETRIES} tries)")
            time.sleep(wait)
    raise AssertionError("unreachable")


def run_servers(servers: Sequence[Server], prompts: dict[str, list[list[int]]],
                sweep: SweepConfig, stop_ids: set[int], ignore_eos: bool,
                store: FinishedCells | None = None,
                set_sha256: dict[str, str] | None = None) -> list[dict]:
    """Every (server, concurrency, prompt set) cell under one progress bar, one server after
    another; one record run per cell, as the harness makes them from its engines' cells.

    Args:
        servers: from :func:`probe_servers`.
        prompts: ``{prompt set: [prompt token ids]}``, rendered as the target's chat template
            renders them.
        sweep: the concurrencies, new tokens and prompts per slot (its K are the servers').
        store: where finished cells are kept, and found on a rerun (None: nowhere).
        set_sha256: each prompt set's sha256, part of its cells' keys.

    With ``store`` each finished cell is kept there as it ends (:func:`server_cell_key`), and
    a cell found there is not measured again. A cell whose server stops answering is tried
    ``RETRIES`` times in all; then :class:`ServerError` says how many cells are kept.
    """
    from tqdm import tqdm

    cells = []
    for server in servers:
        for c in sweep.concurrency:
            for name, ids in prompts.items():
                ids = ids[: sweep.prompts_per_slot * c] if sweep.prompts_per_slot else ids
                key = server_cell_key(server, name, (set_sha256 or {}).get(name), ids, c,
                                      sweep.max_new_tokens, stop_ids, ignore_eos)
                kept = store.get(key) if store is not None else None
                cells.append((server, c, name, ids, key, kept and kept[0]))
    todo = [cell for cell in cells if not cell[-1]]
    resumed = [cell[4] for cell in cells if cell[-1]]
    bar = tqdm(total=sum(len(cell[3]) for cell in todo), unit="prompt", desc="eval")
    if len(todo) < len(cells):
        bar.write(f"{len(cells) - len(todo)} of {len(cells)} cells finished earlier "
                  f"({store.path}); measuring the other {len(todo)}")
    runs = []
    try:
        for server, c, name, ids, key, kept in cells:
            if not kept:
                tag = cell_tag(name, server.label, server.k, c)
                measure = functools.partial(
                    run_server_cell, server, ids, c, sweep.max_new_tokens, stop_ids, ignore_eos,
                    progress_callback(bar, tag),
                )
                kept = _tried(measure, server, tag, bar.write)
                if store is not None:
                    store.add(key, [kept])
            runs.append(run_entry(
                kept, prompt_set=name, draft=None, server=server.url, label=server.label,
                k=server.k, concurrency=c, backend="server", resumed=key in resumed,
            ))
    except ServerGone as exc:
        raise ServerError(f"{exc}; {_kept(store, [cell[4] for cell in cells])}: restart the "
                          "server and run the same command again.") from None
    finally:
        bar.close()
    return runs


def _kept(store: FinishedCells | None, keys: list[dict]) -> str:
    """Which of the cells ``keys`` are kept, in words."""
    if store is None:
        return "no cell is kept"
    done = sum(store.get(key) is not None for key in keys)
    return (f"{done} finished cell(s) of {len(keys)} are kept in {store.path}, so the same "
            f"command measures only the other {len(keys) - done}")
