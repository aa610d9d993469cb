"""The drafts ``selftest`` runs: real targets' shapes with random weights (no download).

A shape is the target's decoder geometry; the draft is the one ``speculators train
--speculator-type peagle`` builds for it by default: one decoder layer of the target's
width, every layer sliding, the default draft vocabulary. The correctness checks use a
narrow draft of the same kind (the shape's head dim and query heads per key/value head,
a few heads, a small vocabulary), small enough for float64 oracles on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.peagle_config import CODConfig
from ..model.build import DEFAULT_DRAFT_VOCAB_SIZE

# The narrow draft of the correctness checks: a window shorter than its rows, so the
# sliding branch of the mask is exercised, and key/value heads enough for a real GQA.
NARROW_WINDOW = 24
NARROW_KV_HEADS = 2
NARROW_WIDTH_PER_HEAD = 32


@dataclass(frozen=True)
class Shape:
    """A target's decoder geometry (``config.json`` fields) and its draft vocabulary."""

    name: str
    model_type: str  # llama | qwen3
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_hidden_layers: int
    rope_theta: float
    rms_norm_eps: float
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE

    @property
    def aux_layer_ids(self) -> list[int]:
        """vLLM's default aux layers: ``(2, N // 2, N - 3)``."""
        n = self.num_hidden_layers
        return [2, n // 2, n - 3]

    def narrow(self) -> Shape:
        """The correctness checks' draft: this head dim and grouping, a few heads, small vocab."""
        heads = self.num_attention_heads // self.num_key_value_heads * NARROW_KV_HEADS
        hidden = heads * NARROW_WIDTH_PER_HEAD  # transformers wants the heads to divide it
        return Shape(
            f"{self.name}-narrow", self.model_type, hidden_size=hidden,
            intermediate_size=2 * hidden, num_attention_heads=heads,
            num_key_value_heads=NARROW_KV_HEADS,
            head_dim=self.head_dim, vocab_size=512, num_hidden_layers=self.num_hidden_layers,
            rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps, draft_vocab_size=128,
        )


SHAPES = {
    s.name: s
    for s in (
        Shape("tiny", "llama", 128, 256, 4, 2, 32, 1024, 8, 10000.0, 1e-6, draft_vocab_size=256),
        Shape("smollm2", "llama", 576, 1536, 9, 3, 64, 49152, 30, 100000.0, 1e-5),
        Shape("llama8b", "llama", 4096, 14336, 32, 8, 128, 128256, 32, 500000.0, 1e-5),
        Shape("qwen3-8b", "qwen3", 4096, 12288, 32, 8, 128, 151936, 36, 1000000.0, 1e-6),
    )
}


def peagle_config(layer_config, *, num_depths, draft_vocab, layer_ids, mask_token, verifier_path,
                  architecture="LlamaForCausalLM", **options):
    """speculators' ``PEagleSpeculatorConfig`` of a draft with ``layer_config``'s decoder,
    greedy ``num_depths`` tokens, aux layers ``layer_ids`` and a verifier at
    ``verifier_path`` (None: none on disk)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle.config import PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    verifier = VerifierConfig(
        name_or_path=None if verifier_path is None else str(verifier_path),
        architectures=[architecture],
    )
    proposal = GreedyTokenProposalConfig(speculative_tokens=num_depths)
    return PEagleSpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=draft_vocab,
        eagle_aux_hidden_state_layer_ids=list(layer_ids),
        mask_token_id=mask_token,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[proposal],
            default_proposal_method="greedy",
            verifier=verifier,
        ),
        **options,
    )


def draft_config(shape: Shape, window: int | None, attn_impl: str | None = None):
    """The P-EAGLE config of a one-layer draft of ``shape`` (every layer sliding by
    ``window``; None: full attention); ``attn_impl``: speculators' attention for its side."""
    from transformers import LlamaConfig, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[shape.model_type]
    extra = {"use_sliding_window": window is not None} if shape.model_type == "qwen3" else {}
    layer = cls(
        **extra, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        num_hidden_layers=1, vocab_size=shape.vocab_size, max_position_embeddings=1 << 20,
        rms_norm_eps=shape.rms_norm_eps, rope_theta=shape.rope_theta, sliding_window=window,
        layer_types=["sliding_attention" if window else "full_attention"],
    )
    layer._attn_implementation = attn_impl
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[shape.model_type]
    return peagle_config(
        layer, num_depths=CODConfig.num_depths, draft_vocab=shape.draft_vocab_size,
        layer_ids=shape.aux_layer_ids, mask_token=shape.vocab_size - 1, verifier_path=None,
        architecture=arch,
    )


@dataclass
class Draft:
    """A random draft and its vocabulary map: ``selected [V_d]`` target ids, ``t2d [V]``."""

    model: torch.nn.Module
    selected: torch.Tensor
    t2d: torch.Tensor
    mask_token_id: int


def build_draft(shape: Shape, device: torch.device, seed: int, window: int | None) -> Draft:
    """Our P-EAGLE draft of ``shape`` with seeded random weights, on ``device``, float32.

    The heads get weights wider than their initialisation, a verifier head near but not
    equal to the draft's and a non-trivial verifier norm, so the target and draft
    distributions differ and the loss is far from zero: relative errors measured on it
    then mean something.
    """
    from ..model.peagle_draft import PEagleDraftModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = PEagleDraftModel(draft_config(shape, window))
    gen = torch.Generator().manual_seed(seed + 1)
    v, vd, d = shape.vocab_size, shape.draft_vocab_size, shape.hidden_size
    selected = torch.randperm(v - 1, generator=gen)[:vd].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[selected] = True
    model.load_vocab_mappings(t2d.to(device), (selected - torch.arange(vd)).to(device))
    with torch.no_grad():
        # speculators leaves the embedding as allocated; drawn on the device (it is the
        # largest tensor of a real shape's draft)
        embed = torch.Generator(device).manual_seed(seed + 2)
        model.embed_tokens.weight.normal_(generator=embed)
        head = torch.randn(vd, d, generator=gen) * 0.3
        model.lm_head.weight.copy_(head)
        model.verifier_lm_head.weight.copy_(head + 0.1 * torch.randn(vd, d, generator=gen))
        model.verifier_norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=gen))
    model.lm_head.weight.requires_grad_(True)
    return Draft(model, selected.to(device), t2d.to(device), v - 1)


def speculators_twin(draft: Draft, shape: Shape, window: int | None, attn_impl: str):
    """speculators' own ``PEagleDraftModel`` with ``draft``'s weights and trainable set."""
    from speculators.models.peagle.core import PEagleDraftModel as SpeculatorsPEagle

    device = draft.model.mask_hidden.device
    with torch.device(device):
        twin = SpeculatorsPEagle(draft_config(shape, window, attn_impl))
    twin.load_state_dict(draft.model.state_dict(), strict=True)
    trainable = {n for n, p in draft.model.named_parameters() if p.requires_grad}
    for name, p in twin.named_parameters():
        p.requires_grad_(name in trainable)
    return twin


def trainer_for(draft: Draft, partitions: int = 1, seed: int | None = None):
    """Our ``PEagleTrainerModule`` over ``draft`` with the default COD settings; ``seed``:
    its COD generator's, on the draft's device (None: the step seeds it)."""
    from ..training.peagle_trainer import PEagleTrainerModule

    cod = CODConfig()
    device = draft.model.mask_hidden.device
    gen = None if seed is None else torch.Generator(device).manual_seed(seed)
    return PEagleTrainerModule(
        draft.model, draft.selected, draft.t2d, cod.num_depths, draft.mask_token_id,
        cod.down_sample_ratio, cod.down_sample_ratio_min, partitions, generator=gen,
    )
