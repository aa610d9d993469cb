"""Training data whose missing hidden states come from running vLLM servers (speculators'
``generation`` group, :mod:`..datagen.served_states`).

speculators' meaning: rows of ``--data-path`` with their ``hs_<i>.safetensors`` are read
from it; the rows without one are, by ``--on-missing``, fetched from the ``--vllm-endpoint``
servers (``generate``), dropped (``skip``, ``warn``: with a warning), or refused (``raise``:
the offline path's sentence). Complete data never contacts a server. Under torchrun each
rank fetches the rows of its own packed rows, starting its turns at its own server.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.errors import UserError
from ..data import TrainingData, hs_path, open_training_data
from ..data.layout import HIDDEN_STATES_DIR, DataError
from ..datagen.served_states import ServedHiddenStates
from ..datagen.vllm_servers import ServerUnreachable
from .online_data import online_layer_ids

if TYPE_CHECKING:
    from .distributed import World
    from .train_config import TrainConfig

logger = logging.getLogger(__name__)


def _rows_without_states(path: Path) -> tuple[int, list[int]]:
    """``(rows, those without a hidden-state file)``; ``(0, [])`` when ``path`` holds no
    readable dataset (the offline path's checks name what is wrong)."""
    import os

    from datasets import load_from_disk

    try:
        num_rows = len(load_from_disk(str(path)))
    except Exception:  # noqa: BLE001 - datasets raises several types; open_training_data words it
        return 0, []
    hs_dir = path / HIDDEN_STATES_DIR
    present = set(os.listdir(hs_dir)) if hs_dir.is_dir() else set()
    return num_rows, [i for i in range(num_rows) if hs_path(hs_dir, i).name not in present]


def _what_lacks(path: Path, num_rows: int, missing: list[int]) -> str:
    if len(missing) == num_rows:
        return f"{path} holds token ids but no hidden states ({num_rows} rows)"
    first = hs_path(path / HIDDEN_STATES_DIR, missing[0]).name
    return f"{path} lacks the hidden states of {len(missing)} of {num_rows} rows (first: {first})"


def open_served_data(
    config: TrainConfig, verifier_config, world: World
) -> tuple[TrainingData, tuple[int, ...]] | None:
    """``(data, aux layer ids)`` of a ``--data-path`` with rows lacking hidden states, read
    as ``--on-missing`` says; None when every row has its file or ``on_missing`` is
    ``raise`` (the offline path then reads or refuses the data).

    With ``generate`` every server is checked before training (:meth:`ServedHiddenStates.
    connect`): each refusal is one sentence.
    """
    gen, path = config.generation, Path(config.data.data_path)
    num_rows, missing = _rows_without_states(path)
    if not missing or gen.on_missing == "raise":
        return None
    lacks = _what_lacks(path, num_rows, missing)
    if config.data.train_data_ratio < 1:
        raise UserError(
            f"{lacks}: train_data_ratio {config.data.train_data_ratio:g} needs every row's "
            "hidden states on disk to score the held-out ones; give validation_data_path "
            "instead, or make the states with generate-data."
        )
    layer_ids = online_layer_ids(config, verifier_config)
    source = ServedHiddenStates(
        path,
        config.verifier.verifier_name_or_path,
        layer_ids,
        verifier_config.hidden_size,
        verifier_config.vocab_size,
        gen,
    )
    data = open_training_data(path, draft_vocab_size=config.draft.draft_vocab_size, online=source)
    if gen.on_missing == "generate":
        _connect(source, lacks, len(missing) == num_rows, world.rank)
        return data, layer_ids
    if len(missing) == num_rows:
        raise DataError(f"{lacks}: --on-missing {gen.on_missing} leaves no row to train on.")
    source.dropped = frozenset(missing)
    log = logger.warning if gen.on_missing == "warn" else logger.info
    log("%s: training without those rows (--on-missing %s)", lacks, gen.on_missing)
    return data, layer_ids


def _connect(source: ServedHiddenStates, lacks: str, none_on_disk: bool, rank: int) -> None:
    """:meth:`ServedHiddenStates.connect`; a server that does not answer is named with
    what the data lacks and the other ways to get its states."""
    try:
        source.connect(rank)
    except ServerUnreachable as err:
        complete = (
            "train with --online, or make them with generate-data"
            if none_on_disk
            else "or run generate-data again to complete it"
        )
        raise ServerUnreachable(
            f"{lacks}, and no vLLM server answers at {err.url} ({err.reason}) to compute "
            f"them; start one as docs/training.md shows (or correct --vllm-endpoint), "
            f"{complete}.",
            err.url,
            err.reason,
        ) from None
    logger.info(
        "hidden states of rows without files: from %s, in turn",
        ", ".join(e.url for e in source.endpoints),
    )


def kept_samples(data: TrainingData, samples: tuple[int, ...]) -> tuple[int, ...]:
    """``samples`` less the rows ``--on-missing skip|warn`` dropped."""
    dropped = getattr(data.online, "dropped", frozenset())
    return tuple(i for i in samples if i not in dropped)
