"""Checkpoint linter and exporter: every way vLLM would reject or silently mis-serve a draft.

The rules come from vLLM 0.32's loading path for ``speculators_model_type: "peagle"``
(``vllm/transformers_utils/configs/speculators/{base,algos}.py``,
``vllm/model_executor/models/{llama,qwen3}_eagle3.py``, ``vllm/v1/worker/gpu_model_runner.py``)
and are listed in DESIGN §5. :func:`check_checkpoint` returns one :class:`Finding` per
problem, each with the fix; :func:`export_checkpoint` writes a fixed copy where the fix
is mechanical (no retraining, no guessing), and refuses when a problem remains.

Example::

    for f in check_checkpoint("ckpt/", target_dir="target/"):
        print(f)        # error [mask-hidden]: ... Fix: ...
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "CPU_HEAD_DIMS",
    "Finding",
    "check_checkpoint",
    "export_checkpoint",
    "trained_depths",
]

# vLLM 0.32 CPUAttentionBackend.get_supported_head_sizes() (tests compare with vLLM).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
LAYER_TYPES = ("llama", "qwen3")  # vLLM's peagle architecture map
VERIFIER_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")  # training-only weights
PREFIX = "model."


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


def _error(code, message, fix, mechanical=False) -> Finding:
    return Finding(code, "error", message, fix, mechanical)


def _warning(code, message, fix, mechanical=False) -> Finding:
    return Finding(code, "warning", message, fix, mechanical)


# ------------------------------------------------------------------------ reading


@dataclass
class _Checkpoint:
    """config.json plus the safetensors headers (names, shapes) of a checkpoint dir."""

    path: Path
    config: dict
    files: list[Path]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    file_of: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path) -> _Checkpoint:
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"draft checkpoint {str(path)!r} is not a directory.")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(
                f"{str(path)!r} has no config.json; pass a speculators-format checkpoint directory."
            )
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{str(config_file)!r} is not valid JSON ({exc}).") from exc
        ckpt = cls(path, config, sorted(path.glob("*.safetensors")))
        for file in ckpt.files:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    ckpt.shapes[name] = tuple(f.get_slice(name).get_shape())
                    ckpt.file_of[name] = file
        return ckpt

    def tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        for file in self.files:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():  # noqa: SIM118
                    yield name, f.get_tensor(name)


def _target_config(target_dir: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(target_dir))
    return getattr(config, "text_config", None) or config


def _target_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target_dir))
    except (OSError, ValueError):
        return None


def _resolve_target(ckpt: _Checkpoint, target_dir) -> Path | None:
    if target_dir is not None:
        target = Path(target_dir)
        if not (target / "config.json").is_file():
            raise ValueError(
                f"target {str(target)!r} is not a local model directory (no config.json)."
            )
        return target
    verifier = (ckpt.config.get("speculators_config") or {}).get("verifier") or {}
    name = verifier.get("name_or_path")
    if name and (Path(name) / "config.json").is_file():
        return Path(name)
    return None


def trained_depths(config: dict) -> int | None:
    """The ``speculative_tokens`` (K) a checkpoint config declares, or ``None``."""
    try:
        k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    except (KeyError, IndexError, TypeError):
        return None
    return k if isinstance(k, int) and not isinstance(k, bool) and k >= 1 else None


def _head_dim(layer: dict) -> int | None:
    if layer.get("head_dim"):
        return int(layer["head_dim"])
    heads = layer.get("num_attention_heads")
    return layer["hidden_size"] // heads if heads and layer.get("hidden_size") else None


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter shapes the config implies, from the draft class built on the meta device."""
    from speculators.models.peagle.config import PEagleSpeculatorConfig

    from ..model.peagle_draft import PEagleDraftModel

    with torch.device("meta"):
        draft = PEagleDraftModel(PEagleSpeculatorConfig.from_dict(dict(config)))
    return {k: tuple(v.shape) for k, v in draft.state_dict().items() if k not in VERIFIER_ONLY}


def _layer_type(names: Iterable[str]) -> str:
    """qwen3 layers carry per-head q/k norms; llama layers do not."""
    return "qwen3" if any(".self_attn.q_norm." in n for n in names) else "llama"


def _positions(first: int, last: int) -> str:
    return f"position {first}" if first == last else f"positions {first}..{last}"


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------- checking


def check_checkpoint(
    draft_dir: str | Path,
    target_dir: str | Path | None = None,
    *,
    num_speculative_tokens: int | None = None,
    device: str | None = None,
    scan_values: bool = True,
) -> list[Finding]:
    """Every reason vLLM would reject or silently mis-serve ``draft_dir``, errors first.

    Args:
        draft_dir: a speculators-format checkpoint directory.
        target_dir: the local target; defaults to the checkpoint's verifier path when
            that is a local directory. Without one, target checks are skipped (warning).
        num_speculative_tokens: the K it will be served with (warns past the trained K).
        device: where it will be served: ``cpu`` also checks head dims against vLLM's
            CPU attention, ``cuda`` / ``any`` do not; default: ``cuda`` if available.
        scan_values: also read every tensor for NaN/Inf (never-loaded or diverged weights).

    Raises ``ValueError`` for a missing directory or unreadable config (bad input);
    everything else is a finding.
    """
    if device not in (None, "cpu", "cuda", "any"):
        raise ValueError(f"device must be cpu, cuda or any, got {device!r}.")
    ckpt = _Checkpoint.read(draft_dir)
    target = _resolve_target(ckpt, target_dir)
    device = device or _default_device()
    findings = _check(ckpt, target, num_speculative_tokens, device, scan_values)
    return sorted(findings, key=lambda f: f.severity != "error")


def _check(ckpt, target, k, device, scan_values) -> list[Finding]:  # noqa: C901
    cfg = ckpt.config
    out: list[Finding] = []
    kind = cfg.get("speculators_model_type")
    if kind != "peagle":
        if kind is None:
            return [
                _error(
                    "not-speculators",
                    "config.json has no speculators_model_type, so this is not a "
                    "speculators-format checkpoint.",
                    "Save the draft with speculators-peagle train or speculators.",
                )
            ]
        return [
            _error(
                "not-peagle",
                f"speculators_model_type is {kind!r}, not 'peagle': vLLM would not draft "
                "the K tokens in parallel from a mask token.",
                "Train a P-EAGLE draft (speculators-peagle train --algorithm peagle).",
            )
        ]
    if "model_type" in cfg:
        out.append(
            _error(
                "model-type",
                f"config.json has a top-level model_type ({cfg['model_type']!r}), so vLLM "
                "loads it as a plain model instead of a speculators draft.",
                "Remove the top-level model_type key.",
                mechanical=True,
            )
        )
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        out.append(
            _error(
                "layer-config",
                "transformer_layer_config is missing or not an object; vLLM cannot build "
                "the draft layers.",
                "Save the checkpoint with speculators' PEagleSpeculatorConfig.",
            )
        )
        return out
    if layer.get("model_type") is None:
        out.append(
            _error(
                "layer-type",
                "transformer_layer_config has no model_type: vLLM builds llama layers, "
                "speculators qwen3 layers.",
                "Set transformer_layer_config.model_type to the trained layer type "
                "(export infers it from the weights).",
                mechanical=True,
            )
        )
    elif layer["model_type"] not in LAYER_TYPES:
        out.append(
            _error(
                "layer-type",
                f"transformer_layer_config.model_type is {layer['model_type']!r}; vLLM's "
                f"P-EAGLE supports only {', '.join(LAYER_TYPES)}.",
                "Train the draft with llama or qwen3 layers (--draft-arch).",
            )
        )
        return out
    spec = cfg.get("speculators_config")
    trained_k = trained_depths(cfg)
    if trained_k is None:
        out.append(
            _error(
                "speculative-tokens",
                "speculators_config.proposal_methods[0].speculative_tokens is missing or "
                "not a positive integer; vLLM refuses the config.",
                "Set it to the trained K (export --num-speculative-tokens K).",
                mechanical=True,
            )
        )
    if not isinstance(spec, dict) or "name_or_path" not in (spec.get("verifier") or {}):
        out.append(
            _error(
                "verifier",
                "speculators_config.verifier.name_or_path is missing; vLLM refuses the config.",
                "Add it (the target's path or name; export writes --target or null).",
                mechanical=True,
            )
        )
    if k is not None and trained_k is not None and k > trained_k:
        out.append(
            _warning(
                "depth",
                f"K = {k} is past the {trained_k} depths the draft was trained for; "
                f"acceptance at {_positions(trained_k + 1, k)} is meaningless.",
                f"Serve with num_speculative_tokens <= {trained_k}.",
            )
        )
    vocab = layer.get("vocab_size")
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is None:
        out.append(
            _error(
                "draft-vocab",
                "draft_vocab_size is missing: vLLM assumes the full vocabulary and "
                "speculators 32000.",
                "Set draft_vocab_size to lm_head's row count.",
                mechanical=True,
            )
        )
    if cfg.get("fc_norm") and not layer.get("fc_norm"):
        out.append(
            _error(
                "fc-norm",
                "fc_norm is true, but vLLM 0.32 reads it for P-EAGLE only from "
                "transformer_layer_config, so it would reject the fc_norm weights.",
                "Copy fc_norm: true into transformer_layer_config.",
                mechanical=True,
            )
        )
    mask_id = cfg.get("mask_token_id")
    if mask_id is None or isinstance(mask_id, bool) or not isinstance(mask_id, int):
        out.append(
            _error(
                "mask-token-id",
                f"mask_token_id is {mask_id!r}; vLLM needs the integer id the draft was "
                "trained with to fill the K-1 parallel slots.",
                "Set mask_token_id to the trained id (export --mask-token-id ID).",
                mechanical=True,
            )
        )
        mask_id = None
    elif vocab is not None and not 0 <= mask_id < vocab:
        out.append(
            _error(
                "mask-token-id",
                f"mask_token_id {mask_id} is outside the embedding [0, {vocab}).",
                "Retrain with a mask token inside the vocabulary that the tokenizer never "
                "produces.",
            )
        )
        mask_id = None
    head_dim = _head_dim(layer)
    if device == "cpu" and head_dim is not None and head_dim not in CPU_HEAD_DIMS:
        out.append(
            _error(
                "head-dim",
                f"the draft's head_dim {head_dim} is not supported by vLLM's CPU attention "
                f"({', '.join(map(str, CPU_HEAD_DIMS))}).",
                "Serve on CUDA, or train the draft with a supported head_dim.",
            )
        )
    out += _check_layer_ids(cfg, target)
    n_aux = len(cfg.get("eagle_aux_hidden_state_layer_ids") or ()) or 3
    if layer.get("model_type") == "llama" and n_aux != 3 and "num_aux_hidden_states" not in layer:
        out.append(
            _error(
                "aux-count",
                f"the draft reads {n_aux} aux layers, but vLLM 0.32's llama P-EAGLE draft "
                "sizes fc for 3 unless transformer_layer_config says otherwise.",
                f"Set transformer_layer_config.num_aux_hidden_states = {n_aux}.",
                mechanical=True,
            )
        )
    out += _check_weights(ckpt, layer, draft_vocab, scan_values)
    if target is None:
        out.append(
            _warning(
                "no-target",
                "no local target (pass --target, or a local verifier path in the "
                "checkpoint), so hidden size, vocabulary, layer ids and mask token were "
                "not checked against it.",
                "Pass --target DIR.",
            )
        )
    else:
        out += _check_target(cfg, layer, target, mask_id, device)
    return out


def _check_layer_ids(cfg: dict, target: Path | None) -> list[Finding]:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return [
            _warning(
                "layer-ids",
                "eagle_aux_hidden_state_layer_ids is not recorded; vLLM feeds the "
                "target's default layers (2, N//2, N-3).",
                "Record the layer ids the draft was trained on.",
            )
        ]
    out = []
    if len(set(ids)) != len(ids):
        out.append(
            _error(
                "layer-ids",
                f"eagle_aux_hidden_state_layer_ids {ids} repeats a layer; vLLM captures "
                "each layer once, so the draft gets fewer aux states than it expects.",
                "Retrain with distinct layer ids.",
            )
        )
    elif list(ids) != sorted(ids):
        out.append(
            _error(
                "layer-order",
                f"eagle_aux_hidden_state_layer_ids {ids} is not ascending; vLLM "
                "concatenates aux states in layer order, so fc would read them permuted.",
                "Sort the ids and permute fc / mask_hidden column blocks to match.",
                mechanical=True,
            )
        )
    if target is not None:
        n = _target_config(target).num_hidden_layers
        bad = [i for i in ids if not 0 <= i <= n]
        if bad:
            out.append(
                _error(
                    "layer-ids",
                    f"aux layer ids {bad} are outside [0, {n}] for a target with {n} "
                    "layers; vLLM never captures them.",
                    "Use the target the draft was trained for.",
                )
            )
    return out


def _check_weights(ckpt, layer, draft_vocab, scan_values) -> list[Finding]:  # noqa: C901
    if not ckpt.files:
        return [
            _error(
                "no-weights",
                "the checkpoint has no *.safetensors weights.",
                "Save the draft with save_pretrained (safetensors).",
            )
        ]
    out = []
    names = set(ckpt.shapes)
    if any(n.startswith(PREFIX) for n in names):
        out.append(
            _error(
                "model-prefix",
                "weight names start with 'model.'; vLLM prepends its own prefix and "
                "would not find them.",
                "Strip the 'model.' prefix from the weight names.",
                mechanical=True,
            )
        )
    shapes = {n.removeprefix(PREFIX): s for n, s in ckpt.shapes.items()}
    config = json.loads(json.dumps(ckpt.config))
    if config.get("draft_vocab_size") is None and "lm_head.weight" in shapes:
        config["draft_vocab_size"] = shapes["lm_head.weight"][0]
    # Problems reported above: judge the weights as export would fix the config.
    if layer.get("model_type") is None:
        config["transformer_layer_config"]["model_type"] = _layer_type(shapes)
    verifier = (config.get("speculators_config") or {}).get("verifier")
    if isinstance(verifier, dict):
        verifier.setdefault("name_or_path", None)
    try:
        expected = _expected_shapes(config)
    except Exception as exc:  # noqa: BLE001 - any construction failure is the finding
        return [
            *out,
            _error(
                "config",
                f"the config does not build a P-EAGLE draft ({type(exc).__name__}: {exc}).",
                "Save the checkpoint with speculators' PEagleSpeculatorConfig.",
            ),
        ]
    if "mask_hidden" not in shapes:
        out.append(
            _error(
                "mask-hidden",
                "the weights have no mask_hidden, the learned hidden state of the K-1 "
                "parallel slots; vLLM refuses to load the draft.",
                "Train the draft as P-EAGLE (a draft without mask_hidden was never "
                "trained to draft in parallel).",
            )
        )
    if "d2t" in expected and "d2t" not in shapes:
        derivable = shapes.get("t2d") is not None
        out.append(
            _error(
                "d2t",
                f"the draft vocabulary ({draft_vocab}) is smaller than the target's, but "
                "d2t is missing: vLLM would map draft ids to the wrong target tokens.",
                "Save d2t (offsets: target id = draft id + d2t[draft id])"
                + (", derived from t2d." if derivable else "."),
                mechanical=derivable,
            )
        )
    if "embed_tokens.weight" not in shapes:
        out.append(
            _warning(
                "embed-tokens",
                "embed_tokens is not saved; vLLM uses the target's embedding, so the "
                "mask token's embedding is the target's row, not a trained one.",
                "Save embed_tokens with the draft.",
            )
        )
    missing = sorted(set(expected) - set(shapes) - {"mask_hidden", "d2t", "embed_tokens.weight"})
    missing = [n for n in missing if n != "t2d"]  # vLLM skips t2d
    if missing:
        out.append(
            _error(
                "missing-weights",
                f"weights {missing} are missing; vLLM would leave them uninitialised.",
                "Save the complete draft state dict.",
            )
        )
    verifier_only = sorted(n for n in shapes if n in VERIFIER_ONLY)
    extra = sorted(set(shapes) - set(expected) - set(VERIFIER_ONLY) - {"t2d"})
    if verifier_only:
        out.append(
            _error(
                "extra-weights",
                f"training-only weights {verifier_only} are saved; vLLM has no such "
                "parameters and refuses to load them.",
                "Drop them.",
                mechanical=True,
            )
        )
    if extra:
        out.append(
            _error(
                "extra-weights",
                f"weights {extra} do not belong to this config's draft; vLLM refuses them.",
                "Save the weights of the draft the config describes.",
            )
        )
    wrong = {n: (s, expected[n]) for n, s in shapes.items() if n in expected and s != expected[n]}
    for name, (got, want) in sorted(wrong.items()):
        out.append(
            _error(
                "shape",
                f"weight {name} has shape {list(got)}, but the config implies {list(want)}.",
                "Save the config that matches the weights.",
            )
        )
    if scan_values:
        out += _check_values(ckpt, layer)
    return out


def _check_values(ckpt, layer) -> list[Finding]:
    out, bad = [], []
    vocab = layer.get("vocab_size")
    for name, tensor in ckpt.tensors():
        plain = name.removeprefix(PREFIX)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad.append(plain)
        if plain == "d2t" and vocab is not None:
            target_ids = torch.arange(tensor.shape[0]) + tensor.long()
            if not bool(((target_ids >= 0) & (target_ids < vocab)).all()) or bool(
                (target_ids[1:] <= target_ids[:-1]).any()
            ):
                out.append(
                    _error(
                        "d2t",
                        f"d2t maps draft ids outside [0, {vocab}) or to repeated / "
                        "unordered target ids; it must hold offsets, target id = draft "
                        "id + d2t[draft id], ascending.",
                        "Save d2t in speculators' offset format.",
                    )
                )
    if bad:
        out.append(
            _error(
                "non-finite",
                f"weights {bad} contain NaN or Inf (never loaded, or training diverged).",
                "Load the verifier's embeddings / lm_head before saving, or retrain.",
            )
        )
    return out


def _check_target(cfg, layer, target: Path, mask_id, device) -> list[Finding]:
    out = []
    tcfg = _target_config(target)
    want_hidden = cfg.get("target_hidden_size") or layer.get("hidden_size")
    if want_hidden is not None and tcfg.hidden_size != want_hidden:
        out.append(
            _error(
                "target-hidden",
                f"the target {str(target)!r} has hidden size {tcfg.hidden_size}, but the "
                f"draft was trained on hidden size {want_hidden}.",
                "Use the target the draft was trained for.",
            )
        )
    if layer.get("vocab_size") is not None and tcfg.vocab_size != layer["vocab_size"]:
        out.append(
            _error(
                "target-vocab",
                f"the target {str(target)!r} has vocabulary {tcfg.vocab_size}, but the "
                f"draft was trained for {layer['vocab_size']}.",
                "Use the target the draft was trained for.",
            )
        )
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    if device == "cpu" and head_dim not in CPU_HEAD_DIMS:
        out.append(
            _error(
                "head-dim",
                f"the target's head_dim {head_dim} is not supported by vLLM's CPU attention.",
                "Serve on CUDA.",
            )
        )
    if mask_id is not None:
        tokenizer = _target_tokenizer(target)
        if tokenizer is None:
            out.append(
                _warning(
                    "mask-token-id",
                    f"the target {str(target)!r} has no tokenizer, so whether it can "
                    "produce the mask token was not checked.",
                    "Save the tokenizer with the target.",
                )
            )
        else:
            from ..model.mask_token import mask_token_problem

            problem = mask_token_problem(tokenizer, mask_id, tcfg.vocab_size)
            if problem:
                out.append(
                    _error(
                        "mask-token-id",
                        problem,
                        "Retrain with a mask token the tokenizer never produces "
                        "(speculators-peagle train chooses one when --mask-token-id is "
                        "not given).",
                    )
                )
    return out


# ------------------------------------------------------------------------ export


def export_checkpoint(
    draft_dir: str | Path,
    out_dir: str | Path,
    target_dir: str | Path | None = None,
    *,
    mask_token_id: int | None = None,
    num_speculative_tokens: int | None = None,
    device: str | None = None,
) -> tuple[list[Finding], list[Finding]]:
    """Write a copy of ``draft_dir`` to ``out_dir`` with every mechanical fix applied.

    Args:
        draft_dir, target_dir, device: as in :func:`check_checkpoint`.
        out_dir: a new directory (written under a temporary name, renamed when complete).
        mask_token_id, num_speculative_tokens: values for a checkpoint that lacks them
            (the id and K it was trained with; never used to override saved ones).

    Returns:
        ``(fixed, remaining)``: the findings fixed, and the warnings left in the copy.

    Raises ``ValueError`` (nothing written) if an error remains that needs more than a
    mechanical fix, or ``out_dir`` exists.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ValueError(f"{str(out_dir)!r} already exists; export writes a new directory.")
    ckpt = _Checkpoint.read(draft_dir)
    target = _resolve_target(ckpt, target_dir)
    device = device or _default_device()
    before = _check(ckpt, target, None, device, scan_values=True)
    config = json.loads(json.dumps(ckpt.config))
    tensors = {n.removeprefix(PREFIX): t for n, t in ckpt.tensors()}
    _fix_config(config, tensors, target, mask_token_id, num_speculative_tokens)
    _fix_weights(config, tensors)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        skip = {"config.json", "model.safetensors.index.json"} | {f.name for f in ckpt.files}
        for item in ckpt.path.iterdir():
            if item.name in skip:
                continue
            copy = shutil.copytree if item.is_dir() else shutil.copy2
            copy(item, tmp / item.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
        after = _check(_Checkpoint.read(tmp), target, None, device, scan_values=True)
        errors = [f for f in after if f.severity == "error"]
        if errors:
            raise ValueError(
                "export cannot fix every problem mechanically; still: "
                + " ".join(f"[{f.code}] {f.message}" for f in errors)
            )
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    left = {(f.code, f.message) for f in after}
    fixed = [f for f in before if f.severity == "error" and (f.code, f.message) not in left]
    return fixed, after


def _fix_config(config, tensors, target, mask_token_id, num_speculative_tokens) -> None:
    config.pop("model_type", None)
    layer = config.setdefault("transformer_layer_config", {})
    if isinstance(layer, dict) and layer.get("model_type") is None:
        layer["model_type"] = _layer_type(tensors)
    if isinstance(layer, dict) and config.get("fc_norm"):
        layer["fc_norm"] = True
    n_aux = len(config.get("eagle_aux_hidden_state_layer_ids") or ()) or 3
    if isinstance(layer, dict) and layer.get("model_type") == "llama" and n_aux != 3:
        layer.setdefault("num_aux_hidden_states", n_aux)
    if config.get("draft_vocab_size") is None and "lm_head.weight" in tensors:
        config["draft_vocab_size"] = int(tensors["lm_head.weight"].shape[0])
    spec = config.setdefault("speculators_config", {})
    if trained_depths(config) is None and num_speculative_tokens is not None:
        methods = spec.setdefault("proposal_methods", [{}])
        if not methods:
            methods.append({})
        methods[0].setdefault("proposal_type", "greedy")
        methods[0]["speculative_tokens"] = int(num_speculative_tokens)
        spec.setdefault("default_proposal_method", "greedy")
    verifier = spec.setdefault("verifier", {})
    if "name_or_path" not in verifier:
        verifier["name_or_path"] = None if target is None else str(target)
    if mask_token_id is not None:
        saved = config.get("mask_token_id")
        if saved is not None and saved != mask_token_id:
            raise ValueError(
                f"the checkpoint already has mask_token_id {saved}; --mask-token-id only "
                "fills a missing one (the id is fixed by training)."
            )
        config["mask_token_id"] = int(mask_token_id)


def _fix_weights(config, tensors) -> None:
    for name in VERIFIER_ONLY:
        tensors.pop(name, None)
    if "d2t" not in tensors and tensors.get("t2d") is not None:
        t2d = tensors["t2d"].bool()
        if int(t2d.sum()) == config.get("draft_vocab_size"):
            ids = torch.nonzero(t2d).squeeze(1)
            tensors["d2t"] = ids - torch.arange(ids.shape[0])
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids and len(set(ids)) == len(ids) and list(ids) != sorted(ids):
        _sort_layer_ids(config, tensors, list(ids))


def _sort_layer_ids(config, tensors, ids: list[int]) -> None:
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
