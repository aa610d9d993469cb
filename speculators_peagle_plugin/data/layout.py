"""The on-disk layout of training data: file names, paths, aux-state slots, seeds of its order,
its error.

On-disk layout (speculators' format), one directory ``DIR``:

    DIR/data-*.arrow, dataset_info.json, state.json  Arrow dataset (``save_to_disk``), a row per
                                                     target reply: input_ids, loss_mask, seq_len
    DIR/hidden_states/hs_<i>.safetensors             {"hidden_states": [seq, n_aux+1, H],
                                                      "token_ids": [seq]} for dataset row i
                                                     (+ "hidden_states_scales" [seq, 1, 1] with
                                                     float8 storage: :mod:`.storage`)
    DIR/token_freq.pt, d2t-<V>.npy, t2d-<V>.npy      draft vocabulary (d2t holds OFFSETS)
    DIR/generation_settings.json                     what generate-data was run with (this plugin)
    DIR/row_prompts.json                             the prompt each dataset row answers (its
                                                     index in the prompt set; this plugin)
    DIR/replicas/                                    the parts of --data-parallel-size replicas
                                                     until they are joined into DIR
    DIR/vllm.log                                     what vLLM printed (``--backend vllm``)
    DIR/vllm-capture.log                             what vLLM printed capturing hidden states

Legend: ``seq`` = tokens of one sample, ``H`` = target hidden size, ``n_aux`` = aux layers,
``S`` = tokens per packed row. Aux layer id ``L`` is the residual stream after ``L`` decoder
layers (transformers' ``hidden_states[L]``); the last slot is the final residual stream BEFORE
the final norm (transformers' ``hidden_states[-1]`` is after it, so it is captured with a hook).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..common.errors import UserError
from ..common.reading import read_json

HIDDEN_STATES_DIR = "hidden_states"
SETTINGS_FILE = "generation_settings.json"
ROW_PROMPTS_FILE = "row_prompts.json"  # [rows]: the index of the prompt each row answers
REPLICAS_DIR = "replicas"  # generate-data --data-parallel-size: the replicas' parts
RESPONSES_DIR = "responses"  # regenerated rows per batch of prompts: generation resume state
TOKEN_FREQ_FILE = "token_freq.pt"
VLLM_LOG_FILE = "vllm.log"


class DataError(UserError):
    """Training data that cannot be used as it is; the message names the file or setting."""


def hs_path(hidden_states_dir: Path, index: int) -> Path:
    """Path of dataset row ``index``'s hidden states (speculators' ``FileTransfer`` naming)."""
    return Path(hidden_states_dir) / f"hs_{index}.safetensors"


def mix_seed(*values: int) -> int:
    """One well-mixed 63-bit seed from several non-negative ints (e.g. seed, epoch)."""
    return int(np.random.SeedSequence(list(values)).generate_state(1, dtype=np.uint64)[0]) >> 1


def default_target_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 aux layers ``(2, N//2, N-3)``; e.g. 30 layers -> ``(2, 15, 27)``."""
    return (2, num_layers // 2, num_layers - 3)


def row_prompts(output: Path, rows: int) -> list[int] | None:
    """The prompt each of the ``rows`` dataset rows of ``output`` answers (``ROW_PROMPTS_FILE``);
    None for data without that file (made by speculators, or before the file existed).

    Raises :class:`DataError` when the file does not name one prompt per row.
    """
    path = output / ROW_PROMPTS_FILE
    if not path.exists():
        return None
    prompt = read_json(path, list)
    if len(prompt) != rows:
        raise DataError(
            f"{path} does not name the prompt of each of the {rows} dataset rows; delete it "
            "and the dataset's files to rebuild them."
        )
    return prompt


def aux_slots(
    layer_ids: Sequence[int],
    recorded: Sequence[int] | None,
    last: int | None,
    n_aux: int,
    path: Path,
) -> list[int]:
    """The stored slots (of ``[seq, n_aux + 1, H]``) that hold aux layers ``layer_ids``.

    Slot ``k < n_aux`` holds ``recorded[k]`` (None: layers unknown, only the count can
    be checked); the last slot holds the state after the target's last layer, which is
    aux layer ``last`` = ``N``, its layer count (vLLM captures ``N`` after the last layer;
    None: unknown). Example: data of layers (2, 15, 27) on a 30-layer target read as
    (2, 15, 27, 30) -> slots [0, 1, 2, 3]; as (15, 30) -> [1, 3].
    """
    ids = [int(i) for i in layer_ids]
    if ids != sorted(set(ids)):
        raise DataError(
            f"Aux layer ids {ids} must be distinct and ascending: vLLM concatenates the aux "
            "states in layer order."
        )
    if recorded is None:
        if len(ids) != n_aux:
            raise DataError(
                f"The data at {path} holds {n_aux} aux hidden states per token without "
                f"recording their layers, but {len(ids)} layer ids are configured."
            )
        return list(range(n_aux))
    held = {layer: slot for slot, layer in enumerate(recorded)}
    if last is not None:
        held.setdefault(last, n_aux)
    missing = [i for i in ids if i not in held]
    if missing:
        after = "" if last is None else f" and of layer {last} (after the last layer)"
        raise DataError(
            f"Aux layer ids {ids} name layer(s) {missing} whose states the data at {path} does "
            f"not hold: it holds those of layers {list(recorded)}{after}."
        )
    return [held[i] for i in ids]
