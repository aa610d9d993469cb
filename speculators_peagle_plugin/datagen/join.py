"""``join-data``: the parts ``generate-data --shard I/N`` made, joined into the data one run
over all the prompts makes.

The joined directory holds the parts' rows in conversation order, rebuilt into one Arrow
dataset by generate-data's own writer, their ``hs_<i>`` renumbered (hard links where the
filesystem allows, copies otherwise), one ``generation_settings.json`` without the part's
record, and ``token_freq.pt`` and the vocabulary mapping of all the rows. Each part's rows
and states are the ones the whole run makes for its conversations (:mod:`.shard_plan`), so
the joined files are that run's, byte for byte, for greedy replies from the transformers
backend (vLLM batches its arithmetic, so its states match to rounding).

Refused, each in one sentence naming the part: a directory that is not a part or not
complete, parts made with other settings, two parts making the same conversations
(overlap), and conversations no part makes (gap). A join that stopped resumes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import UserError
from ..common.files import atomic_write, atomic_write_json, remove_stale_temporaries
from ..common.lock import exclusive_directory, holds_nothing_written
from ..common.paths import writing
from ..common.reading import read_json
from ..common.settings import Settings, setting
from ..data.dataset import TrainingData, open_training_data
from ..data.layout import (
    HIDDEN_STATES_DIR,
    ROW_PROMPTS_FILE,
    SETTINGS_FILE,
    TOKEN_FREQ_FILE,
    hs_path,
)
from ..model.build import DEFAULT_DRAFT_VOCAB_SIZE
from .output import write_dataset
from .shard_plan import record_span


@dataclass(frozen=True)
class JoinConfig(Settings):
    """Settings of ``speculators-peagle join-data`` (each default lives here).

    Args:
        parts: the parts' directories (the ``--output`` of each ``generate-data --shard``).
        output: directory of the joined data (new or empty; a join that stopped resumes).
        draft_vocab_size: size of the ``d2t``/``t2d`` files written.
    """

    parts: tuple[str, ...] = setting(
        help="The parts' directories: each generate-data --shard I/N run's --output.",
        argument=True, multiple=True,
    )
    output: str = setting(
        help="Directory of the joined data (new or empty; a stopped join resumes).",
        show=None, output=True,
    )
    draft_vocab_size: int = setting(DEFAULT_DRAFT_VOCAB_SIZE, "Size of the d2t/t2d written.")


@dataclass
class _Part:
    path: Path
    settings: dict
    rows: int  # dataset rows

    @property
    def record(self) -> dict:
        return self.settings["shard"]

    @property
    def span(self) -> tuple[int, int]:
        return tuple(self.record["conversations"])

    @property
    def name(self) -> str:
        return f"part {self.record['name']} ({self.path})"


def _read_part(path: Path) -> _Part:
    """A complete part, or a one-sentence refusal naming it."""
    if not (path / SETTINGS_FILE).is_file():
        raise UserError(f"{path} is not a part made by generate-data (no {SETTINGS_FILE}).")
    settings = read_json(path / SETTINGS_FILE)
    if settings.get("shard") is None:
        raise UserError(
            f"{path} holds all of its data (generate-data ran without --shard), not a part; "
            "use it as it is."
        )
    part = _Part(path, settings, 0)
    finish = "run its generate-data command again to finish it"
    for name in ("state.json", TOKEN_FREQ_FILE, ROW_PROMPTS_FILE):
        if not (path / name).exists():
            raise UserError(f"{part.name} is not complete (it has no {name} yet); {finish}.")
    part.rows = len(read_json(path / ROW_PROMPTS_FILE, list))
    absent = [i for i in range(part.rows) if not hs_path(path / HIDDEN_STATES_DIR, i).exists()]
    if absent:
        raise UserError(
            f"{part.name} is not complete ({len(absent)} of its {part.rows} rows have no hidden "
            f"states yet, the first hs_{absent[0]}); {finish}."
        )
    return part


def _check_settings(parts: list[_Part]) -> None:
    """Every part was made with the first one's settings (its part aside)."""
    first = parts[0]
    base = {k: v for k, v in first.settings.items() if k != "shard"}
    base.update(of=first.record["of"], batch_size=first.record["batch_size"])
    for part in parts[1:]:
        mine = {k: v for k, v in part.settings.items() if k != "shard"}
        mine.update(of=part.record["of"], batch_size=part.record["batch_size"])
        for key in [*base, *(k for k in mine if k not in base)]:
            if base.get(key) != mine.get(key):
                raise UserError(
                    f"{part.name} was made with other settings than {first.name} ({key}: "
                    f"{mine.get(key)!r} there, {base.get(key)!r} in {first.name}); make every "
                    "part with the same command but its --shard."
                )


def _check_tiling(parts: list[_Part], span: tuple[int, int]) -> None:
    """The parts, in order, make each conversation of ``span`` exactly once."""
    of = parts[0].record["of"]
    position, previous = span[0], None
    for part in parts:
        start, stop = part.span
        if start < position:
            raise UserError(
                f"{part.name} makes conversations [{start}, {stop}), which "
                f"{previous.name if previous else 'the joined part'} makes too (up to "
                f"{position}); give each part once, from one --shard I/N series."
            )
        if start > position:
            raise UserError(
                f"No part makes conversations [{position}, {start}) of the {of} (they come "
                f"before {part.name}); make the missing part with --shard, or give its "
                "directory."
            )
        position, previous = stop, part
    if position < span[1]:
        raise UserError(
            f"No part makes conversations [{position}, {span[1]}) of the {of} (they come after "
            f"{previous.name}); make the missing part with --shard, or give its directory."
        )


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or one without hard links
        shutil.copyfile(source, target)


def join_parts(paths: list[Path], output: Path, record: dict | None) -> dict:
    """Join the parts in ``paths`` into ``output`` (locked by the caller): the data of the
    conversations ``record`` names (:func:`~.shard_plan.shard_record`; None = all of them),
    with ``record`` as its ``shard``. Returns the joined settings."""
    parts = sorted((_read_part(Path(p)) for p in paths), key=lambda part: part.span)
    _check_settings(parts)
    _check_tiling(parts, record_span(record, parts[0].record["of"]))
    settings = dict(parts[0].settings, shard=record)
    if (output / SETTINGS_FILE).exists():
        if read_json(output / SETTINGS_FILE) != settings:
            raise UserError(
                f"--output {output} holds other data than the join of these parts; choose a "
                "new or empty directory."
            )
    elif not holds_nothing_written(output):
        raise UserError(
            f"--output {output} is not an empty directory and holds no joined data; choose a "
            "new or empty directory."
        )
    hs_dir = output / HIDDEN_STATES_DIR
    with writing(output, "the joined data"):
        if not (output / SETTINGS_FILE).exists():
            atomic_write_json(output / SETTINGS_FILE, settings)
        for directory in (output, hs_dir):
            if directory.is_dir():
                remove_stale_temporaries(directory)
        if not ((output / "state.json").exists() and (output / TOKEN_FREQ_FILE).exists()):
            _write_rows(parts, output)
        hs_dir.mkdir(exist_ok=True)
        offset = 0
        for part in parts:
            for i in range(part.rows):
                target = hs_path(hs_dir, offset + i)
                if not target.exists():
                    source = hs_path(part.path / HIDDEN_STATES_DIR, i)
                    atomic_write(target, lambda tmp, s=source: _link_or_copy(s, tmp))
            offset += part.rows
    return settings


def _write_rows(parts: list[_Part], output: Path) -> None:
    """The parts' rows, in order, as one dataset (generate-data's writer)."""
    from datasets import load_from_disk

    rows, prompts = [], []
    for part in parts:
        dataset = load_from_disk(str(part.path)).with_format(None)
        rows += [
            {"input_ids": ids, "loss_mask": mask}
            for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True)
        ]
        prompts += read_json(part.path / ROW_PROMPTS_FILE, list)
    write_dataset(rows, prompts, output, None)


def join_data(config: JoinConfig) -> TrainingData:
    """``join-data``: the parts joined into ``config.output``, with the vocabulary mapping of
    ``config.draft_vocab_size``. Returns the opened data."""
    output = Path(config.output)
    if not config.parts:
        raise UserError("join-data needs the parts' directories (PARTS), at least one.")
    if output.resolve() in {Path(p).resolve() for p in config.parts}:
        raise UserError(f"--output {output} is one of the parts; join them into a new directory.")
    if output.is_file():
        raise UserError(f"--output {output} is a file; choose a new or empty directory.")
    with exclusive_directory(output, "join-data"):
        settings = join_parts([Path(p) for p in config.parts], output, None)
        data = open_training_data(output, num_aux_layers=len(settings["target_layer_ids"]))
        data.vocab_mapping(config.draft_vocab_size)
    return data
