"""P-EAGLE draft model: mixins over speculators 0.9.0's EAGLE-3 draft classes.

The mixins reference only attributes the host classes define plus the kernels in
:mod:`speculators_peagle_plugin.kernels`; nothing here imports from a module that
imports this one.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``N`` COD elements of the flat
sequence, ``H`` target hidden size, ``D`` draft hidden size, ``A`` aux layers, ``V_d``
draft vocabulary, ``hd`` head dim.
"""

from __future__ import annotations

import torch
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.models.eagle3.model_definitions import (
    LlamaDecoderEagle3FirstLayer,
    Qwen3DecoderEagle3FirstLayer,
)
from speculators.models.peagle.config import PEagleSpeculatorConfig
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaRMSNorm,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
)

from ..core.peagle_attention import document_ids_from_lengths
from ..kernels.attention import PEagleMask, peagle_attention, resolve_attention_impl
from ..kernels.fused_ops import _RMSNormFunction, apply_rotary

# The seed contract's _Peagle*Mixin classes are re-exported by
# speculators_peagle_plugin.seed_api, not listed here.
__all__ = ["PEagleDraftModel"]


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``; transformers' llama / qwen3 RMSNorm on float32 runs fused (same math),
    eagerly. A compiled region traces transformers' own ops instead, which its compiler
    fuses and differentiates itself: no hand-written backward inside it
    (tests/test_draft_loss.py; docs/selftest.md says why).

    The fused function runs with autocast off: like transformers' norm, it stays float32.
    """
    if (type(norm) in (LlamaRMSNorm, Qwen3RMSNorm) and x.dtype == norm.weight.dtype == torch.float32
            and not torch.compiler.is_compiling()):
        with torch.autocast(x.device.type, enabled=False):
            return _RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon)
    return norm(x)


def _expand_last_row(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``[1, U, ...] -> [1, rows, ...]`` (``U <= rows``): the last row repeated to fill.

    The mask slots of a P-EAGLE sequence (every element at depth >= 1) all enter the
    first layer with the same input, ``mask_token_id``'s embedding and
    ``masked_projected_hidden``, so the draft passes that input once, as the last of
    ``U`` rows for ``rows`` positions. Until RoPE makes them differ, whatever is computed
    from it is computed once and repeated here; autograd sums the copies' gradients into
    the one row, which is the same gradient (expand's backward).
    """
    if x.shape[1] == rows:
        return x
    return torch.cat([x[:, :-1], x[:, -1:].expand(-1, rows - x.shape[1] + 1, *x.shape[2:])], 1)


def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``x[:, rows]`` (``[1, N, ...] -> [1, R, ...]``), or ``x`` for None."""
    return x if rows is None else x[:, rows]


class _PeagleAttentionMixin:
    """P-EAGLE single parallel-group attention for a llama / qwen3 attention module."""

    def forward_peagle(
        self,
        combined_states: torch.Tensor,
        position_ids: torch.Tensor,
        block_mask: PEagleMask,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over all COD depths in one pass.

        Args:
            combined_states: ``[1, N, in]`` layer input, or ``[1, U < N, in]`` whose last
                row is the one input of the sequence's last ``N - U + 1`` rows (projected
                once, see :func:`_expand_last_row`).
            position_ids: ``[1, N]`` reference positions ``anchor_pos + depth``; they
                enter through ``position_embeddings`` (RoPE cos/sin of these
                positions, computed once per forward by the draft).
            block_mask: the COD visibility (:class:`PEagleMask`).
            output_rows: ``[R]`` rows whose output is wanted (None: all); ``o_proj`` runs
                on those only.

        Returns:
            ``[1, N, D]`` (``[1, R, D]``). No per-depth rotary offset and no cache: the
            depth is in the positions, the cross-depth visibility entirely in ``block_mask``.
        """
        shape = (*combined_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(combined_states).view(shape)
        k = self.k_proj(combined_states).view(shape)
        v = self.v_proj(combined_states).view(shape)
        if hasattr(self, "q_norm"):  # qwen3 normalises per head before RoPE
            q, k = _rms_norm(self.q_norm, q), _rms_norm(self.k_norm, k)
        rows = position_ids.shape[1]
        q, k, v = (_expand_last_row(t, rows).transpose(1, 2) for t in (q, k, v))
        cos, sin = position_embeddings
        q, k = apply_rotary(q, k, cos, sin)
        out = peagle_attention(q, k, v, block_mask, self.scaling)  # [1, nh, N, hd]
        out = out.transpose(1, 2).flatten(2)
        return self.o_proj(out if output_rows is None else out[:, output_rows])


class _PeagleDecoderLayerMixin:
    """P-EAGLE forward for the fused first layer (``[embeds, hidden]`` input)."""

    def forward_peagle(
        self,
        input_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        block_mask: PEagleMask,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Same norms, residuals and MLP as speculators' first layer, COD attention.

        Args:
            input_embeds: ``[1, N, D]`` token embeddings (mask token at depth >= 1).
            hidden_states: ``[1, N, D]`` fc-projected aux states (``mask_hidden`` at depth >= 1).
            Both may be ``[1, U < N, D]``, the last row standing for the sequence's last
            ``N - U + 1`` rows (their norms and q/k/v projections then run once); the
            output is ``[1, N, D]`` either way.
            output_rows: ``[R]`` rows whose output is wanted (None: all): every row is a
            key/value of the attention, and only these go on through ``o_proj``, the
            residual and the MLP (row by row), giving ``[1, R, D]``.
        """
        residual = hidden_states
        hidden = _rms_norm(self.hidden_norm, hidden_states)
        if self.norm_before_residual:
            residual = hidden
        combined = torch.cat([_rms_norm(self.input_layernorm, input_embeds), hidden], dim=-1)
        residual = _expand_last_row(residual, position_ids.shape[1])
        out = _rows(residual, output_rows) + self.self_attn.forward_peagle(
            combined, position_ids, block_mask, position_embeddings=position_embeddings,
            output_rows=output_rows,
        )
        return out + self.mlp(_rms_norm(self.post_attention_layernorm, out))


class _PeagleVanillaLayerMixin:
    """P-EAGLE forward for a plain pre-norm decoder layer after the first."""

    def forward_peagle(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        block_mask: PEagleMask,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Standard pre-norm block over ``[1, N, D]`` with the COD mask (``output_rows``:
        as the first layer's)."""
        out = _rows(hidden_states, output_rows) + self.self_attn.forward_peagle(
            _rms_norm(self.input_layernorm, hidden_states),
            position_ids,
            block_mask,
            position_embeddings=position_embeddings,
            output_rows=output_rows,
        )
        return out + self.mlp(_rms_norm(self.post_attention_layernorm, out))


class _PeagleDraftMixin:
    """P-EAGLE draft-model methods for speculators' ``Eagle3DraftModel``."""

    attention_impl: str = "auto"

    def _init_peagle_parameters(self, config) -> None:
        """Register the learnable ``mask_hidden``, shape ``[1, 1, A * H]``.

        It stands in for the target's aux states at every depth >= 1 slot and sits
        before ``fc`` (``fc.in_features`` wide), so it goes through the same norms
        and projection as a real aux vector. Key and shape match speculators and
        vLLM's parallel-drafting loader.
        """
        self.mask_hidden = torch.nn.Parameter(torch.randn(1, 1, self.fc.in_features))

    def project_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., A * H] -> [..., D]``: optional input norm / per-aux norms, then ``fc``."""
        if self.input_norm is not None:
            aux_hidden_states = self.input_norm(aux_hidden_states)
        if self.fc_norm is not None:
            chunks = aux_hidden_states.chunk(len(self.fc_norm), dim=-1)
            aux_hidden_states = torch.cat(
                [norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1
            )
        return self.fc(aux_hidden_states)

    def masked_projected_hidden(self) -> torch.Tensor:
        """``mask_hidden`` through :meth:`project_hidden_states`: ``[1, D]``."""
        return self.project_hidden_states(self.mask_hidden)[0]

    def build_peagle_block_mask(
        self,
        anchor_pos: torch.Tensor,
        depth: torch.Tensor,
        lengths: torch.Tensor,
        total_seq_len: int,
    ) -> list[PEagleMask]:
        """The COD mask of one sequence, one entry per draft layer.

        Layers share one :class:`PEagleMask` per attention type (speculators'
        ``layer_types``: full, or sliding with ``config.sliding_window``).
        """
        impl = resolve_attention_impl(self.attention_impl, anchor_pos.device)
        doc = document_ids_from_lengths(lengths.to(anchor_pos.device), total_seq_len)
        by_window: dict[int | None, PEagleMask] = {}
        masks = []
        for i in range(len(self.layers)):
            window = self.sliding_window if i in self.sliding_window_indices else None
            if window not in by_window:
                by_window[window] = PEagleMask(anchor_pos, depth, doc, window, impl)
            masks.append(by_window[window])
        return masks

    def _run_draft_layer(self, layer_fn, args=(), kwargs=None):
        """Run one layer, under non-reentrant activation checkpointing when enabled in training."""
        kwargs = kwargs or {}
        if self.training and getattr(self, "is_gradient_checkpointing", False):
            return checkpoint(layer_fn, *args, use_reentrant=False, **kwargs)
        return layer_fn(*args, **kwargs)

    def forward_peagle(
        self,
        sampled_input_ids: torch.Tensor,
        sampled_projected_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        block_mask: list[PEagleMask],
        mask_slots: int = 0,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Single parallel-group forward over the flattened COD sequence.

        Args:
            sampled_input_ids: ``[1, N]`` real ids at depth 0, ``mask_token_id`` deeper.
            sampled_projected_hidden: ``[1, N, D]`` projected aux states at depth 0,
                :meth:`masked_projected_hidden` deeper.
            position_ids: ``[1, N]`` reference positions ``anchor_pos + depth``.
            block_mask: per-layer masks from :meth:`build_peagle_block_mask`.
            mask_slots: how many of the last rows are mask slots (depth >= 1, in
                depth-major order all of them). Their inputs are identical, so the first
                layer embeds, normalises and projects them once: the same result and
                gradients, without ``m - 1`` rows of q/k/v projection. Row ``N - m``
                is used for all ``m``; 0 (the default) treats every row as its own.
            output_rows: ``[R]`` the rows whose states are wanted (None: all). Every row
                is key/value context, but after the last layer's attention nothing
                mixes rows, so its ``o_proj``, residual and MLP run on these rows only:
                the rows the loss charges (a row outside them is context and nothing
                more). The same values and gradients as ``forward_peagle(...)[:, rows]``.

        Returns:
            ``[1, N, D]`` (``[1, R, D]``) pre-logits states (after ``norm`` when
            ``config.norm_output``).
        """
        n = sampled_input_ids.shape[1]
        if (
            isinstance(mask_slots, bool)
            or not isinstance(mask_slots, int)
            or not (0 <= mask_slots <= n)
        ):
            raise ValueError(f"mask_slots must be an integer in [0, {n}], got {mask_slots!r}.")
        distinct = n - max(mask_slots - 1, 0)  # rows of distinct first-layer input
        embeds = self.embed_tokens(sampled_input_ids[:, :distinct])
        embeds = embeds.to(sampled_projected_hidden.dtype)
        rope = self.rotary_emb(embeds, position_ids)
        hidden = sampled_projected_hidden[:, :distinct]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            args = (embeds, hidden) if i == 0 else (hidden,)
            hidden = self._run_draft_layer(
                layer.forward_peagle,
                (*args, position_ids, block_mask[i]),
                {"position_embeddings": rope, "output_rows": output_rows if i == last else None},
            )
        return _rms_norm(self.norm, hidden) if self.config.norm_output else hidden

    def lm_head_inputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """What enters ``lm_head`` for :meth:`forward_peagle` rows (``norm`` unless applied)."""
        return hidden if self.config.norm_output else _rms_norm(self.norm, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of :meth:`forward_peagle` rows: ``[..., D] -> [..., V_d]``."""
        return self.lm_head(self.lm_head_inputs(hidden))


class PEagleLlamaAttention(_PeagleAttentionMixin, LlamaAttention):
    pass


class PEagleQwen3Attention(_PeagleAttentionMixin, Qwen3Attention):
    pass


class PEagleLlamaFirstLayer(_PeagleDecoderLayerMixin, LlamaDecoderEagle3FirstLayer):
    pass


class PEagleQwen3FirstLayer(_PeagleDecoderLayerMixin, Qwen3DecoderEagle3FirstLayer):
    pass


class PEagleLlamaLayer(_PeagleVanillaLayerMixin, LlamaDecoderLayer):
    pass


class PEagleQwen3Layer(_PeagleVanillaLayerMixin, Qwen3DecoderLayer):
    pass


# speculators builds its layers from a module-level table; these subclasses add
# methods only (no state), so re-typing the built modules keeps their weights,
# initialisation and state-dict keys exactly as speculators makes them.
_PEAGLE_CLASS_FOR = {
    LlamaAttention: PEagleLlamaAttention,
    Qwen3Attention: PEagleQwen3Attention,
    LlamaDecoderEagle3FirstLayer: PEagleLlamaFirstLayer,
    Qwen3DecoderEagle3FirstLayer: PEagleQwen3FirstLayer,
    LlamaDecoderLayer: PEagleLlamaLayer,
    Qwen3DecoderLayer: PEagleQwen3Layer,
}


class PEagleDraftModel(_PeagleDraftMixin, Eagle3DraftModel):
    """speculators' EAGLE-3 draft with the P-EAGLE forward and a required ``mask_hidden``.

    Its config is speculators' ``PEagleSpeculatorConfig``: a saved draft is a
    ``speculators_model_type: "peagle"`` checkpoint with speculators' key names.
    ``attention_impl`` (``auto`` | ``flex`` | ``chunked``) picks the attention path.
    """

    config_class = PEagleSpeculatorConfig
    supports_gradient_checkpointing = True  # per layer, in _run_draft_layer

    def __init__(self, config: PEagleSpeculatorConfig):
        super().__init__(config=config)
        for layer in self.layers:
            for module in (layer, layer.self_attn):
                module.__class__ = _PEAGLE_CLASS_FOR[type(module)]
        self._init_peagle_parameters(config)
        self.mask_token_id = config.mask_token_id
