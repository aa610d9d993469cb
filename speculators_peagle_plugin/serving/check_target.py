"""The checker's target rules: the target's hidden size, vocabulary, head dim and tokenizer
against what the draft was trained for."""

from __future__ import annotations

from pathlib import Path

from ..model.mask_token import mask_token_problem
from .draft_checkpoint import (
    CPU_HEAD_DIMS,
    Finding,
    error,
    target_config,
    target_tokenizer,
    usable_mask_token_id,
    warning,
)


def check_target(config: dict, target: Path | None, device: str) -> list[Finding]:
    """The target findings for a draft ``config`` served on ``device``, in report order."""
    if target is None:
        return [
            warning(
                "no-target",
                "no local target (pass --target, or a local verifier path in the "
                "checkpoint), so hidden size, vocabulary, layer ids and mask token were "
                "not checked against it.",
                "Pass --target DIR.",
            )
        ]
    tcfg = target_config(target)
    layer = config["transformer_layer_config"]
    return [
        *_hidden_size(config, layer, target, tcfg),
        *_vocabulary(layer, target, tcfg),
        *_head_dim(device, tcfg),
        *_mask_token(config, target, tcfg),
    ]


def _hidden_size(config: dict, layer: dict, target: Path, tcfg) -> list[Finding]:
    want = config.get("target_hidden_size") or layer.get("hidden_size")
    if want is None or tcfg.hidden_size == want:
        return []
    return [
        error(
            "target-hidden",
            f"the target {str(target)!r} has hidden size {tcfg.hidden_size}, but the "
            f"draft was trained on hidden size {want}.",
            "Use the target the draft was trained for.",
        )
    ]


def _vocabulary(layer: dict, target: Path, tcfg) -> list[Finding]:
    vocab = layer.get("vocab_size")
    if vocab is None or tcfg.vocab_size == vocab:
        return []
    return [
        error(
            "target-vocab",
            f"the target {str(target)!r} has vocabulary {tcfg.vocab_size}, but the "
            f"draft was trained for {vocab}.",
            "Use the target the draft was trained for.",
        )
    ]


def _head_dim(device: str, tcfg) -> list[Finding]:
    dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    if device != "cpu" or dim in CPU_HEAD_DIMS:
        return []
    return [
        error(
            "head-dim",
            f"the target's head_dim {dim} is not supported by vLLM's CPU attention.",
            "Serve on CUDA.",
        )
    ]


def _mask_token(config: dict, target: Path, tcfg) -> list[Finding]:
    """The mask token must be one the target's tokenizer never produces."""
    mask_id = usable_mask_token_id(config)
    if mask_id is None:
        return []  # the config rule reports it
    tokenizer = target_tokenizer(target)
    if tokenizer is None:
        return [
            warning(
                "mask-token-id",
                f"the target {str(target)!r} has no tokenizer, so whether it can "
                "produce the mask token was not checked.",
                "Save the tokenizer with the target.",
            )
        ]

    problem = mask_token_problem(tokenizer, mask_id, tcfg.vocab_size)
    if not problem:
        return []
    return [
        error(
            "mask-token-id",
            problem,
            "Retrain with a mask token the tokenizer never produces "
            "(speculators-peagle train chooses one when --mask-token-id is not given).",
        )
    ]
