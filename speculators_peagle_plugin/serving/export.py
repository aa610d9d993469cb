"""Checkpoint exporter: a copy of a draft with every mechanical fix applied.

A fix is mechanical when the checkpoint itself (or a value the caller states, such as the
trained K) says what the right config or weights are: no retraining, no guessing. Each
fix below is named after the finding code it removes; :func:`export_checkpoint` applies
them all, checks the copy, and writes it only when no error remains.

Example::

    fixed, remaining = export_checkpoint("ckpt/", "ckpt-vllm/", target_dir="target/")
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..common.errors import UserError
from ..common.files import atomic_directory
from ..common.reading import read_json
from ..common.settings import setting
from ..model.model_card import check_base_model, read_card, write_model_card
from .check import ServedDraft, run_rules
from .draft_checkpoint import (
    DEFAULT_AUX_LAYERS,
    PREFIX,
    VERIFIER_ONLY,
    DraftCheckpoint,
    Finding,
    aux_layer_count,
    declared_k,
    default_device,
    layer_type_of,
    object_at,
    resolve_target,
)

__all__ = ["export_checkpoint"]


@dataclass(frozen=True, kw_only=True)
class ExportConfig(ServedDraft):
    """What ``speculators-peagle export`` writes, and what it fills in that the config lacks."""

    output: str = setting(help="Directory for the fixed copy.", argument=True)
    mask_token_id: int | None = setting(
        None, "The trained mask id, if the config lacks it.", show=None
    )
    num_speculative_tokens: int | None = setting(
        None, "The trained K, if the config lacks it.", short="-k", show=None
    )
    base_model: str | None = setting(
        None, "The target's hub model id (owner/name), for the copy's model card's base_model.",
        show="the card's, or the id the target's config names",
    )

    def __post_init__(self) -> None:
        check_base_model(self.base_model)


def export_checkpoint(
    draft_dir: str | Path,
    out_dir: str | Path,
    target_dir: str | Path | None = None,
    *,
    mask_token_id: int | None = None,
    num_speculative_tokens: int | None = None,
    device: str | None = None,
    base_model: str | None = None,
) -> tuple[list[Finding], list[Finding]]:
    """Write a copy of ``draft_dir`` to ``out_dir`` with every mechanical fix applied.

    Args:
        draft_dir, target_dir, device: as in :func:`~.check.check_checkpoint`.
        out_dir: a new directory (written under a temporary name, renamed when complete).
        mask_token_id, num_speculative_tokens: values for a checkpoint that lacks them
            (the id and K it was trained with; never used to override saved ones).
        base_model: the target's hub model id for the copy's model card, where the draft
            has a card (default: the card's own, see :func:`~.model_card.write_model_card`).

    Returns:
        ``(fixed, remaining)``: the findings fixed, and the warnings left in the copy.

    Raises :class:`~..common.errors.UserError` (a ``ValueError``; nothing written) if an
    error remains that needs more than a mechanical fix, ``out_dir`` exists, or one of the
    two directories is inside the other.
    """
    out_dir = Path(out_dir)
    check_base_model(base_model)
    _refuse_overlap(Path(draft_dir), out_dir)
    if out_dir.exists():
        raise UserError(f"{str(out_dir)!r} already exists; export writes a new directory.")
    ckpt = DraftCheckpoint.read(draft_dir)
    target = resolve_target(ckpt, target_dir)
    device = device or default_device()
    before = run_rules(ckpt, target, None, device, scan_values=True)
    config = json.loads(json.dumps(ckpt.config))
    tensors = {n.removeprefix(PREFIX): t for n, t in ckpt.tensors()}  # fixes model-prefix
    _fix_config(config, tensors, target, mask_token_id, num_speculative_tokens)
    _fix_weights(config, tensors)
    with atomic_directory(out_dir) as tmp:
        _write(ckpt, config, tensors, tmp)
        if read_card(tmp) is not None:  # fixes model-card: the copy's card states its config
            write_model_card(tmp, location=out_dir, base_model=base_model)
        after = run_rules(DraftCheckpoint.read(tmp), target, None, device, scan_values=True)
        errors = [f for f in after if f.severity == "error"]
        if errors:
            raise UserError(
                "export cannot fix every problem mechanically; still: "
                + " ".join(f"[{f.code}] {f.message}" for f in errors)
            )
    left = {(f.code, f.message) for f in after}
    fixed = [f for f in before if f.severity == "error" and (f.code, f.message) not in left]
    return fixed, after


def _refuse_overlap(draft_dir: Path, out_dir: Path) -> None:
    """A copy inside its source would copy itself; a source inside its copy would be replaced.

    Both are compared as real paths (symlinks and ``..`` resolved), so that two spellings of
    one directory are caught.
    """
    src, out = draft_dir.resolve(), out_dir.resolve()
    if out.is_relative_to(src):
        where = f"the output {str(out_dir)!r} is the checkpoint {str(draft_dir)!r} or inside it"
    elif src.is_relative_to(out):
        where = f"the checkpoint {str(draft_dir)!r} is inside the output {str(out_dir)!r}"
    else:
        return
    raise UserError(f"export cannot copy a checkpoint into itself: {where}; give an output "
                     "directory outside the checkpoint.")


def _write(ckpt: DraftCheckpoint, config: dict, tensors: dict, out: Path) -> None:
    """The fixed config and weights, and every other file of the checkpoint as it is."""
    skip = {"config.json", "model.safetensors.index.json"} | {f.name for f in ckpt.files}
    for item in ckpt.path.iterdir():
        if item.name in skip:
            continue
        copy = shutil.copytree if item.is_dir() else shutil.copy2
        copy(item, out / item.name)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def _fix_config(config, tensors, target, mask_token_id, num_speculative_tokens) -> None:
    """The config fixes, in an order where each reads what the ones before it set."""
    config.pop("model_type", None)  # model-type
    layer = config.setdefault("transformer_layer_config", {})
    if isinstance(layer, dict):
        _fix_layer_type(layer, tensors)
        _fix_fc_norm(config, layer)
        _fix_aux_count(config, layer)
    _fix_draft_vocab(config, tensors)
    # A null (or non-object) block gets the keys vLLM needs, as a missing one does.
    spec = config["speculators_config"] = object_at(config, "speculators_config")
    _fix_speculative_tokens(config, spec, num_speculative_tokens)
    _fix_verifier(spec, target)
    _fix_mask_token_id(config, mask_token_id)


def _fix_layer_type(layer: dict, tensors: dict) -> None:
    if layer.get("model_type") is None:
        layer["model_type"] = layer_type_of(tensors)


def _fix_fc_norm(config: dict, layer: dict) -> None:
    if config.get("fc_norm"):
        layer["fc_norm"] = True


def _fix_aux_count(config: dict, layer: dict) -> None:
    n_aux = aux_layer_count(config)
    if layer.get("model_type") == "llama" and n_aux != DEFAULT_AUX_LAYERS:
        layer.setdefault("num_aux_hidden_states", n_aux)


def _fix_draft_vocab(config: dict, tensors: dict) -> None:
    if config.get("draft_vocab_size") is None and "lm_head.weight" in tensors:
        config["draft_vocab_size"] = int(tensors["lm_head.weight"].shape[0])


def _fix_speculative_tokens(config: dict, spec: dict, num_speculative_tokens) -> None:
    if declared_k(config) is not None or num_speculative_tokens is None:
        return
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        methods = spec["proposal_methods"] = [{}]
    methods[0].setdefault("proposal_type", "greedy")
    methods[0]["speculative_tokens"] = int(num_speculative_tokens)
    spec.setdefault("default_proposal_method", "greedy")


def _fix_verifier(spec: dict, target: Path | None) -> None:
    spec.setdefault("algorithm", "peagle")  # the check's first rule passed on the model type
    verifier = spec["verifier"] = object_at(spec, "verifier")
    if "name_or_path" not in verifier:
        verifier["name_or_path"] = None if target is None else str(target)
    if "architectures" not in verifier and target is not None:
        verifier["architectures"] = read_json(target / "config.json").get("architectures") or []


def _fix_mask_token_id(config: dict, mask_token_id: int | None) -> None:
    if mask_token_id is None:
        return
    saved = config.get("mask_token_id")
    if saved is not None and saved != mask_token_id:
        raise UserError(
            f"the checkpoint already has mask_token_id {saved}; --mask-token-id only "
            "fills a missing one (the id is fixed by training)."
        )
    config["mask_token_id"] = int(mask_token_id)


def _fix_weights(config: dict, tensors: dict) -> None:
    """The weight fixes: extra-weights (training-only), d2t, layer-order."""
    for name in VERIFIER_ONLY:
        tensors.pop(name, None)
    _fix_d2t(config, tensors)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids and len(set(ids)) == len(ids) and list(ids) != sorted(ids):
        _fix_layer_order(config, tensors, list(ids))


def _fix_d2t(config: dict, tensors: dict) -> None:
    """d2t from a saved t2d: the draft's target ids, as offsets from the draft ids."""
    if "d2t" in tensors or tensors.get("t2d") is None:
        return
    t2d = tensors["t2d"].bool()
    if int(t2d.sum()) == config.get("draft_vocab_size"):
        ids = torch.nonzero(t2d).squeeze(1)
        tensors["d2t"] = ids - torch.arange(ids.shape[0])


def _fix_layer_order(config: dict, tensors: dict, ids: list[int]) -> None:
    """Reorder the aux blocks so that the fc input matches vLLM's ascending layer order.

    The fc input is ``concat(aux[ids[0]], aux[ids[1]], ...)``; vLLM concatenates in
    ascending layer order, so every tensor indexed by fc's input (fc columns,
    ``mask_hidden``, a ``norm_before_fc`` norm, per-aux ``fc_norm`` norms) is permuted
    block-wise to that order.
    """
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    n_aux = len(ids)

    def permute_last(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.chunk(n_aux, dim=-1)[i] for i in order], dim=-1)

    for name in ("fc.weight", "mask_hidden", "input_norm.weight"):
        if name in tensors:
            tensors[name] = permute_last(tensors[name])
    norms = {
        i: tensors.pop(f"fc_norm.{i}.weight")
        for i in range(n_aux)
        if f"fc_norm.{i}.weight" in tensors
    }
    for new, old in enumerate(order):
        if old in norms:
            tensors[f"fc_norm.{new}.weight"] = norms[old]
    config["eagle_aux_hidden_state_layer_ids"] = sorted(ids)
