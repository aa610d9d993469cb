"""P-EAGLE training module: COD sample -> flat draft forward -> KL over the draft vocab.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``B`` batch rows, ``L`` tokens per
row, ``N`` COD elements of a row (or of one segment), ``K`` depths, ``A`` aux layers,
``H`` target hidden size, ``V`` / ``V_d`` target / draft vocabulary.

The batch checks are in :mod:`.batch`, the partition plan (and why partitioning is
exact) in :mod:`.plan`, the reported figures in :mod:`.metrics`.
"""

from __future__ import annotations

import torch

from ..common.errors import UserError
from ..core.peagle_attention import lengths_from_document_ids
from ..core.peagle_config import CODConfig, PEagleConfig
from ..core.peagle_data import generate_cod_sample_indices
from ..kernels.fused_kl import LossConfig
from . import draft_loss
from .batch import batch_document_ids, check_batch_shapes, row, supervised_elements
from .metrics import PEagleStepMetrics
from .plan import PlanUnit, _PeaglePlan, context_reach, row_units

# The seed contract's private names (_PeaglePlan, _kl_div_loss) are re-exported by
# speculators_peagle_plugin.seed_api, not listed here.
__all__ = ["PEagleStepMetrics", "PEagleTrainerModule", "PlanUnit"]


def _kl_div_loss(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(target || draft) over the draft vocabulary: ``[*, V_d] -> [*]``.

    ``sum p_t (log p_t - log p_d)`` with ``p_t = softmax(target)``,
    ``log p_d = log_softmax(draft)``; float32 at least, as speculators' ``kl_div_loss``.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    log_p_draft = torch.log_softmax(logits.to(dtype), dim=-1)
    log_p_target = torch.log_softmax(target_logits.to(dtype), dim=-1)
    return (log_p_target.exp() * (log_p_target - log_p_draft)).sum(-1)


class PEagleTrainerModule(torch.nn.Module):
    """Draft-side P-EAGLE trainer: all ``num_depths`` tokens in one parallel forward.

    Args:
        draft_model: a :class:`~speculators_peagle_plugin.model.peagle_draft.PEagleDraftModel`.
        selected_token_ids: ``[V_d]`` target id of each draft-vocabulary id.
        selected_token_mask: ``[V]`` bool, True at target ids in the draft vocabulary.
        num_depths: ``K``; mask_token_id: id fed at depth >= 1 slots.
        down_sample_ratio, down_sample_ratio_min: COD ``r`` and ``r_min``.
        sequence_partitions: ``S``; ``> 1`` enables the caller-driven partitioned path.
        max_anchors: optional COD chain cap; generator: optional RNG for COD draws.
        hard_label_weight, tv_weight: the loss beside the KL: the target's argmax mixed into
            its distribution, a total-variation term
            (:func:`~speculators_peagle_plugin.kernels.fused_kl.fused_linear_kl`); 0 = none.
        greedy_chains: draw COD rollouts only along the target's greedy path (every
            reply token a rollout does not see is the target's argmax; ``path_mask`` of
            :func:`~speculators_peagle_plugin.core.peagle_data.generate_cod_sample_indices`),
            the only rollouts greedy serving verifies; False: anywhere.

    ``forward(..., peagle_segment=None)`` runs the single flat forward; with
    ``peagle_segment=(plan, i)`` from :meth:`build_peagle_plan` it runs segment
    ``i`` only, so the caller can back-propagate each segment through
    ``DDP.forward``'s output (the reducer's hooks fire only there).
    """

    def __init__(
        self,
        draft_model: torch.nn.Module,
        selected_token_ids: torch.Tensor,
        selected_token_mask: torch.Tensor,
        num_depths: int,
        mask_token_id: int,
        down_sample_ratio: float = CODConfig.down_sample_ratio,
        down_sample_ratio_min: float = CODConfig.down_sample_ratio_min,
        sequence_partitions: int = 1,
        *,
        max_anchors: int | None = None,
        generator: torch.Generator | None = None,
        hard_label_weight: float = 0.0,
        tv_weight: float = 0.0,
        greedy_chains: bool = False,
    ):
        super().__init__()
        cod = CODConfig(num_depths, down_sample_ratio, down_sample_ratio_min, max_anchors)
        self._attach(
            draft_model, selected_token_ids, selected_token_mask, mask_token_id,
            PEagleConfig(cod, sequence_partitions, greedy_chains),
            LossConfig(hard_label_weight, tv_weight), generator,
        )

    def _attach(self, draft_model, selected_token_ids, selected_token_mask, mask_token_id,
                peagle: PEagleConfig, loss: LossConfig, generator) -> None:
        """Check and hold the draft, its vocabulary map, the mask id and the sections."""
        self.peagle, self.loss_config = peagle, loss
        if not isinstance(getattr(draft_model, "mask_hidden", None), torch.nn.Parameter):
            raise ValueError(
                "draft_model has no learnable mask_hidden parameter; P-EAGLE needs a draft "
                "built with it (speculators_peagle_plugin.model.peagle_draft.PEagleDraftModel)."
            )
        vocab = draft_model.embed_tokens.num_embeddings
        if (
            isinstance(mask_token_id, bool)
            or not isinstance(mask_token_id, int)
            or not (0 <= mask_token_id < vocab)
        ):
            raise UserError(
                f"mask_token_id must be an id inside the embedding [0, {vocab}), "
                f"got {mask_token_id!r}."
            )
        selected_token_ids = torch.as_tensor(selected_token_ids).long()
        if selected_token_ids.shape != (draft_model.lm_head.out_features,):
            raise ValueError(
                "selected_token_ids must have one target id per draft-vocabulary entry "
                f"([{draft_model.lm_head.out_features}]), got {list(selected_token_ids.shape)}."
            )
        self.draft = draft_model
        self.mask_token_id = mask_token_id
        self.generator = generator
        self.register_buffer("selected_token_ids", selected_token_ids, persistent=False)
        self.register_buffer(
            "selected_token_mask", torch.as_tensor(selected_token_mask).bool(), persistent=False
        )

    @classmethod
    def from_sections(cls, draft_model, selected_token_ids, selected_token_mask, mask_token_id,
                      peagle: PEagleConfig, loss: LossConfig | None = None, *,
                      generator: torch.Generator | None = None) -> PEagleTrainerModule:
        """The module for a ``peagle`` and a ``loss`` section, taken whole (the seed's
        arguments are their knobs one by one)."""
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        module._attach(draft_model, selected_token_ids, selected_token_mask, mask_token_id,
                       peagle, loss or LossConfig(), generator)
        return module

    @classmethod
    def from_config(cls, draft_model, selected_token_ids, selected_token_mask, mask_token_id,
                    config) -> PEagleTrainerModule:
        """The module for a config's ``peagle`` and ``loss`` sections (a TrainConfig's)."""
        return cls.from_sections(draft_model, selected_token_ids, selected_token_mask,
                                 mask_token_id, config.peagle, config.loss)

    @property
    def num_depths(self) -> int:
        """``K``: the depths trained, the length of the per-depth counts."""
        return self.peagle.cod.num_depths

    # ---- batch plumbing ------------------------------------------------------

    def _sample_row(self, loss_mask_row, doc_row, greedy_row=None):
        """The row's COD elements ``(anchor_pos, depth)``; ``greedy_row`` ``[L]`` (from
        :meth:`greedy_steps`) keeps the rollouts on the target's greedy path."""
        p = self.peagle.cod
        return generate_cod_sample_indices(
            doc_row.shape[0], loss_mask_row, p.num_depths, p.down_sample_ratio,
            p.down_sample_ratio_min, document_ids=doc_row, max_anchors=p.max_anchors,
            generator=self.generator, path_mask=greedy_row,
        )

    @torch.no_grad()
    def greedy_steps(self, input_ids: torch.Tensor, target_logits: torch.Tensor | None = None,
                     verifier_last_hidden_states: torch.Tensor | None = None,
                     ) -> torch.Tensor | None:
        """``[B, L]`` bool: the token after slot ``s`` is the target's argmax at ``s``
        (the last slot: False); ``None`` unless ``greedy_chains``.

        The argmax is the target's among the draft vocabulary's tokens (the verifier head
        the draft holds has only their columns), from ``target_logits`` or from
        ``verifier_last_hidden_states``: a token outside it can never be drafted.
        """
        if not self.peagle.greedy_chains:
            return None
        steps = torch.zeros_like(input_ids, dtype=torch.bool)
        chunk = 1024  # [chunk, V_d] logits at a time
        for b in range(input_ids.shape[0]):
            for s in range(0, input_ids.shape[1] - 1, chunk):
                e = min(s + chunk, input_ids.shape[1] - 1)
                positions = torch.arange(s, e, device=input_ids.device)
                logits = self._targets(
                    positions, row(target_logits, b), row(verifier_last_hidden_states, b)
                )
                greedy = self.selected_token_ids[logits.argmax(-1)]
                steps[b, s:e] = greedy == input_ids[b, s + 1 : e + 1]
        return steps

    def _targets(self, positions, target_logits_row, verifier_row) -> torch.Tensor:
        """Target logits over the draft vocabulary at ``positions`` only: ``[n, V_d]``."""
        if target_logits_row is not None:
            if target_logits_row.shape[-1] == self.selected_token_ids.shape[0]:
                return target_logits_row[positions]
            return target_logits_row[positions[:, None], self.selected_token_ids[None, :]]
        draft = self.draft
        return draft.verifier_lm_head(draft.verifier_norm(verifier_row[positions]))

    # ---- the loss of one row's elements ----------------------------------------

    def _peagle_position_loss(
        self,
        input_ids_row: torch.Tensor,
        aux_row: torch.Tensor,
        target_logits_row: torch.Tensor | None,
        anchor_pos: torch.Tensor,
        depth: torch.Tensor,
        orig_positions: torch.Tensor,
        loss_positions: torch.Tensor,
        row_length: torch.Tensor,
        seq_len: int,
        *,
        verifier_row: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft forward + KL for one row's elements (the flat row, or one segment).

        Args:
            input_ids_row: ``[L]``; aux_row: ``[L, A * H]``;
            target_logits_row: ``[L, V or V_d]`` or ``None`` (then ``verifier_row [L, H]``).
            anchor_pos, depth, orig_positions: ``[N]`` elements, depth-major.
            loss_positions: ``[N]`` bool, the elements charged here; the rest ride
                along as key/value context and stop after the last layer's attention
                (no ``o_proj``, MLP or ``lm_head`` for them).
            row_length: the row's valid length, per packed document: ``[n_docs]``
                lengths from position 0 (their sum is the valid length), or a scalar
                for a row of one document. Positions past it are padding.
            seq_len: ``L``.

        Returns:
            ``(loss_num, loss_den, correct [K], valid [K])``: ``sum KL`` over the charged
            elements (grad-carrying), their count, and per-depth argmax matches and
            counts (``.sum()`` gives the pooled figures). The caller normalises.
        """
        draft = self.draft
        is_ctx = depth == 0
        n0 = int(is_ctx.sum())
        assert bool(is_ctx[:n0].all()), "elements must be depth-major"
        sampled_ids = torch.where(is_ctx, input_ids_row[orig_positions], self.mask_token_id)
        masks = draft.build_peagle_block_mask(
            anchor_pos, depth, torch.as_tensor(row_length), seq_len
        )
        rows = torch.nonzero(loss_positions).squeeze(1)
        # Target logits once per distinct position (elements of different depths share
        # positions), draft columns only; logits and KL for charged rows only.
        positions, target_rows = torch.unique(orig_positions[rows], return_inverse=True)
        with torch.no_grad():
            targets = self._targets(positions, target_logits_row, verifier_row)
        kl_sum, hits = draft_loss.row_loss(
            draft, sampled_ids, aux_row, orig_positions[:n0], orig_positions, masks, rows,
            targets, target_rows, self.loss_config,
        )
        k = self.num_depths
        with torch.no_grad():
            correct = torch.bincount(depth[rows], weights=hits.to(kl_sum.dtype), minlength=k)[:k]
            valid = torch.bincount(depth[rows], minlength=k)[:k].to(kl_sum.dtype)
        return kl_sum, kl_sum.new_tensor(float(rows.numel())), correct, valid

    # ---- flat forward -----------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        loss_mask: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        target_logits: torch.Tensor | None = None,
        peagle_segment: tuple | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        verifier_last_hidden_states: torch.Tensor | None = None,
    ) -> PEagleStepMetrics:
        """P-EAGLE loss for one batch, or for one segment of a plan.

        Args:
            input_ids: ``[B, L]``; attention_mask: ``[B, L]`` (valid length per row) or None.
            loss_mask: ``[B, L]`` supervised positions.
            aux_hidden_states: ``[B, L, A * H]`` captured target states.
            target_logits: ``[B, L, V]`` (or ``[B, L, V_d]``); or None with
                ``verifier_last_hidden_states [B, L, H]`` (pre-norm), from which
                target logits are computed only where charged, draft columns only.
            peagle_segment: ``(plan, i)`` to run segment ``i`` of :meth:`build_peagle_plan`.
            document_ids: ``[B, L]`` packed documents (speculators' field), -1 padding.
        """
        if peagle_segment is not None:
            return self._forward_peagle_segment(
                input_ids, attention_mask, aux_hidden_states, target_logits, peagle_segment,
                verifier_last_hidden_states=verifier_last_hidden_states,
            )
        check_batch_shapes(
            input_ids, loss_mask, aux_hidden_states, target_logits, verifier_last_hidden_states,
            self.draft.fc.in_features,
        )
        docs = batch_document_ids(input_ids, attention_mask, document_ids)
        seq_len = input_ids.shape[1]
        greedy = self.greedy_steps(input_ids, target_logits, verifier_last_hidden_states)
        parts = []
        for b in range(input_ids.shape[0]):
            anchor, depth = self._sample_row(loss_mask[b], docs[b], row(greedy, b))
            ref = anchor + depth
            parts.append(self._peagle_position_loss(
                input_ids[b], aux_hidden_states[b], row(target_logits, b), anchor, depth, ref,
                supervised_elements(loss_mask[b], docs[b], ref), lengths_from_document_ids(docs[b]),
                seq_len, verifier_row=row(verifier_last_hidden_states, b),
            ))
        num, den, correct, valid = (torch.stack(x).sum(0) for x in zip(*parts, strict=True))
        return PEagleStepMetrics(num / den.clamp(min=1), num.detach(), correct, valid, den)

    def forward_batch(self, batch: dict, peagle_segment: tuple | None = None) -> PEagleStepMetrics:
        """Forward on speculators' packed batch (``input_ids``, ``hidden_states``,
        ``verifier_last_hidden_states``, ``loss_mask``, ``document_ids``)."""
        return self(
            batch["input_ids"], None, batch["loss_mask"], batch["hidden_states"], None,
            peagle_segment, document_ids=batch.get("document_ids"),
            verifier_last_hidden_states=batch["verifier_last_hidden_states"],
        )

    # ---- sequence partitioning --------------------------------------------------

    @torch.no_grad()
    def build_peagle_plan(
        self,
        loss_mask: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        greedy_steps: torch.Tensor | None = None,
    ) -> _PeaglePlan:
        """Sample COD once per row and split it into ``sequence_partitions`` segments.

        Emits one :class:`PlanUnit` ``(b, anchor, depth, orig_positions, loss_positions)``
        per non-empty ``(row, segment)`` (see :func:`row_units` for the context each
        carries); ``loss_positions`` marks the segment's owned supervised elements. The
        plan's ``total_den`` is the batch's supervised-element count, so the segments'
        ``loss / total_den`` sum to the flat loss. ``greedy_steps`` ``[B, L]`` (from
        :meth:`greedy_steps`) keeps only greedy-path rollouts, as the flat forward does.
        """
        docs = batch_document_ids(loss_mask, attention_mask, document_ids)
        batch, seq_len = loss_mask.shape
        reach = context_reach(self.draft, seq_len)
        units, total = [], 0
        for b in range(batch):
            doc = docs[b]
            anchor, depth = self._sample_row(loss_mask[b], doc, row(greedy_steps, b))
            supervised = supervised_elements(loss_mask[b], doc, anchor + depth)
            total += int(supervised.sum())
            segments = self.peagle.sequence_partitions
            units += row_units(b, anchor, depth, supervised, doc, segments, reach)
        return _PeaglePlan(units, torch.tensor(float(total)), docs)

    def segments(self, batch: dict) -> list:
        """The forwards of one batch, each to be back-propagated on its own.

        ``[None]`` (one flat forward) with ``sequence_partitions == 1``; otherwise one
        ``(plan, i)`` per unit of :meth:`build_peagle_plan`, possibly none. The caller
        passes each as :meth:`forward_batch`'s ``peagle_segment``.
        """
        if self.peagle.sequence_partitions == 1:
            return [None]
        greedy = self.greedy_steps(
            batch["input_ids"], verifier_last_hidden_states=batch["verifier_last_hidden_states"]
        )
        plan = self.build_peagle_plan(
            batch["loss_mask"], document_ids=batch["document_ids"], greedy_steps=greedy
        )
        return [(plan, i) for i in range(len(plan))]

    def _forward_peagle_segment(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        aux_hidden_states: torch.Tensor,
        target_logits: torch.Tensor | None,
        peagle_segment: tuple,
        *,
        verifier_last_hidden_states: torch.Tensor | None = None,
    ) -> PEagleStepMetrics:
        """Loss of one plan unit; ``metrics.loss`` is its share ``sum KL / total_den``.

        Summed over the plan, the shares give the flat loss; back-propagating each
        one (through ``DDP.forward``'s output) gives the flat gradient.
        """
        plan, i = peagle_segment
        unit: PlanUnit = plan.units[i]
        b = unit.b
        num, den, correct, valid = self._peagle_position_loss(
            input_ids[b],
            aux_hidden_states[b],
            row(target_logits, b),
            unit.anchor,
            unit.depth,
            unit.orig_positions,
            unit.loss_positions,
            lengths_from_document_ids(plan.document_ids[b]),
            input_ids.shape[1],
            verifier_row=row(verifier_last_hidden_states, b),
        )
        total = plan.total_den.to(num)
        return PEagleStepMetrics(num / total.clamp(min=1), num.detach(), correct, valid, total)
