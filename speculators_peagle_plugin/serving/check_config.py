"""The checker's config rules: ``config.json`` and its aux layer ids against what vLLM's
P-EAGLE loading path accepts (``vllm/transformers_utils/configs/speculators/{base,algos}.py``,
``vllm/model_executor/models/{llama,qwen3}_eagle3.py``).

Each rule is a function of the :class:`CheckedDraft` that yields a finding for each
problem it sees, so that it reads as the problem's condition and its message;
:data:`CONFIG_RULES` lists them in report order, and :data:`CONFIG_GATES` names the rules
whose finding ends the check (:func:`.check.run_rules` runs them, then the weight and
target rules).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .draft_checkpoint import (
    CPU_HEAD_DIMS,
    DEFAULT_AUX_LAYERS,
    DraftCheckpoint,
    Finding,
    aux_layer_count,
    declared_k,
    error,
    head_dim,
    is_int,
    target_config,
    trained_depths,
    usable_mask_token_id,
    warning,
)

LAYER_TYPES = ("llama", "qwen3")  # vLLM's peagle architecture map


@dataclass(frozen=True)
class CheckedDraft:
    """What the rules read: the checkpoint, its target, and how it will be served."""

    ckpt: DraftCheckpoint
    target: Path | None
    k: int | None  # num_speculative_tokens it will be served with
    device: str
    scan_values: bool

    @property
    def config(self) -> dict:
        return self.ckpt.config

    @property
    def layer(self) -> dict:
        """transformer_layer_config (an object once the layer-config gate has passed)."""
        return self.config["transformer_layer_config"]


Rule = Callable[[CheckedDraft], Iterable[Finding]]


# ------------------------------------------------------------------ the config


def _speculators_type(d: CheckedDraft) -> Iterator[Finding]:
    kind = d.config.get("speculators_model_type")
    if kind is None:
        yield error(
            "not-speculators",
            "config.json has no speculators_model_type, so this is not a "
            "speculators-format checkpoint.",
            "Save the draft with speculators-peagle train or speculators.",
        )
    elif kind != "peagle":
        yield error(
            "not-peagle",
            f"speculators_model_type is {kind!r}, not 'peagle': vLLM would not draft "
            "the K tokens in parallel from a mask token.",
            "Train a P-EAGLE draft (speculators-peagle train --algorithm peagle).",
        )


def _top_level_model_type(d: CheckedDraft) -> Iterator[Finding]:
    if "model_type" in d.config:
        yield error(
            "model-type",
            f"config.json has a top-level model_type ({d.config['model_type']!r}), so vLLM "
            "loads it as a plain model instead of a speculators draft.",
            "Remove the top-level model_type key.",
            mechanical=True,
        )


def _layer_config(d: CheckedDraft) -> Iterator[Finding]:
    if not isinstance(d.config.get("transformer_layer_config"), dict):
        yield error(
            "layer-config",
            "transformer_layer_config is missing or not an object; vLLM cannot build "
            "the draft layers.",
            "Save the checkpoint with speculators' PEagleSpeculatorConfig.",
        )


def _layer_type_recorded(d: CheckedDraft) -> Iterator[Finding]:
    if d.layer.get("model_type") is None:
        yield error(
            "layer-type",
            "transformer_layer_config has no model_type: vLLM builds llama layers, "
            "speculators qwen3 layers.",
            "Set transformer_layer_config.model_type to the trained layer type "
            "(export infers it from the weights).",
            mechanical=True,
        )


def _layer_type_supported(d: CheckedDraft) -> Iterator[Finding]:
    layer_type = d.layer.get("model_type")
    if layer_type is not None and layer_type not in LAYER_TYPES:
        yield error(
            "layer-type",
            f"transformer_layer_config.model_type is {layer_type!r}; vLLM's "
            f"P-EAGLE supports only {', '.join(LAYER_TYPES)}.",
            "Train the draft with llama or qwen3 layers (--draft-arch).",
        )


def _speculative_tokens(d: CheckedDraft) -> Iterator[Finding]:
    if declared_k(d.config) is None:
        yield error(
            "speculative-tokens",
            "speculators_config.proposal_methods[0].speculative_tokens is missing or "
            "not a positive integer; vLLM refuses the config.",
            "Set it to the trained K (export --num-speculative-tokens K).",
            mechanical=True,
        )


def _verifier(d: CheckedDraft) -> Iterator[Finding]:
    spec = d.config.get("speculators_config")
    if not (isinstance(spec, dict) and "name_or_path" in (spec.get("verifier") or {})):
        yield error(
            "verifier",
            "speculators_config.verifier.name_or_path is missing; vLLM refuses the config.",
            "Add it (the target's path or name; export writes --target or null).",
            mechanical=True,
        )


def _served_depth(d: CheckedDraft) -> Iterator[Finding]:
    """Depths past the trained K were never trained: their drafts are noise."""
    trained_k = trained_depths(d.config)
    if d.k is None or trained_k is None or d.k <= trained_k:
        return
    first, last = trained_k + 1, d.k
    positions = f"position {first}" if first == last else f"positions {first}..{last}"
    yield warning(
        "depth",
        f"K = {d.k} is past the {trained_k} depths the draft was trained for; "
        f"acceptance at {positions} is meaningless.",
        f"Serve with num_speculative_tokens <= {trained_k}.",
    )


def _draft_vocab(d: CheckedDraft) -> Iterator[Finding]:
    if d.config.get("draft_vocab_size") is None:
        yield error(
            "draft-vocab",
            "draft_vocab_size is missing: vLLM assumes the full vocabulary and speculators 32000.",
            "Set draft_vocab_size to lm_head's row count.",
            mechanical=True,
        )


def _fc_norm(d: CheckedDraft) -> Iterator[Finding]:
    if d.config.get("fc_norm") and not d.layer.get("fc_norm"):
        yield error(
            "fc-norm",
            "fc_norm is true, but vLLM 0.32 reads it for P-EAGLE only from "
            "transformer_layer_config, so it would reject the fc_norm weights.",
            "Copy fc_norm: true into transformer_layer_config.",
            mechanical=True,
        )


def _mask_token_id(d: CheckedDraft) -> Iterator[Finding]:
    mask_id, vocab = d.config.get("mask_token_id"), d.layer.get("vocab_size")
    if usable_mask_token_id(d.config) is not None:
        return
    if not is_int(mask_id):
        yield error(
            "mask-token-id",
            f"mask_token_id is {mask_id!r}; vLLM needs the integer id the draft was "
            "trained with to fill the K-1 parallel slots.",
            "Set mask_token_id to the trained id (export --mask-token-id ID).",
            mechanical=True,
        )
    else:
        yield error(
            "mask-token-id",
            f"mask_token_id {mask_id} is outside the embedding [0, {vocab}).",
            "Retrain with a mask token inside the vocabulary that the tokenizer never produces.",
        )


def _draft_head_dim(d: CheckedDraft) -> Iterator[Finding]:
    dim = head_dim(d.layer)
    if d.device == "cpu" and dim is not None and dim not in CPU_HEAD_DIMS:
        yield error(
            "head-dim",
            f"the draft's head_dim {dim} is not supported by vLLM's CPU attention "
            f"({', '.join(map(str, CPU_HEAD_DIMS))}).",
            "Serve on CUDA, or train the draft with a supported head_dim.",
        )


# -------------------------------------------------------------- the aux layers


def _layer_ids(d: CheckedDraft) -> Iterator[Finding]:
    """The aux layer ids: recorded, distinct, ascending, and layers the target has."""
    ids = d.config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        yield warning(
            "layer-ids",
            "eagle_aux_hidden_state_layer_ids is not recorded; vLLM feeds the "
            "target's default layers (2, N//2, N-3).",
            "Record the layer ids the draft was trained on.",
        )
        return
    if len(set(ids)) != len(ids):
        yield error(
            "layer-ids",
            f"eagle_aux_hidden_state_layer_ids {ids} repeats a layer; vLLM captures "
            "each layer once, so the draft gets fewer aux states than it expects.",
            "Retrain with distinct layer ids.",
        )
    elif list(ids) != sorted(ids):
        yield error(
            "layer-order",
            f"eagle_aux_hidden_state_layer_ids {ids} is not ascending; vLLM "
            "concatenates aux states in layer order, so fc would read them permuted.",
            "Sort the ids and permute fc / mask_hidden column blocks to match.",
            mechanical=True,
        )
    if d.target is None:
        return
    n = target_config(d.target).num_hidden_layers
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        yield error(
            "layer-ids",
            f"aux layer ids {bad} are outside [0, {n}] for a target with {n} "
            "layers; vLLM never captures them.",
            "Use the target the draft was trained for.",
        )


def _aux_count(d: CheckedDraft) -> Iterator[Finding]:
    """vLLM's llama draft sizes fc for the default aux count unless told otherwise."""
    n_aux = aux_layer_count(d.config)
    if (
        d.layer.get("model_type") == "llama"
        and n_aux != DEFAULT_AUX_LAYERS
        and "num_aux_hidden_states" not in d.layer
    ):
        yield error(
            "aux-count",
            f"the draft reads {n_aux} aux layers, but vLLM 0.32's llama P-EAGLE draft "
            "sizes fc for 3 unless transformer_layer_config says otherwise.",
            f"Set transformer_layer_config.num_aux_hidden_states = {n_aux}.",
            mechanical=True,
        )


# ------------------------------------------------------------------ shipped code


def remote_code_files(config: dict) -> list[str]:
    """The code files config.json's ``auto_map`` points transformers' Auto classes to.

    An entry ``"AutoConfig": "configuration_x.XConfig"`` names ``configuration_x.py`` (of
    this directory; ``"repo--module.Class"``: of that repository). The entry speculators'
    ``save_pretrained`` writes, ``"": "config.PEagleSpeculatorConfig"``, has no Auto class
    as its key, so nothing loads the ``config.py`` it names.
    """
    auto_map = config.get("auto_map")
    files: list[str] = []
    for auto_class, refs in (auto_map.items() if isinstance(auto_map, dict) else ()):
        for ref in refs if isinstance(refs, list) else [refs]:
            if not (auto_class and isinstance(ref, str) and "." in ref):
                continue  # a tokenizer's missing slow or fast class is null
            repo, _, ref = ref.rpartition("--")
            name = ref.rsplit(".", 1)[0] + ".py" + (f" of {repo}" if repo else "")
            if name not in files:
                files.append(name)
    return files


def _remote_code(d: CheckedDraft) -> Iterator[Finding]:
    files = remote_code_files(d.config)
    if files:
        yield warning(
            "remote-code",
            f"config.json's auto_map names {', '.join(files)}: the draft ships code that "
            "neither this package nor vLLM runs without --trust-remote-code.",
            "Read that code before passing --trust-remote-code anywhere; a P-EAGLE draft "
            "needs no code of its own, so auto_map can be removed.",
        )


CONFIG_RULES: tuple[Rule, ...] = (
    _speculators_type,
    _top_level_model_type,
    _layer_config,
    _layer_type_recorded,
    _layer_type_supported,
    _speculative_tokens,
    _verifier,
    _served_depth,
    _draft_vocab,
    _fc_norm,
    _mask_token_id,
    _draft_head_dim,
    _layer_ids,
    _aux_count,
    _remote_code,
)
# Gates: without a P-EAGLE speculators config or a layer config of a supported type,
# nothing after them can be judged.
CONFIG_GATES = frozenset({_speculators_type, _layer_config, _layer_type_supported})
