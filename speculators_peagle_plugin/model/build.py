"""Building the P-EAGLE draft: speculators' builders, our class, an optional verifier start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.errors import UserError
from ..common.settings import check_choices, check_int_at_least, check_optional_ints, setting
from .peagle_draft import PEagleDraftModel

# speculators owns "peagle" in its model registry; ours is registered beside it.
SPECULATORS_REGISTRY_NAME = "peagle_plugin"
# speculators' defaults for a draft: its draft vocabulary and its layers' sliding window.
DEFAULT_DRAFT_VOCAB_SIZE = 8192
DEFAULT_SLIDING_WINDOW = 2048


@dataclass(frozen=True)
class DraftConfig:
    """The ``draft`` section: the draft's shape, vocabulary, mask token and first weights."""

    num_layers: int = setting(1, "Number of draft decoder layers.", card=True)
    draft_arch: str = setting("llama", "Draft decoder layer type.", choices=("llama", "qwen3"))
    draft_vocab_size: int = setting(
        DEFAULT_DRAFT_VOCAB_SIZE, "Draft vocabulary size (d2t/t2d from token_freq.pt)."
    )
    mask_token_id: int | None = setting(
        None, "Token id for the K-1 mask slots; default: one the tokenizer never produces."
    )
    target_layer_ids: tuple[int, ...] | None = setting(
        None, "Aux hidden-state layer ids of the target; default: those the data was made with."
    )
    sliding_window: int | None = setting(
        DEFAULT_SLIDING_WINDOW,
        "Sliding window of the draft layers (speculators' default); none = full attention.",
    )
    full_attention_indices: tuple[int, ...] = setting((), "Draft layers that use full attention.")
    num_key_value_heads: int | None = setting(
        None,
        "Key/value heads of the draft's attention (a divisor of its query heads); default: the "
        "verifier's. The K-1 mask slots see the context only through these values, so a 1-layer "
        "draft of a GQA target learns its later depths far better with more.",
    )
    draft_init: str = setting(
        "random",
        "Initial draft: random (speculators'), or verifier: fc passes the deepest aux state "
        "through and the draft layers start as the verifier layers that follow it.",
        choices=("random", "verifier"),
        card=True,
    )
    norm_before_residual: bool = setting(False, "Normalise before the residual (vLLM's default).")
    embed_requires_grad: bool = setting(False, "Train the token embedding too.")
    from_pretrained: str | None = setting(
        None,
        "Start from this trained P-EAGLE draft directory (a checkpoint or best/ of ours, or "
        "speculators' save_pretrained output): its weights, with a fresh optimizer and "
        "schedule from step 0; its layers, draft vocabulary, aux layer ids and target hidden "
        "size must match this run's. Local directories only. Resuming a run is --resume.",
        path=True,
    )
    num_speculative_tokens: int | None = setting(
        None,
        "K the checkpoint declares for serving (vLLM's num_speculative_tokens), at most "
        "num_depths; default: num_depths. Training more depths than are served teaches the "
        "served ones from longer chains.",
    )

    def __post_init__(self) -> None:
        check_choices(self)
        check_int_at_least("num_layers", self.num_layers, 1)
        check_int_at_least("draft_vocab_size", self.draft_vocab_size, 1)
        check_optional_ints(
            self, {"sliding_window": 1, "num_key_value_heads": 1, "num_speculative_tokens": 1}
        )


def register_with_speculators() -> str:
    """Register :class:`PEagleDraftModel` in speculators' model registry; safe to repeat.

    Returns the registry name. speculators raises on a second registration of a name, so
    an existing entry for our class (or a reloaded copy of it) is left or replaced.
    """
    from speculators.model import SpeculatorModel

    registry = SpeculatorModel.registry or {}
    current = registry.get(SPECULATORS_REGISTRY_NAME)
    if current is PEagleDraftModel:
        return SPECULATORS_REGISTRY_NAME
    if current is not None and current.__qualname__ != PEagleDraftModel.__qualname__:
        raise UserError(
            f"speculators' registry already holds {current!r} under "
            f"{SPECULATORS_REGISTRY_NAME!r}; another plugin claims this name."
        )
    registry.pop(SPECULATORS_REGISTRY_NAME, None)
    SpeculatorModel.register(SPECULATORS_REGISTRY_NAME)(PEagleDraftModel)
    return SPECULATORS_REGISTRY_NAME


def build_peagle_draft(config, *, d2t, t2d, target_layer_ids, mask_token_id):
    """The draft ``speculators train --speculator-type peagle`` builds, as our class.

    speculators' own builders shape the decoder from the verifier and copy its embedding
    and lm_head rows; only the class (ours, with the P-EAGLE mixins) differs. ``config``:
    a TrainConfig (its ``draft``, ``peagle`` and ``verifier`` sections).
    """
    from speculators.models.peagle.core import PEagleDraftModel as SpeculatorsPEagle
    from speculators.train.cli import create_transformer_layer_config

    register_with_speculators()
    draft_config, verifier = config.draft, config.verifier.verifier_name_or_path
    depths = config.peagle.cod.num_depths
    num_layers = draft_config.num_layers
    window = draft_config.sliding_window
    full = range(num_layers) if window is None else draft_config.full_attention_indices
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=verifier,
        num_layers=num_layers,
        draft_arch=draft_config.draft_arch,
        hidden_act=None,
        # speculators' builder needs a window even when every layer is full attention
        sliding_window=window or DEFAULT_SLIDING_WINDOW,
        full_attention_indices=list(full),
    )
    kv_heads = draft_config.num_key_value_heads
    if kv_heads is not None:
        heads = layer_config.num_attention_heads
        if heads % kv_heads:
            raise UserError(
                f"num_key_value_heads must divide the draft's {heads} attention heads, got "
                f"{kv_heads}."
            )
        layer_config.num_key_value_heads = kv_heads
    draft = SpeculatorsPEagle.from_training_args.__func__(
        PEagleDraftModel,
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=verifier,
        target_layer_ids=list(target_layer_ids),
        draft_vocab_size=draft_config.draft_vocab_size,
        norm_before_residual=draft_config.norm_before_residual,
        embed_requires_grad=draft_config.embed_requires_grad,
        mask_token_id=mask_token_id,
        num_depths=depths,
        draft_attn_impl="sdpa",
    )
    draft.embed_tokens.weight.requires_grad_(draft_config.embed_requires_grad)
    # vLLM's llama P-EAGLE draft sizes fc for 3 aux layers unless its layer config says
    # how many (speculators' builder does not record it)
    draft.config.transformer_layer_config.num_aux_hidden_states = len(target_layer_ids)
    served = draft_config.num_speculative_tokens
    if served is not None and served != depths:
        # vLLM reads only the served K; the depths trained stay beside it for `check`.
        draft.config.speculators_config.proposal_methods[0].speculative_tokens = served
        draft.config.num_depths = depths
    if draft_config.draft_init == "verifier":
        init_from_verifier(draft, verifier, target_layer_ids)
    return draft


def load_reference_draft(
    draft_dir: str | Path, target_dir: str | Path, dtype: torch.dtype = torch.float32
) -> PEagleDraftModel:
    """Load a speculators-format P-EAGLE checkpoint (ours or speculators') for inference.

    The verifier path is pointed at ``target_dir`` so that speculators resolves layer
    ids and fills weights the checkpoint leaves out (embeddings) from the local target,
    as vLLM shares them; no hub access.
    """
    from speculators.models.peagle.config import PEagleSpeculatorConfig

    config = PEagleSpeculatorConfig.from_pretrained(str(draft_dir))
    config.speculators_config.verifier.name_or_path = str(target_dir)
    draft = PEagleDraftModel.from_pretrained(str(draft_dir), config=config)
    return draft.to(dtype).eval()


# Tensors of a decoder layer copied as they are (required, then optional); q/k/v and the
# input norm get their own treatment below.
_COPIED = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
           "self_attn.o_proj.weight", "post_attention_layernorm.weight")
_REQUIRED = (*_COPIED, "input_layernorm.weight",
             *(f"self_attn.{p}_proj.weight" for p in "qkv"))
_OPTIONAL = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.o_proj.bias",
             "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")
_QKV = tuple(f"self_attn.{p}_proj.{t}" for p in "qkv" for t in ("weight", "bias"))


def init_from_verifier(draft, verifier_path, target_layer_ids) -> None:
    """Start the draft as the verifier's layers that follow its deepest aux state.

    Aux id ``L`` is the residual stream after ``L`` verifier layers, i.e. the input of
    verifier layer ``L``. ``fc`` passes that state through (``fc(x)`` = the deepest aux
    slice of ``x``) and draft layer ``i`` becomes verifier layer ``L + i``: its MLP, output
    projection and norms, and its q/k/v on the hidden half of the first layer's
    ``[embeds, hidden]`` input (the embedding half keeps its random start). Key/value
    heads are repeated when the draft has more (each draft head serves the query heads its
    verifier head served). Training then starts from the verifier's own computation on that
    state instead of from noise; on the demo this raised held-out teacher-forced accuracy
    at depths 0 and 1 (eval/RESULTS.md records the comparison).

    Example: SmolLM2 (30 layers), aux ids (2, 15, 27), 1 draft layer -> ``fc`` selects
    the aux-27 slice, draft layer 0 = verifier layer 27; with aux ids (2, 15, 27, 30) the
    same, and the aux-30 columns of ``fc`` start at zero.

    Raises ``ValueError`` (one sentence) when the verifier lacks those layers or its
    shapes cannot be copied.
    """
    from speculators.utils.loading import list_checkpoint_keys, load_model_layers

    keys = list_checkpoint_keys(verifier_path)
    # Aux id N (the state after the last layer) has no verifier layer after it: its fc
    # columns start at zero and the pass-through goes to the deepest id below it.
    with_layer = [i for i in target_layer_ids if any(f"layers.{i}." in k for k in keys)]
    deepest = max(with_layer or target_layer_ids)
    position = list(target_layer_ids).index(deepest)
    layers = list(draft.layers)
    names = [f"layers.{deepest + i}." for i in range(len(layers))]
    present = [n + s for n in names for s in (*_COPIED, *_OPTIONAL, *_QKV, "input_layernorm.weight")
               if any(k == n + s or k.endswith("." + n + s) for k in keys)]
    found = load_model_layers(present, str(verifier_path)) if present else {}
    missing = [n + s for n in names for s in _REQUIRED if n + s not in found]
    if missing:
        raise UserError(
            f"--draft-init verifier copies verifier layers {deepest}..{deepest + len(layers) - 1} "
            f"(after aux id {deepest}) but {verifier_path} has no {missing[0]}; "
            "use fewer draft layers, a shallower deepest aux id, or --draft-init random."
        )
    fc = draft.fc
    hidden = fc.out_features
    with torch.no_grad():
        fc.weight.zero_()
        fc.weight[:, position * hidden : (position + 1) * hidden].copy_(torch.eye(hidden))
        if fc.bias is not None:
            fc.bias.zero_()
        for i, (layer, name) in enumerate(zip(layers, names, strict=True)):
            params = dict(layer.named_parameters())
            for suffix in _COPIED:
                _copy(params[suffix], found[name + suffix], name + suffix)
            for suffix in _OPTIONAL:
                if suffix in params and name + suffix in found:
                    _copy(params[suffix], found[name + suffix], name + suffix)
            # the first layer normalises the hidden half with hidden_norm (input_layernorm: embeds)
            norm = "hidden_norm.weight" if i == 0 else "input_layernorm.weight"
            _copy(params[norm], found[name + "input_layernorm.weight"], name + "input_layernorm")
            attn = layer.self_attn
            head_dim = attn.head_dim
            for proj in ("q_proj", "k_proj", "v_proj"):
                source = found[f"{name}self_attn.{proj}.weight"]
                target = getattr(attn, proj)
                heads = target.out_features // head_dim
                verifier_heads = source.shape[0] // head_dim
                if source.shape[0] % head_dim or heads % verifier_heads:
                    raise UserError(
                        f"--draft-init verifier needs the draft's {proj} heads ({heads}) to be a "
                        f"multiple of the verifier's ({source.shape[0] / head_dim:g}); use "
                        "--num-key-value-heads with such a value or --draft-init random."
                    )
                repeat = heads // verifier_heads  # draft head j serves verifier head j // repeat
                weight = source.view(verifier_heads, head_dim, -1).repeat_interleave(repeat, 0)
                columns = target.weight[:, target.in_features - source.shape[1] :]
                _copy(columns, weight.reshape(target.out_features, -1), f"{name}{proj}")
                bias = found.get(f"{name}self_attn.{proj}.bias")
                if target.bias is not None and bias is not None:
                    target.bias.copy_(bias.view(verifier_heads, head_dim).repeat_interleave(
                        repeat, 0).reshape(-1))


def _copy(destination: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if destination.shape != source.shape:
        raise UserError(
            f"--draft-init verifier cannot copy the verifier's {name} {tuple(source.shape)} into "
            f"the draft's {tuple(destination.shape)}; use --draft-init random."
        )
    destination.copy_(source)
