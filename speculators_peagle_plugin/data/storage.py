"""What hidden states cost on disk, the free-space check, and the 8-bit storage format.

The 8-bit format is hs_connectors' (speculators' FP8 connector, ``FP8HiddenStatesConnector``),
so vLLM's FP8 files and ours read the same way (``FP8Transfer`` dequantizes both)::

    hidden_states         float8_e4m3fn [seq, n_aux+1, H]
    hidden_states_scales  float32       [seq, 1, 1]      one scale per token: amax / 448
    token_ids             int64         [seq]

Legend: ``seq`` = tokens of one sample, ``H`` = target hidden size, ``n_aux`` = aux layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..common import paths
from ..common.dtypes import DTYPES
from ..common.paths import format_bytes
from .prompts import render_conversation

FLOAT8 = "float8"  # --hidden-states-dtype value of the 8-bit format
# the vLLM connector's kv_connector_extra_config key: a DTYPES name or FLOAT8
STORAGE_DTYPE_KEY = "storage_dtype"
TOKEN_ID_BYTES = 8  # token_ids are int64
SCALE_BYTES = 4  # one float32 scale per token in the 8-bit format


def bytes_per_token(hidden_size: int, num_aux_layers: int, storage_dtype: str) -> int:
    """Bytes one token adds to its ``hs_<i>.safetensors`` (headers aside).

    Example: H 4096, 3 aux + final, bfloat16 -> 4 * 4096 * 2 + 8 = 32776; float8 ->
    4 * 4096 * 1 + 4 + 8 = 16396.
    """
    slots = (num_aux_layers + 1) * hidden_size
    if storage_dtype == FLOAT8:
        return slots + SCALE_BYTES + TOKEN_ID_BYTES
    return slots * DTYPES[storage_dtype].itemsize + TOKEN_ID_BYTES


def token_bound(prompt_lengths: list[list[int]], max_new_tokens: int, num_samples: int) -> int:
    """Most tokens the rows of these conversations can hold.

    Args:
        prompt_lengths: per conversation, the rendered length of its user turns up to and
            including turn k, for each user turn k (a row per turn holds that prompt plus
            at most ``max_new_tokens`` per reply so far, the chat template's few tokens
            around each earlier reply aside).

    Example: one conversation of two turns, prompts 10 and 25 tokens, 100 new tokens,
    2 samples -> 2 * ((10 + 100) + (25 + 200)) = 670.
    """
    per_sample = sum(
        length + (k + 1) * max_new_tokens
        for lengths in prompt_lengths
        for k, length in enumerate(lengths)
    )
    return num_samples * per_sample


@dataclass(frozen=True)
class StorageEstimate:
    bytes_per_token: int
    tokens: int  # the bound of :func:`token_bound`
    existing_bytes: int  # hidden-state files already written (a resumed run)
    # states recorded while generating wait in the engine's dtype until each row's file
    # replaces its recording (``--hidden-states-from generation``); 0 otherwise
    staged_bytes_per_token: int = 0

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.tokens

    @property
    def needed_bytes(self) -> int:
        peak = max(self.bytes_per_token, self.staged_bytes_per_token) * self.tokens
        return max(0, peak - self.existing_bytes)

    def summary(self) -> str:
        staged = ""
        if self.staged_bytes_per_token > self.bytes_per_token:
            peak = self.staged_bytes_per_token * self.tokens
            staged = f" (recorded in the engine's dtype first: {format_bytes(peak)} at the peak)"
        return (
            f"Hidden states: {self.bytes_per_token:,} bytes per token; at most "
            f"{self.tokens:,} tokens -> projected {format_bytes(self.total_bytes)}{staged}."
        )


def check_free_space(output: Path, estimate: StorageEstimate) -> None:
    """Refuse (:class:`~..common.errors.DiskFull`) an ``output`` whose disk (or its nearest
    existing parent's) cannot hold what is still to be written."""
    paths.check_free_space(
        "--output", output, estimate.needed_bytes, "hidden states",
        "free space, use another disk, fewer prompts or --max-new-tokens, or "
        "--hidden-states-dtype float8",
    )


def stored_tensors(hidden_states: torch.Tensor, token_ids: torch.Tensor, storage_dtype: str):
    """The tensors of one ``hs_<i>.safetensors``: plain, or hs_connectors' 8-bit format."""
    if storage_dtype != FLOAT8:
        return {"hidden_states": hidden_states.contiguous(), "token_ids": token_ids}
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    quantized, scales = quantize_tensor_to_fp8(hidden_states)
    return {"hidden_states": quantized, SCALES_KEY: scales, "token_ids": token_ids}


def prompt_lengths(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Per conversation, the rendered length of its user turns up to each user turn (the
    replies that precede a turn are counted by :func:`token_bound`)."""
    lengths = []
    for turns in conversations:
        users = [t for t in turns if t["role"] == "user"]
        lengths.append(
            [len(render_conversation(tokenizer, users[: k + 1])) for k in range(len(users))]
        )
    return lengths


def storage_estimate(config, settings: dict, tokenizer, conversations, hs_dir: Path):
    """The :class:`StorageEstimate` of a ``generate-data`` run (``config``: DataGenConfig)."""
    existing = sum(p.stat().st_size for p in Path(hs_dir).glob("hs_*.safetensors"))
    hidden_size, num_aux = settings["target_hidden_size"], len(settings["target_layer_ids"])
    staged = 0
    if config.capture_backend == "generation":
        staged = bytes_per_token(hidden_size, num_aux, config.dtype)
    return StorageEstimate(
        bytes_per_token=bytes_per_token(hidden_size, num_aux, config.storage_dtype),
        staged_bytes_per_token=staged,
        tokens=token_bound(
            prompt_lengths(tokenizer, conversations), config.replies.max_new_tokens,
            config.replies.num_samples,
        ),
        existing_bytes=existing,
    )
