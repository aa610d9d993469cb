"""Hidden-state capture: one target forward per dataset row, written as ``hs_<i>.safetensors``.

Legend: ``seq`` = tokens of one row, ``H`` = target hidden size. Slot ``k < n_aux`` holds
transformers' ``hidden_states[L_k]`` (the residual stream after ``L_k`` decoder layers); the
last slot holds the final residual stream BEFORE the final norm, caught by a hook on it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..common.files import atomic_write
from ..data.layout import HIDDEN_STATES_DIR, hs_path, row_prompts
from ..data.storage import stored_tensors
from ..model.target import FinalNormInput

logger = logging.getLogger(__name__)

MIN_SHARED_PREFIX = 16  # tokens; shorter shared prefixes are recomputed per row


@torch.no_grad()
def capture_hidden_states(
    model: torch.nn.Module, input_ids: torch.Tensor, layer_ids: tuple[int, ...], cache=None
):
    """One target forward over a sample; returns its speculators hidden states.

    Args:
        model: a transformers causal LM (its decoder must have a final ``norm``).
        input_ids: ``[seq]`` token ids.
        layer_ids: aux layer ids; ``L`` = residual stream after ``L`` decoder layers (``N``,
            the layer count, = the state after the last layer, before the final norm).
        cache: None, or a transformers ``DynamicCache`` holding a prefix: ``input_ids`` then
            continues it, the cache grows by them, and only their states are returned.

    Returns:
        ``[seq, len(layer_ids) + 1, H]``: ``hidden_states[L]`` for each aux id, then the final
        residual stream before the final norm. Example: 4 layers, ids (1, 2, 3) ->
        ``[seq, 4, H]`` = states after layers 1, 2, 3 and the input of ``norm`` (after 4).
    """
    decoder = model.get_decoder()
    with FinalNormInput(model) as pre_norm:
        out = decoder(
            input_ids=input_ids[None],
            output_hidden_states=True,
            past_key_values=cache,
            use_cache=cache is not None,
        )
    # transformers' hidden_states[N] is after the final norm; aux id N is before it, as in vLLM
    last, final = len(out.hidden_states) - 1, pre_norm.value[0]
    states = [final if layer == last else out.hidden_states[layer][0] for layer in layer_ids]
    return torch.stack([*states, final], dim=1)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class _PrefixStates:
    """Hidden states of rows that start alike (the samples of one prompt, the turns of one
    conversation), computing their common prefix once and reusing its KV cache.

    The prefix is the longest one the current row shares with the next (at least
    ``MIN_SHARED_PREFIX`` tokens, and shorter than both); a row that does not start with the
    current prefix gets a plain forward. Same states as a full forward up to float rounding.
    The caller confines the rule to the rows of one prompt (:meth:`forget` at each new prompt,
    no next row past its last): the states of a row then depend on its prompt's rows alone, so
    a part of the data (``--shard``) computes them as the run over all of it does, to the bit.
    """

    def __init__(self, model, layer_ids: tuple[int, ...]):
        self.model, self.layer_ids = model, layer_ids
        self.device = next(model.parameters()).device
        self.prefix: list[int] = []
        self.prefix_states = self.cache = None

    def _choose(self, ids: list[int], next_ids: list[int] | None) -> None:
        """The prefix row ``ids`` is computed from (the rule above), a function of the rows
        alone; its states are computed when a row first uses them."""
        p = len(self.prefix)
        if p and len(ids) > p and ids[:p] == self.prefix:
            return
        shared = 0 if next_ids is None else _shared_prefix(ids, next_ids)
        shared = min(shared, len(ids) - 1, len(next_ids or ()) - 1)
        self.prefix = ids[:shared] if shared >= MIN_SHARED_PREFIX else []
        self.prefix_states = self.cache = None

    def forget(self) -> None:
        """Start afresh: the next row shares no prefix with the rows before it."""
        self.prefix = []
        self.prefix_states = self.cache = None

    def skip(self, ids: list[int], next_ids: list[int] | None) -> None:
        """Row ``ids`` is stored already: follow the rule as if it were computed, so that a
        resumed run computes each later row from the prefix (and so to the bit the states)
        of a run that computed every row."""
        self._choose(ids, next_ids)

    @torch.no_grad()
    def __call__(self, ids: list[int], next_ids: list[int] | None) -> torch.Tensor:
        from transformers import DynamicCache

        device = self.device
        self._choose(ids, next_ids)
        if not self.prefix:
            return capture_hidden_states(
                self.model, torch.tensor(ids, device=device), self.layer_ids
            )
        p = len(self.prefix)
        if self.prefix_states is None:
            self.cache = DynamicCache()
            self.prefix_states = capture_hidden_states(
                self.model, torch.tensor(self.prefix, device=device), self.layer_ids, self.cache
            )
        rest = capture_hidden_states(
            self.model, torch.tensor(ids[p:], device=device), self.layer_ids, self.cache
        )
        self.cache.crop(p)  # back to the prefix for the next row
        return torch.cat([self.prefix_states, rest])


def _hs_file_problem(path: Path, input_ids: list[int], shape_tail: tuple[int, int]) -> str | None:
    """Cheap completeness check of a written file (header, shape, token ids); None if fine."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            if {"hidden_states", "token_ids"} - set(fh.keys()):
                return "lacks a tensor"
            shape = fh.get_slice("hidden_states").get_shape()
            token_ids = fh.get_tensor("token_ids").tolist()
    except Exception as err:  # noqa: BLE001 - any unreadable file is regenerated
        return f"unreadable ({err})"
    if token_ids != input_ids or list(shape) != [len(input_ids), *shape_tail]:
        return "of the wrong shape or tokens"
    return None


def save_safetensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    path.chmod(0o644)  # safetensors creates 0600 files; data directories are often shared


def rows_to_capture(dataset, hs_dir: Path, shape_tail: tuple[int, int]) -> list[int]:
    """Dataset rows without a valid ``hs_<i>.safetensors`` (a bad file is logged)."""
    from speculators.data_generation.offline import get_existing_hidden_state_indices

    existing = set(get_existing_hidden_state_indices(hs_dir))
    todo = []
    for i in range(len(dataset)):
        if i in existing:
            problem = _hs_file_problem(hs_path(hs_dir, i), dataset[i]["input_ids"], shape_tail)
            if problem is None:
                continue
            logger.warning("Regenerating %s: %s.", hs_path(hs_dir, i), problem)
        todo.append(i)
    return todo


def write_hidden_states(
    model, output: Path, layer_ids: tuple[int, ...], storage_dtype: str | None = None
) -> int:
    """Hidden states of each dataset row of ``output`` without a valid ``hs_<i>.safetensors``
    (rows that start alike share their prefix's forward: :class:`_PrefixStates`), stored as
    computed or in the 8-bit format (``storage_dtype`` ``"float8"``, :mod:`..data.storage`).

    Returns the number of files written.
    """
    from tqdm import tqdm

    hidden_size = model.config.get_text_config().hidden_size
    dataset, hs_dir, todo = pending_rows(output, (len(layer_ids) + 1, hidden_size))
    start, tokens = time.perf_counter(), 0
    states_of = _PrefixStates(model, layer_ids)
    prompt = row_prompts(output, len(dataset))
    with tqdm(
        total=len(dataset), initial=len(dataset) - len(todo), unit="sample", desc="Hidden states"
    ) as bar:
        pending = set(todo)
        rows = (dataset[i]["input_ids"] for i in range(len(dataset)))
        following = next(rows, None)
        for i in range(len(dataset)):
            row, following = following, next(rows, None)  # the next row: a shared prefix?
            neighbour = following
            if prompt is not None:
                if i and prompt[i] != prompt[i - 1]:
                    states_of.forget()
                if following is not None and prompt[i + 1] != prompt[i]:
                    neighbour = None
            if i not in pending:
                states_of.skip(row, neighbour)
                continue
            states = states_of(row, neighbour)
            ids = torch.tensor(row, dtype=torch.long)
            tensors = stored_tensors(states.cpu(), ids, storage_dtype)
            atomic_write(hs_path(hs_dir, i), lambda tmp, t=tensors: save_safetensors(t, tmp))
            tokens += len(ids)
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
    if todo:
        log_capture(len(todo), tokens, start, "transformers")
    return len(todo)


def pending_rows(output: Path, shape_tail: tuple[int, int]):
    """``(dataset, hidden_states_dir, rows)``: the rows of ``output``'s dataset that lack a
    valid ``hs_<i>.safetensors`` of ``[seq, *shape_tail]``."""
    from datasets import load_from_disk

    dataset = load_from_disk(str(output)).with_format(None)
    hs_dir = output / HIDDEN_STATES_DIR
    hs_dir.mkdir(exist_ok=True)
    return dataset, hs_dir, rows_to_capture(dataset, hs_dir, shape_tail)


def log_capture(samples: int, tokens: int, start: float, source: str) -> None:
    elapsed = time.perf_counter() - start
    logger.info(
        "Captured hidden states of %d samples (%d tokens) with %s in %.1f s (%.1f tokens/s).",
        samples,
        tokens,
        source,
        elapsed,
        tokens / elapsed,
    )
