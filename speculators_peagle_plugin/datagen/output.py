"""``generate-data``'s output directory: its settings checked against a run to resume,
locked, sized before a byte is written, and the Arrow dataset written into it.

What :mod:`.build_data` (one run) and :mod:`.replicas` / :mod:`.join` (its parts) share.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

from ..common.errors import UserError
from ..common.files import atomic_write, atomic_write_json, temporary_name
from ..common.lock import exclusive_directory, holds_nothing_written
from ..common.paths import writing
from ..common.reading import read_json
from ..common.settings import keys_with
from ..data.layout import (
    HIDDEN_STATES_DIR,
    ROW_PROMPTS_FILE,
    SETTINGS_FILE,
    TOKEN_FREQ_FILE,
    default_target_layer_ids,
)
from ..data.prompts import read_training_prompts, resolved_spec
from ..data.storage import check_free_space, storage_estimate
from .datagen_config import DataGenConfig
from .generation import Target
from .shard_plan import record_span, shard_record

logger = logging.getLogger(__name__)

# generate-data refuses to resume into a directory made with other values of these.
IDENTITY_KEYS = (
    "target", "prompts", "max_samples", "target_layer_ids", "max_new_tokens",
    "temperature", "top_p", "seed", "dtype", "backend", "num_samples", "hidden_states_dtype",
    "contamination_guard", "shard",
)
# The value of a later identity key in data made before it existed.
_BEFORE_KEY = {"contamination_guard": False, "shard": None}


def _settings(config: DataGenConfig, model_config) -> dict:
    text_config = getattr(model_config, "text_config", model_config)
    num_layers = text_config.num_hidden_layers
    layer_ids = config.target_layer_ids or default_target_layer_ids(num_layers)
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad or not layer_ids:
        raise UserError(
            f"--target-layer-ids must be integers in [0, {num_layers}) for this "
            f"{num_layers}-layer target, got {list(layer_ids)} (every sample also stores the "
            f"state after the last layer, which train reads as layer {num_layers})."
        )
    if config.draft_vocab_size > text_config.vocab_size:
        raise UserError(
            f"--draft-vocab-size {config.draft_vocab_size} exceeds the target's vocabulary "
            f"size {text_config.vocab_size}."
        )
    settings = config.to_dict()
    for key in keys_with(DataGenConfig, "resumable"):
        del settings[key]  # free to change between a run and its resume
    for key in keys_with(DataGenConfig, "path"):  # the same directory, however spelled
        settings[key] = str(Path(settings[key]).resolve())
    for key in keys_with(DataGenConfig, "prompts"):
        settings[key] = resolved_spec(settings[key])
    settings.update(
        target_layer_ids=list(layer_ids),
        target_vocab_size=text_config.vocab_size,
        target_hidden_size=text_config.hidden_size,
        target_num_layers=num_layers,
    )
    # a part's record (shard_plan.shard_record) needs the prompts: _output_of completes it
    return settings


def _check_output(output: Path, settings: dict) -> bool:
    """Whether ``output`` is a resumable run of the same settings; raise if it is another's."""
    settings_path = output / SETTINGS_FILE
    if settings_path.exists():
        old = read_json(settings_path)
        for key in IDENTITY_KEYS:
            before = old.get(key, _BEFORE_KEY.get(key))
            if before != settings[key]:
                raise UserError(
                    f"--output {output} was made with different settings ({key}: "
                    f"{before!r} there, {settings[key]!r} now); use a new --output "
                    "directory or the original settings to resume."
                )
        return True
    if not holds_nothing_written(output):
        raise UserError(
            f"--output {output} is not an empty directory and was not made by generate-data "
            f"(no {SETTINGS_FILE}); choose a new or empty directory."
        )
    return False


def write_dataset(rows: list[dict], prompts: list[int], output: Path, tokenizer) -> None:
    """The Arrow dataset (speculators' own pass-through preprocessing), ``token_freq.pt``, and
    the prompt of each dataset row (``ROW_PROMPTS_FILE``: ``prompts[k]`` is the index of the
    prompt ``rows[k]`` answers).

    speculators drops the rows without a supervised token; the others keep their order.
    ``tokenizer`` only tells speculators the rows are text (None says the same)."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    raw = Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows]}
    )
    longest = max(len(r["input_ids"]) for r in rows)
    dataset = build_speculator_training_dataset(raw, tokenizer, max_length=longest, num_proc=1)
    if len(dataset) == 0:
        raise UserError("No regenerated conversation has a supervised token; nothing to write.")
    kept = [i for i, r in zip(prompts, rows, strict=True) if any(r["loss_mask"])]
    assert len(kept) == len(dataset), "speculators kept other rows than the supervised ones"
    atomic_write_json(output / ROW_PROMPTS_FILE, kept, indent=None)
    # The dataset's files join settings and resume state in ``output``, so they are moved in
    # one by one rather than as one directory.
    staging = temporary_name(output / "dataset")
    dataset.save_to_disk(str(staging))
    # state.json last: load_from_disk needs it, so a run killed mid-move rebuilds the dataset.
    for name in sorted(os.listdir(staging), key=lambda n: n == "state.json"):
        os.replace(staging / name, output / name)
    staging.rmdir()
    atomic_write(
        output / TOKEN_FREQ_FILE,
        lambda tmp: save_token_frequency_distribution(dataset, output_path=tmp),
    )


def check_storage(config: DataGenConfig, settings: dict, target, prompts) -> None:
    """Log the projected disk use of the prompts of this part and refuse to start when
    ``config.output``'s disk cannot hold it."""
    n, output = config.replies.num_samples, Path(config.output)
    start, stop = record_span(settings["shard"], len(prompts) * n)
    estimate = storage_estimate(  # its pieces hold whole prompts
        config, settings, target.tokenizer, prompts[start // n : stop // n + (stop % n > 0)],
        output / HIDDEN_STATES_DIR,
    )
    logger.info(estimate.summary())
    check_free_space(output, estimate)


@contextmanager
def open_output(config: DataGenConfig):
    """``(settings, target, prompts)`` while ``config.output`` is locked and checked.

    Everything that can reject the input runs before the output directory is touched.
    ``settings`` gains the contamination guard's record (``contamination``: what it checked
    and how many prompts it dropped; None with the guard off), written with the data, and
    its ``shard`` the part's record (:func:`~.shard_plan.shard_record`).
    """
    from transformers import AutoConfig

    output = Path(config.output)
    settings = _settings(config, AutoConfig.from_pretrained(config.target))
    if output.is_file():
        raise UserError(f"--output {output} is a file; choose a new or empty directory.")
    with exclusive_directory(output, "generate-data"):
        prompts, settings["contamination"] = read_training_prompts(
            config.prompts, config.max_samples, config.contamination_guard
        )
        conversations = len(prompts) * config.replies.num_samples
        settings["shard"] = shard_record(
            config.part, conversations, config.replies.batch_size, config.replies.num_samples
        )
        _check_output(output, settings)
        with writing(output, "the generated data"):  # each file is whole or absent
            yield settings, Target(config), prompts
