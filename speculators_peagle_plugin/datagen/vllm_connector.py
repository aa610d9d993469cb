"""A vLLM KV connector that writes the hidden states of vLLM's ``extract_hidden_states``
method on any device, CPU included. Loaded by vLLM (``kv_connector_module_path``), never
imported by the package itself.

vLLM's ``ExampleHiddenStatesConnector`` copies the states through a CUDA stream into pinned
memory, which the CPU backend cannot allocate; this sibling (like hs_connectors'
``FP8HiddenStatesConnector``) changes only the write: it copies the request's states out of
the cache synchronously and writes ``hs``-format files under a temporary name, renamed when
complete, plain or in hs_connectors' 8-bit format (``storage_dtype`` in the connector's extra
config). Everything else (which requests, their file names, freeing the blocks) is vLLM's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import (
    example_hidden_states_connector as _eh,
)

from ..common.files import atomic_write
from ..data.storage import STORAGE_DTYPE_KEY, stored_tensors
from .capture import save_safetensors


class _Done:
    """A finished copy (the copy is synchronous): what ``get_finished`` polls."""

    @staticmethod
    def query() -> bool:
        return True


class HiddenStatesFileConnector(_eh.ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous, device-agnostic, atomic write."""

    def _submit_async_write(self, pending: _eh.PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + offsets[None]).flatten()
        num_tokens = pending.token_ids.shape[0]
        # [seq, n_layers, H]: the cache layer stores one "head" per captured layer.
        states = _eh.extract_from_kv_cache(
            self._kv_cache, slots.to(self._kv_cache.device), num_tokens
        ).cpu()
        storage_dtype = self._kv_transfer_config.get_from_extra_config(STORAGE_DTYPE_KEY, None)
        tensors = stored_tensors(states, pending.token_ids.long().clone(), storage_dtype)
        path = Path(pending.filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            atomic_write(path, lambda tmp: save_safetensors(tensors, tmp))
        finally:
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)  # releases a reader waiting on the lock file
        self._req_copy_events[pending.req_id] = _Done()
