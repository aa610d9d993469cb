"""A draft checkpoint as the checker and the exporter see it, and the Finding they report.

:class:`DraftCheckpoint` reads ``config.json`` and the safetensors headers (names, shapes)
without loading a tensor; :meth:`DraftCheckpoint.tensors` loads them when a rule or a fix
needs the values. The facts both derive from a config (trained K, aux-layer count, layer
type, head dim) and the target's location live here, once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from ..common.errors import UserError
from ..common.reading import load_safetensors, read_json, safetensors_problem
from ..model.speculators_config import declared_k, is_int, object_at

PREFIX = "model."  # a prefix vLLM adds itself; saved names must not carry it
VERIFIER_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")  # training-only weights
# vLLM's CPUAttentionBackend.get_supported_head_sizes() (tests compare with vLLM).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DEFAULT_AUX_LAYERS = 3  # vLLM feeds the target's layers (2, N//2, N-3) when none are recorded


@dataclass(frozen=True)
class Finding:
    """One problem: what is wrong, how to fix it, and whether ``export`` fixes it.

    Args:
        code: short stable id, e.g. ``mask-hidden``.
        severity: ``error`` (vLLM rejects or mis-serves) or ``warning``.
        message: one sentence, what is wrong.
        fix: one sentence, what to do.
        mechanical: ``export`` can fix it without retraining.
    """

    code: str
    severity: Literal["error", "warning"]
    message: str
    fix: str
    mechanical: bool = False

    def __str__(self) -> str:
        auto = " (export fixes this)" if self.mechanical else ""
        return f"{self.severity} [{self.code}]: {self.message} Fix: {self.fix}{auto}"


def error(code: str, message: str, fix: str, mechanical: bool = False) -> Finding:
    return Finding(code, "error", message, fix, mechanical)


def warning(code: str, message: str, fix: str, mechanical: bool = False) -> Finding:
    return Finding(code, "warning", message, fix, mechanical)


@dataclass
class DraftCheckpoint:
    """config.json plus the safetensors headers (names, shapes) of a checkpoint dir."""

    path: Path
    config: dict
    files: list[Path]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    file_of: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path) -> DraftCheckpoint:
        path = Path(path)
        if not path.is_dir():
            raise UserError(f"draft checkpoint {str(path)!r} is not a directory.")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise UserError(
                f"{str(path)!r} has no config.json; pass a speculators-format checkpoint directory."
            )
        ckpt = cls(path, read_json(config_file), sorted(path.glob("*.safetensors")))
        for file in ckpt.files:
            try:
                with safe_open(str(file), "pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                        ckpt.shapes[name] = tuple(f.get_slice(name).get_shape())
                        ckpt.file_of[name] = file
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise safetensors_problem(file, exc) from None
        return ckpt

    def tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        for file in self.files:
            yield from load_safetensors(file).items()


def resolve_target(ckpt: DraftCheckpoint, target_dir: str | Path | None) -> Path | None:
    """``target_dir``, else the checkpoint's verifier path when that is a local model."""
    if target_dir is not None:
        target = Path(target_dir)
        if not (target / "config.json").is_file():
            raise UserError(
                f"target {str(target)!r} is not a local model directory (no config.json)."
            )
        return target
    verifier = object_at(ckpt.config, "speculators_config").get("verifier")
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    if name and (Path(name) / "config.json").is_file():
        return Path(name)
    return None




def target_config(target_dir: Path):
    """The target's (text) transformers config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(target_dir))
    return getattr(config, "text_config", None) or config


def target_tokenizer(target_dir: Path):
    """The target's tokenizer, or ``None`` when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target_dir))
    except (OSError, ValueError):
        return None


def default_device() -> str:
    """Where a draft is served when the caller does not say: this machine's device."""
    return "cuda" if torch.cuda.is_available() else "cpu"




def trained_depths(config: dict) -> int | None:
    """The depths a checkpoint was trained for: its ``num_depths`` where training declared
    fewer for serving (``train --num-speculative-tokens``), else the declared K."""
    depths = config.get("num_depths")
    return depths if is_int(depths) and depths >= 1 else declared_k(config)




def usable_mask_token_id(config: dict) -> int | None:
    """The config's ``mask_token_id`` if it is an integer inside the embedding, else None."""
    mask_id = config.get("mask_token_id")
    if not is_int(mask_id):
        return None
    vocab = config["transformer_layer_config"].get("vocab_size")
    return None if vocab is not None and not 0 <= mask_id < vocab else mask_id


def aux_layer_count(config: dict) -> int:
    """How many aux hidden states the draft's ``fc`` reads: one per recorded layer id,
    or vLLM's default when none are recorded."""
    return len(config.get("eagle_aux_hidden_state_layer_ids") or ()) or DEFAULT_AUX_LAYERS


def head_dim(layer: dict) -> int | None:
    """A layer config's head dim: ``head_dim``, else ``hidden_size / num_attention_heads``."""
    if layer.get("head_dim"):
        return int(layer["head_dim"])
    heads = layer.get("num_attention_heads")
    return layer["hidden_size"] // heads if heads and layer.get("hidden_size") else None


def layer_type_of(names: Iterable[str]) -> str:
    """The decoder layer type weight names imply: qwen3 layers carry per-head q/k norms,
    llama layers do not."""
    return "qwen3" if any(".self_attn.q_norm." in n for n in names) else "llama"
