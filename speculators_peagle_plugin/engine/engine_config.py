"""The ``engine`` section: settings of the vLLM engines a command starts, declared once for
``generate-data``, ``eval`` and the demo (each composes it, hiding what it does not set)."""

from __future__ import annotations

from dataclasses import dataclass

from ..common.settings import check_optional_ints, setting

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """How a vLLM engine is started (:class:`~.vllm_client.VllmWorker`, its engine options).

    Args:
        max_model_len: vLLM's ``max_model_len``; None: the target's.
        kv_cache_gb: vLLM's CPU KV cache in GiB (``VLLM_CPU_KVCACHE_SPACE``); None: the
            command's default (vLLM's, or ``CPU_KV_CACHE_GB`` shared on CPU).
        in_process: run vLLM's engine core inside the worker process instead of its own
            (vLLM's default): an engine starts several times faster on CPU, but the
            frontend shares the engine's pinned core, so tokens/s drop.
    """

    max_model_len: int | None = setting(
        None, "vLLM max_model_len.", show="the target's", engine=True
    )
    kv_cache_gb: int | None = setting(
        None, "vLLM's CPU KV cache in GiB.", engine=True, resumable=True
    )
    in_process: bool = setting(
        False, "vLLM engine core inside the worker: fast start, slower tokens/s.",
        switch=True, show=None, engine=True,
    )

    def __post_init__(self) -> None:
        check_optional_ints(self, {"kv_cache_gb": 1})
