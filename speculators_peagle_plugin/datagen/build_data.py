"""``generate-data``: the target's replies, the Arrow dataset, hidden states, vocab mapping.

Each phase is resumable: a re-run with the same settings skips what is complete and valid, and
every file is written under a temporary name and renamed (``common.files``).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from ..common.files import atomic_write_json, remove_stale_temporaries
from ..data.dataset import TrainingData, open_training_data
from ..data.layout import (
    HIDDEN_STATES_DIR,
    REPLICAS_DIR,
    RESPONSES_DIR,
    SETTINGS_FILE,
    TOKEN_FREQ_FILE,
)
from .capture import write_hidden_states
from .capture_vllm import place_recorded, recording_spec, write_hidden_states_vllm
from .datagen_config import DataGenConfig
from .generation import generate_responses
from .output import check_storage, open_output, write_dataset
from .replicas import generate_with_replicas
from .shard_plan import record_span

logger = logging.getLogger(__name__)


def generate_data(config: DataGenConfig) -> TrainingData:
    """Regenerate the prompts' replies with the target and write speculators-format data.

    Three resumable phases: replies (one JSON shard per batch), the Arrow dataset and
    ``token_freq.pt``, then one hidden-state file per row; finally ``d2t``/``t2d`` for
    ``config.draft_vocab_size``. Re-running skips what is complete and valid; every file is
    written under a temporary name and renamed. Returns the opened data.
    """
    output = Path(config.output)
    with open_output(config) as (settings, target, prompts):
        check_storage(config, settings, target, prompts)
        if config.data_parallel_size > 1:
            return generate_with_replicas(config, output, settings, prompts)
        return _generate(config, output, settings, target, prompts)


def generate_replies(config: DataGenConfig) -> Path:
    """Only the replies of :func:`generate_data`: its dataset of token ids, no hidden states.

    What online training reads (its states come from the target during training): the Arrow
    dataset, ``token_freq.pt`` and ``generation_settings.json`` in ``config.output``, resumable
    and checked against its settings like ``generate_data``'s output (which a later
    ``generate-data`` run with the same settings completes into offline data). Returns the
    directory.
    """
    output = Path(config.output)
    with open_output(config) as (settings, target, prompts):
        _write_replies(config, output, settings, target, prompts)
    return output


def _write_replies(
    config: DataGenConfig, output: Path, settings: dict, target, prompts, record=None
) -> None:
    """Phases 1 and 2: the target's replies (resumable per shard), then the Arrow dataset and
    ``token_freq.pt``; skipped when both are complete. ``record``: the engine's recording
    spec (:func:`~.capture_vllm.recording_spec`), or None."""
    if not (output / SETTINGS_FILE).exists():
        atomic_write_json(output / SETTINGS_FILE, settings)
    for directory in (output, output / HIDDEN_STATES_DIR, output / RESPONSES_DIR):
        remove_stale_temporaries(directory)
    if not ((output / "state.json").exists() and (output / TOKEN_FREQ_FILE).exists()):
        conversations = len(prompts) * config.replies.num_samples
        span = record_span(settings["shard"], conversations)
        made = generate_responses(target, prompts, output, record, span)
        rows = [row for _, row in made]
        n = config.replies.num_samples
        write_dataset(rows, [c // n for c, _ in made], output, target.tokenizer)
    shutil.rmtree(output / RESPONSES_DIR, ignore_errors=True)


def _generate(config: DataGenConfig, output: Path, settings: dict, target, prompts) -> TrainingData:
    layer_ids = tuple(settings["target_layer_ids"])
    record = None
    if config.capture_backend == "generation":
        record = recording_spec(output, layer_ids, settings["target_num_layers"])
    _write_replies(config, output, settings, target, prompts, record)
    _write_hidden_states(config, target, output, layer_ids, settings)
    shutil.rmtree(output / REPLICAS_DIR, ignore_errors=True)  # a stopped replicas' run's
    data = open_training_data(output, num_aux_layers=len(layer_ids))
    data.vocab_mapping(config.draft_vocab_size)
    return data


def _write_hidden_states(config: DataGenConfig, target, output: Path, layer_ids, settings) -> None:
    """Recorded while generating, then from vLLM when asked and it can; from transformers
    otherwise."""
    if config.capture_backend == "generation":
        shape_tail = (len(layer_ids) + 1, settings["target_hidden_size"])
        place_recorded(config, output, shape_tail)
    if config.capture_backend in ("vllm", "generation"):
        try:
            write_hidden_states_vllm(config, output, layer_ids, settings)
            return
        except RuntimeError as err:
            logger.warning(
                "vLLM could not capture the hidden states (%s); capturing them with "
                "transformers instead.", str(err).splitlines()[0][:500],
            )
    write_hidden_states(target.model, output, layer_ids, config.storage_dtype)
