"""Where a run's draft weights start: the verifier, a checkpoint to resume, a pretrained
draft, and the mask token id they fix (the first step of
:func:`~.loop.build_training`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..common.errors import UserError
from ..common.reading import read_json
from ..model.mask_token import choose_mask_token_id, mask_token_problem
from .algorithm import load_algorithm
from .checkpoint import ResumePoint, resume_point
from .distributed import World
from .pretrained import load_pretrained_draft
from .train_config import TrainConfig

__all__ = ["WeightsStart", "start_weights"]


@dataclass
class WeightsStart:
    """What the draft starts from, read and checked before any data is opened."""

    algorithm: object
    verifier_config: object  # the verifier's (text) transformers config
    resume: ResumePoint | None
    pretrained: nn.Module | None  # None when resumed: the checkpoint holds the weights
    mask_token_id: int
    mask_token_reason: str


def start_weights(config: TrainConfig, save_path: Path | None, world: World) -> WeightsStart:
    """The algorithm, the verifier's config, the checkpoint to resume in ``save_path``, the
    ``from_pretrained`` draft and the mask token id; ``ValueError`` (one sentence) on bad
    input."""
    algorithm = load_algorithm(config.algorithm)
    verifier_config = _verifier_config(config)
    vocab, draft_vocab = verifier_config.vocab_size, config.draft.draft_vocab_size
    if draft_vocab > vocab:
        raise UserError(
            f"--draft-vocab-size {draft_vocab} exceeds the target's vocabulary ({vocab})."
        )
    resume = None if save_path is None else resume_point(config, save_path, world)
    pretrained = None
    if config.draft.from_pretrained and resume is None:  # a resumed run has its checkpoint
        pretrained = load_pretrained_draft(
            config.draft.from_pretrained, config.verifier.verifier_name_or_path
        )
    kept = _kept_mask_token(config, pretrained, resume)
    mask_token_id, reason = _resolve_mask_token(config, vocab, kept)
    return WeightsStart(algorithm, verifier_config, resume, pretrained, mask_token_id, reason)


def _resolve_mask_token(
    config: TrainConfig, vocab_size: int, kept: tuple[int, str] | None
) -> tuple[int, str]:
    """``--mask-token-id``, else ``kept`` (the id a draft run from ``--from-pretrained``
    was trained with), else one the tokenizer never produces; with the reason."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.verifier.verifier_name_or_path)
    given = config.draft.mask_token_id
    if given is None and kept is None:
        return choose_mask_token_id(tokenizer, vocab_size)
    mask, reason = (given, "given with --mask-token-id") if given is not None else kept
    problem = mask_token_problem(tokenizer, mask, vocab_size)
    if problem:
        raise UserError(problem)
    return mask, reason


def _kept_mask_token(config: TrainConfig, pretrained, resume) -> tuple[int, str] | None:
    """The mask token id of the draft a ``--from-pretrained`` run continues: the pretrained
    draft's, or, resumed, its checkpoint's (the same id, without reading that draft again).

    A ``--mask-token-id`` other than the pretrained draft's is one sentence.
    """
    if resume is not None and config.draft.from_pretrained:
        kept = read_json(resume.path / "config.json").get("mask_token_id")
        return None if kept is None else (kept, f"the one {resume.path.name} was trained with")
    if pretrained is None:
        return None
    kept, given = pretrained.config.mask_token_id, config.draft.mask_token_id
    if given is not None and given != kept:
        raise UserError(
            f"--mask-token-id {given} differs from the mask token {kept} that --from-pretrained "
            f"{config.draft.from_pretrained} was trained with; pass {kept} or leave it out."
        )
    return kept, "the one --from-pretrained's draft was trained with"


def _verifier_config(config: TrainConfig):
    """The verifier's (text) config, read from its local directory; the hub is not used."""
    from transformers import AutoConfig

    verifier = Path(config.verifier.verifier_name_or_path)
    if not (verifier / "config.json").exists():
        raise UserError(
            f"--verifier-name-or-path {verifier} is not a local transformers model directory "
            "(no config.json); the hub is not used."
        )
    verifier_config = AutoConfig.from_pretrained(verifier)
    return getattr(verifier_config, "text_config", verifier_config)
