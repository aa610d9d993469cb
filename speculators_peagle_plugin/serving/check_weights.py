"""The checker's weight rules: names and shapes against the config, then the values.

The expected names and shapes come from the draft class itself, built from the config on
the meta device, so a rule never restates the architecture. Problems the config rules
already report (a missing draft_vocab_size, layer type or verifier path) are filled in
first, as ``export`` would fill them, so that each problem is reported once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from ..common.reading import first_line
from ..model.peagle_draft import PEagleDraftModel
from .draft_checkpoint import (
    PREFIX,
    VERIFIER_ONLY,
    DraftCheckpoint,
    Finding,
    error,
    layer_type_of,
    object_at,
    warning,
)

# Weights with a rule of their own, so "missing-weights" leaves them out; vLLM skips t2d.
_OWN_RULES = {"mask_hidden", "d2t", "embed_tokens.weight"}
_SKIPPED_BY_VLLM = "t2d"


@dataclass(frozen=True)
class _Weights:
    """What the weight rules compare: saved names -> shapes, and what the config implies."""

    config: dict
    shapes: dict[str, tuple[int, ...]]  # saved names without the "model." prefix
    expected: dict[str, tuple[int, ...]]


def check_weights(ckpt: DraftCheckpoint, scan_values: bool) -> Iterator[Finding]:
    """The weight findings of ``ckpt``, in report order; ``scan_values`` reads every tensor."""
    if not ckpt.files:
        yield error(
            "no-weights",
            "the checkpoint has no *.safetensors weights.",
            "Save the draft with save_pretrained (safetensors).",
        )
        return
    yield from _model_prefix(ckpt)
    shapes = {n.removeprefix(PREFIX): s for n, s in ckpt.shapes.items()}
    try:
        expected = _expected_shapes(_as_exported(ckpt.config, shapes))
    except Exception as exc:  # noqa: BLE001 - any construction failure is the finding
        yield error(
            "config",
            f"the config does not build a P-EAGLE draft ({type(exc).__name__}: {first_line(exc)}).",
            "Save the checkpoint with speculators' PEagleSpeculatorConfig.",
        )
        return
    weights = _Weights(ckpt.config, shapes, expected)
    for rule in _RULES:
        yield from rule(weights)
    if scan_values:
        yield from _values(ckpt)


def _as_exported(config: dict, shapes: dict) -> dict:
    """A copy of ``config`` with the gaps the config rules report filled as export fills
    them, so the weights are judged against the draft the fixed config describes."""
    config = json.loads(json.dumps(config))
    if config.get("draft_vocab_size") is None and "lm_head.weight" in shapes:
        config["draft_vocab_size"] = shapes["lm_head.weight"][0]
    if config["transformer_layer_config"].get("model_type") is None:
        config["transformer_layer_config"]["model_type"] = layer_type_of(shapes)
    verifier = object_at(config, "speculators_config").get("verifier")
    if isinstance(verifier, dict):
        verifier.setdefault("name_or_path", None)
    return config


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter shapes the config implies, from the draft class built on the meta device."""
    from speculators.models.peagle.config import PEagleSpeculatorConfig

    with torch.device("meta"):
        draft = PEagleDraftModel(PEagleSpeculatorConfig.from_dict(dict(config)))
    return {k: tuple(v.shape) for k, v in draft.state_dict().items() if k not in VERIFIER_ONLY}


def _model_prefix(ckpt: DraftCheckpoint) -> Iterator[Finding]:
    if any(n.startswith(PREFIX) for n in ckpt.shapes):
        yield error(
            "model-prefix",
            "weight names start with 'model.'; vLLM prepends its own prefix and "
            "would not find them.",
            "Strip the 'model.' prefix from the weight names.",
            mechanical=True,
        )


WeightRule = Callable[[_Weights], Iterable[Finding]]


def _unsaved(name: str, finding: Finding) -> WeightRule:
    """The rule of a weight that must be saved: ``finding`` when ``name`` is not."""

    def rule(w: _Weights) -> Iterator[Finding]:
        if name not in w.shapes:
            yield finding

    return rule


def _named(code: str, names: Callable[[_Weights], Iterable[str]], message: str, fix: str,
           mechanical: bool = False) -> WeightRule:
    """The rule of weights that must not be missing or saved: one error when ``names`` picks
    any, its ``message`` naming them (sorted) at ``{names}``."""

    def rule(w: _Weights) -> Iterator[Finding]:
        found = sorted(names(w))
        if found:
            yield error(code, message.format(names=found), fix, mechanical)

    return rule


_mask_hidden = _unsaved("mask_hidden", error(
    "mask-hidden",
    "the weights have no mask_hidden, the learned hidden state of the K-1 "
    "parallel slots; vLLM refuses to load the draft.",
    "Train the draft as P-EAGLE (a draft without mask_hidden was never "
    "trained to draft in parallel).",
))


def _d2t_saved(w: _Weights) -> Iterator[Finding]:
    """A reduced draft vocabulary needs d2t; export derives it from t2d when saved."""
    if "d2t" not in w.expected or "d2t" in w.shapes:
        return
    derivable = w.shapes.get("t2d") is not None
    yield error(
        "d2t",
        f"the draft vocabulary ({w.config.get('draft_vocab_size')}) is smaller than the "
        "target's, but d2t is missing: vLLM would map draft ids to the wrong target tokens.",
        "Save d2t (offsets: target id = draft id + d2t[draft id])"
        + (", derived from t2d." if derivable else "."),
        mechanical=derivable,
    )


_embed_tokens = _unsaved("embed_tokens.weight", warning(
    "embed-tokens",
    "embed_tokens is not saved; vLLM uses the target's embedding, so the "
    "mask token's embedding is the target's row, not a trained one.",
    "Save embed_tokens with the draft.",
))
_missing_weights = _named(
    "missing-weights",
    lambda w: set(w.expected) - set(w.shapes) - _OWN_RULES - {_SKIPPED_BY_VLLM},
    "weights {names} are missing; vLLM would leave them uninitialised.",
    "Save the complete draft state dict.",
)
_verifier_only_weights = _named(
    "extra-weights",
    lambda w: (n for n in w.shapes if n in VERIFIER_ONLY),
    "training-only weights {names} are saved; vLLM has no such parameters and refuses to "
    "load them.",
    "Drop them.",
    mechanical=True,
)
_foreign_weights = _named(
    "extra-weights",
    lambda w: set(w.shapes) - set(w.expected) - set(VERIFIER_ONLY) - {_SKIPPED_BY_VLLM},
    "weights {names} do not belong to this config's draft; vLLM refuses them.",
    "Save the weights of the draft the config describes.",
)


def _shapes(w: _Weights) -> Iterator[Finding]:
    for name, got in sorted(w.shapes.items()):
        want = w.expected.get(name)
        if want is not None and got != want:
            yield error(
                "shape",
                f"weight {name} has shape {list(got)}, but the config implies {list(want)}.",
                "Save the config that matches the weights.",
            )


_RULES: tuple[WeightRule, ...] = (
    _mask_hidden,
    _d2t_saved,
    _embed_tokens,
    _missing_weights,
    _verifier_only_weights,
    _foreign_weights,
    _shapes,
)


def _values(ckpt: DraftCheckpoint) -> Iterator[Finding]:
    """NaN/Inf in any float tensor, and a d2t that is not an ascending offset map.

    One pass over the tensors: both rules read values, and a checkpoint is read once.
    """
    bad = []
    vocab = ckpt.config["transformer_layer_config"].get("vocab_size")
    for name, tensor in ckpt.tensors():
        plain = name.removeprefix(PREFIX)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad.append(plain)
        if plain == "d2t" and vocab is not None and not _is_offset_map(tensor, vocab):
            yield error(
                "d2t",
                f"d2t maps draft ids outside [0, {vocab}) or to repeated / "
                "unordered target ids; it must hold offsets, target id = draft "
                "id + d2t[draft id], ascending.",
                "Save d2t in speculators' offset format.",
            )
    if bad:
        yield error(
            "non-finite",
            f"weights {bad} contain NaN or Inf (never loaded, or training diverged).",
            "Load the verifier's embeddings / lm_head before saving, or retrain.",
        )


def _is_offset_map(d2t: torch.Tensor, vocab: int) -> bool:
    """``target id = draft id + d2t[draft id]`` is inside ``[0, vocab)`` and ascending."""
    target_ids = torch.arange(d2t.shape[0]) + d2t.long()
    inside = bool(((target_ids >= 0) & (target_ids < vocab)).all())
    return inside and not bool((target_ids[1:] <= target_ids[:-1]).any())
