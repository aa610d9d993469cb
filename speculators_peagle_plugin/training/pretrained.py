"""Starting a run from a trained draft (``from_pretrained``): ours or speculators'.

As speculators' key means it: the draft's weights, then a fresh optimizer and schedule from
step 0 (continuing a run is ``--resume``; a resumed run never reads the pretrained draft
again, its checkpoint holds what it learned since). The draft is read by the loader
``eval`` and the held-out scoring use (:func:`~..model.build.load_reference_draft`:
speculators' ``from_pretrained`` into our class, the verifier pointed at the local target
for what the checkpoint leaves out), so a checkpoint of ours, its ``best/`` copy and
speculators' ``save_pretrained`` output load alike. Its weights, vocabulary mapping
(``d2t``/``t2d``: its ``lm_head`` rows mean those tokens) and mask token are kept; the rest
of the draft is built from this run's settings, which must describe the same shape.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..common.errors import UserError
from ..common.reading import first_line, read_json
from ..model.build import load_reference_draft

logger = logging.getLogger(__name__)

__all__ = ["check_pretrained_fits", "copy_pretrained_weights", "load_pretrained_draft"]


def load_pretrained_draft(path: str | Path, verifier_dir: str | Path) -> nn.Module:
    """The P-EAGLE draft in directory ``path``, on the CPU in float32.

    Raises ``ValueError`` (one sentence naming ``path``) when it is not a directory with a
    ``config.json``, not a P-EAGLE draft, holds no weights, or does not load.
    """
    path = Path(path)
    flag = f"--from-pretrained {path}"
    if not (path / "config.json").is_file():
        raise UserError(
            f"{flag} is not a draft directory (no config.json); give a checkpoint directory "
            "(ours, or speculators' save_pretrained output) on this machine."
        )
    kind = read_json(path / "config.json").get("speculators_model_type")
    if kind != "peagle":
        raise UserError(
            f"{flag} is a {kind or 'non-speculators'} draft (speculators_model_type "
            f"{kind!r}); only a P-EAGLE draft (peagle) can start a P-EAGLE run."
        )
    if not any(path.glob("*.safetensors")):
        raise UserError(
            f"{flag} holds no weights (*.safetensors), only a config; give a trained draft."
        )
    try:
        return load_reference_draft(path, verifier_dir)
    except Exception as exc:  # noqa: BLE001 - transformers/safetensors raise their own types
        raise UserError(f"{flag} does not load as a P-EAGLE draft ({first_line(exc)}).") from None


def check_pretrained_fits(
    pretrained: nn.Module,
    path: str | Path,
    *,
    num_layers: int,
    draft_vocab_size: int,
    target_layer_ids: tuple[int, ...],
    target_hidden_size: int,
    norm_before_residual: bool,
) -> None:
    """Raise ``ValueError`` (one sentence) naming each shape fact in which the pretrained
    draft differs from this run (its settings, its target and its data's aux layers).

    Example: a 2-layer draft into a run of ``--num-layers 1`` -> "... its draft layers 2,
    this run's 1 (--num-layers) ...".
    """
    config = pretrained.config
    facts = [
        ("draft layers", len(pretrained.layers), num_layers, "--num-layers"),
        ("draft vocabulary", config.draft_vocab_size, draft_vocab_size, "--draft-vocab-size"),
        ("aux layer ids", list(config.eagle_aux_hidden_state_layer_ids or []),
         list(target_layer_ids), "--target-layer-ids"),
        ("target hidden size", config.target_hidden_size or pretrained.hidden_size,
         target_hidden_size, "--verifier-name-or-path"),
        ("norm_before_residual", config.norm_before_residual, norm_before_residual,
         "--norm-before-residual"),
    ]
    differ = [f"its {what} {theirs}, this run's {ours} ({flag})"
              for what, theirs, ours, flag in facts if theirs != ours]
    if differ:
        raise UserError(
            f"--from-pretrained {path} does not fit this run: {'; '.join(differ)}; give the "
            "settings it was trained with, or start from another draft."
        )


def copy_pretrained_weights(pretrained: nn.Module, draft: nn.Module, path: str | Path) -> None:
    """Copy every tensor of ``pretrained`` into ``draft`` (built by this run, same shape).

    A tensor one of them lacks, or of another shape (a setting the shape facts do not name,
    such as ``--num-key-value-heads`` or ``--draft-arch``), is one sentence naming it.
    """
    theirs, ours = pretrained.state_dict(), draft.state_dict()
    for name in sorted(theirs.keys() | ours.keys()):
        mine, other = ours.get(name), theirs.get(name)
        if mine is None or other is None or mine.shape != other.shape:
            raise UserError(
                f"--from-pretrained {path} does not fit the draft this run builds: its {name} "
                f"is {_shape(other)}, this run's {_shape(mine)}; give the draft settings "
                "(--num-key-value-heads, --draft-arch, ...) it was trained with."
            )
    if "d2t" in ours and not torch.equal(ours["d2t"], theirs["d2t"]):
        logger.info(
            "%s keeps its own draft vocabulary (d2t/t2d), not the one the data's token "
            "frequencies give: its lm_head rows mean its tokens", path,
        )
    with torch.no_grad():
        draft.load_state_dict(theirs)


def _shape(tensor: torch.Tensor | None) -> str:
    return "absent" if tensor is None else str(list(tensor.shape))
