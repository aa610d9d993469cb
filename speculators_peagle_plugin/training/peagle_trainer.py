"""P-EAGLE training module: COD sample -> flat draft forward -> KL over the draft vocab.

Legend: ``B`` = rows, ``L`` = padded row length, ``N`` = COD elements of a row (or
segment), ``V`` / ``V_d`` = target / draft vocabulary, ``K`` = depths.

Why partitioning is exact (causal completion): an element's attention reads only
depth-0 elements of earlier-or-equal anchors in its document plus its own
rollout. A segment owns depth-0 elements by ``anchor`` and deeper ones by
``anchor + 1`` (:func:`assign_cod_segments`), and also carries every depth-0
element of earlier-or-equal segments as key/value context. So every owned
element sees, at every layer, exactly the keys it sees in the flat forward, and
each supervised element is charged in exactly one segment: the segment losses
sum to the flat loss and, through the full dependency graph, their gradients
sum to the flat gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.config import CODConfig, check_int_at_least
from ..core.peagle_attention import document_starts, lengths_from_document_ids
from ..core.peagle_data import assign_cod_segments, generate_cod_sample_indices
from ..kernels.fused_kl import fused_linear_kl

__all__ = ["PEagleStepMetrics", "PEagleTrainerModule", "_PeaglePlan", "_kl_div_loss"]


def _row(tensor: torch.Tensor | None, b: int) -> torch.Tensor | None:
    return None if tensor is None else tensor[b]


def _kl_div_loss(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(target || draft) over the draft vocabulary: ``[*, V_d] -> [*]``.

    ``sum p_t (log p_t - log p_d)`` with ``p_t = softmax(target)``,
    ``log p_d = log_softmax(draft)``; float32 at least, as speculators' ``kl_div_loss``.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    log_p_draft = torch.log_softmax(logits.to(dtype), dim=-1)
    log_p_target = torch.log_softmax(target_logits.to(dtype), dim=-1)
    return (log_p_target.exp() * (log_p_target - log_p_draft)).sum(-1)


@dataclass
class PEagleStepMetrics:
    """Loss and accuracies of one forward (a batch, or one segment of it).

    Args:
        loss: grad-carrying scalar, this forward's share of the count-normalised batch loss.
        loss_sum: detached ``sum KL`` over the charged elements.
        correct: ``[K]`` argmax matches per depth.
        valid: ``[K]`` charged (supervised) elements per depth.
        total_den: the batch's one loss denominator (supervised elements in all rows).
    """

    loss: torch.Tensor
    loss_sum: torch.Tensor
    correct: torch.Tensor
    valid: torch.Tensor
    total_den: torch.Tensor

    def __add__(self, other: PEagleStepMetrics) -> PEagleStepMetrics:
        return PEagleStepMetrics(
            self.loss + other.loss,
            self.loss_sum + other.loss_sum,
            self.correct + other.correct,
            self.valid + other.valid,
            self.total_den,
        )

    @property
    def accuracy(self) -> float:
        return float(self.correct.sum() / self.valid.sum().clamp(min=1))

    @property
    def accuracy_per_depth(self) -> list[float]:
        return (self.correct / self.valid.clamp(min=1)).tolist()

    @property
    def acceptance_length(self) -> float:
        """Estimated tokens per verify step: ``1 + sum_k prod_{j<=k} acc_j``.

        Greedy chain acceptance, treating per-depth teacher-forced accuracies as
        independent acceptance rates; 1 is the bonus token.
        """
        acc = self.correct / self.valid.clamp(min=1)
        return float(1 + torch.cumprod(acc.double(), 0).sum())


class _PeaglePlan:
    """Sequence-partitioning plan: one ``unit`` per non-empty ``(row, segment)``.

    A plain class on purpose: DDP scatters tensors and built-in containers in its
    inputs, and would slice a tuple of tensors along dim 0.

    Args:
        units: ``(b, anchor_pos [n], depth [n], orig_positions [n], loss_positions [n] bool)``.
        total_den: the batch's supervised-element count (the one loss denominator).
        document_ids: ``[B, L]`` document per position, -1 padding.
    """

    def __init__(self, units: list[tuple], total_den: torch.Tensor, document_ids=None):
        self.units = units
        self.total_den = total_den
        self.document_ids = document_ids

    def __len__(self) -> int:
        return len(self.units)


class PEagleTrainerModule(torch.nn.Module):
    """Draft-side P-EAGLE trainer: all ``num_depths`` tokens in one parallel forward.

    Args:
        draft_model: a :class:`~speculators_peagle_plugin.draft.PEagleDraftModel`.
        selected_token_ids: ``[V_d]`` target id of each draft-vocabulary id.
        selected_token_mask: ``[V]`` bool, True at target ids in the draft vocabulary.
        num_depths: ``K``; mask_token_id: id fed at depth >= 1 slots.
        down_sample_ratio, down_sample_ratio_min: COD ``r`` and ``r_min``.
        sequence_partitions: ``S``; ``> 1`` enables the caller-driven partitioned path.
        max_anchors: optional COD chain cap; generator: optional RNG for COD draws.

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
    ):
        super().__init__()
        self.cod = CODConfig(num_depths, down_sample_ratio, down_sample_ratio_min, max_anchors)
        self.sequence_partitions = check_int_at_least("sequence_partitions", sequence_partitions, 1)
        if not isinstance(getattr(draft_model, "mask_hidden", None), torch.nn.Parameter):
            raise ValueError(
                "draft_model has no learnable mask_hidden parameter; P-EAGLE needs a draft "
                "built with it (speculators_peagle_plugin.draft.PEagleDraftModel)."
            )
        vocab = draft_model.embed_tokens.num_embeddings
        if (
            isinstance(mask_token_id, bool)
            or not isinstance(mask_token_id, int)
            or not (0 <= mask_token_id < vocab)
        ):
            raise ValueError(
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

    @property
    def num_depths(self) -> int:
        return self.cod.num_depths

    # ---- batch plumbing ------------------------------------------------------

    @staticmethod
    def _document_ids(input_ids, attention_mask, document_ids) -> torch.Tensor:
        """``[B, L]`` document ids: given, or one document of each row's valid length."""
        if document_ids is not None:
            if document_ids.shape != input_ids.shape:
                raise ValueError(
                    f"document_ids must match input_ids' shape {list(input_ids.shape)}, "
                    f"got {list(document_ids.shape)}."
                )
            return document_ids.long()
        if attention_mask is None:
            return torch.zeros_like(input_ids, dtype=torch.long)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask must match input_ids' shape {list(input_ids.shape)}, "
                f"got {list(attention_mask.shape)}."
            )
        length = attention_mask.long().sum(-1, keepdim=True)  # [B, 1]
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return torch.where(pos < length, 0, -1)

    def _check_shapes(self, input_ids, loss_mask, aux_hidden_states, target_logits, verifier):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got {list(input_ids.shape)}.")
        batch, length = input_ids.shape
        checks = [
            ("loss_mask", loss_mask, (batch, length)),
            ("aux_hidden_states", aux_hidden_states, (batch, length)),
            ("target_logits", target_logits, (batch, length)),
            ("verifier_last_hidden_states", verifier, (batch, length)),
        ]
        for name, tensor, lead in checks:
            if tensor is not None and tuple(tensor.shape[:2]) != lead:
                raise ValueError(
                    f"{name} must start with input_ids' shape {list(lead)}, "
                    f"got {list(tensor.shape)}."
                )
        width = self.draft.fc.in_features
        if aux_hidden_states.shape[-1] != width:
            raise ValueError(
                f"aux_hidden_states must have n_aux * target_hidden = {width} features, "
                f"got {aux_hidden_states.shape[-1]}."
            )
        if (target_logits is None) == (verifier is None):
            raise ValueError("pass exactly one of target_logits or verifier_last_hidden_states.")

    def _sample_row(self, loss_mask_row, doc_row):
        return generate_cod_sample_indices(
            doc_row.shape[0],
            loss_mask_row,
            self.cod.num_depths,
            self.cod.down_sample_ratio,
            self.cod.down_sample_ratio_min,
            document_ids=doc_row,
            max_anchors=self.cod.max_anchors,
            generator=self.generator,
        )

    @staticmethod
    def _supervised(loss_mask_row, doc_row, orig_positions):
        return (loss_mask_row[orig_positions] != 0) & (doc_row[orig_positions] >= 0)

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
        document_ids_row: torch.Tensor | None = None,
        verifier_row: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft forward + KL for one row's elements (the flat row, or one segment).

        Args:
            input_ids_row: ``[L]``; aux_row: ``[L, n_aux * H_t]``;
            target_logits_row: ``[L, V or V_d]`` or ``None`` (then ``verifier_row [L, H_t]``).
            anchor_pos, depth, orig_positions: ``[n]`` elements, depth-major.
            loss_positions: ``[n]`` bool, the elements charged here; the rest ride
                along as key/value context and get no ``lm_head`` call.
            row_length: valid length (one document) when ``document_ids_row`` is None.
            seq_len: ``L``.

        Returns:
            ``(loss_num, loss_den, correct [K], valid [K])``: ``sum KL`` over the charged
            elements (grad-carrying), their count, and per-depth argmax matches and
            counts (``.sum()`` gives the pooled figures). The caller normalises.
        """
        draft = self.draft
        if document_ids_row is None:
            document_ids_row = torch.where(
                torch.arange(seq_len, device=anchor_pos.device) < row_length, 0, -1
            )
        is_ctx = depth == 0
        n0 = int(is_ctx.sum())
        assert bool(is_ctx[:n0].all()), "elements must be depth-major"
        sampled_ids = torch.where(is_ctx, input_ids_row[orig_positions], self.mask_token_id)
        # fc runs on the n0 real rows only; one projected mask_hidden fills every deeper
        # slot and stays in the autograd graph even when there is none (DDP needs every
        # parameter used on every rank).
        projected = torch.cat(
            [
                draft.project_hidden_states(aux_row[orig_positions[:n0]]),
                draft.masked_projected_hidden().expand(depth.shape[0] - n0, -1),
            ]
        )
        masks = draft.build_peagle_block_mask(
            anchor_pos, depth, lengths_from_document_ids(document_ids_row), seq_len
        )
        hidden = draft.forward_peagle(
            sampled_ids[None],
            projected[None],
            orig_positions[None],
            masks,
            mask_slots=depth.shape[0] - n0,
        )[0]
        rows = torch.nonzero(loss_positions).squeeze(1)
        # Target logits once per distinct position (elements of different depths share
        # positions), draft columns only; logits and KL for charged rows only.
        positions, target_rows = torch.unique(orig_positions[rows], return_inverse=True)
        with torch.no_grad():
            targets = self._targets(positions, target_logits_row, verifier_row)
        kl_sum, hits = fused_linear_kl(
            draft.lm_head_inputs(hidden[rows]), draft.lm_head.weight, targets, target_rows
        )
        k = self.cod.num_depths
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
            aux_hidden_states: ``[B, L, n_aux * H_t]`` captured target states.
            target_logits: ``[B, L, V]`` (or ``[B, L, V_d]``); or None with
                ``verifier_last_hidden_states [B, L, H_t]`` (pre-norm), from which
                target logits are computed only where charged, draft columns only.
            peagle_segment: ``(plan, i)`` to run segment ``i`` of :meth:`build_peagle_plan`.
            document_ids: ``[B, L]`` packed documents (speculators' field), -1 padding.
        """
        if peagle_segment is not None:
            return self._forward_peagle_segment(
                input_ids,
                attention_mask,
                aux_hidden_states,
                target_logits,
                peagle_segment,
                verifier_last_hidden_states=verifier_last_hidden_states,
            )
        self._check_shapes(
            input_ids, loss_mask, aux_hidden_states, target_logits, verifier_last_hidden_states
        )
        docs = self._document_ids(input_ids, attention_mask, document_ids)
        seq_len = input_ids.shape[1]
        parts = []
        for b in range(input_ids.shape[0]):
            anchor, depth = self._sample_row(loss_mask[b], docs[b])
            ref = anchor + depth
            parts.append(
                self._peagle_position_loss(
                    input_ids[b],
                    aux_hidden_states[b],
                    _row(target_logits, b),
                    anchor,
                    depth,
                    ref,
                    self._supervised(loss_mask[b], docs[b], ref),
                    None,
                    seq_len,
                    document_ids_row=docs[b],
                    verifier_row=_row(verifier_last_hidden_states, b),
                )
            )
        num, den, correct, valid = (torch.stack(x).sum(0) for x in zip(*parts, strict=True))
        return PEagleStepMetrics(num / den.clamp(min=1), num.detach(), correct, valid, den)

    def forward_batch(self, batch: dict, peagle_segment: tuple | None = None) -> PEagleStepMetrics:
        """Forward on speculators' packed batch (``input_ids``, ``hidden_states``,
        ``verifier_last_hidden_states``, ``loss_mask``, ``document_ids``)."""
        return self(
            batch["input_ids"],
            None,
            batch["loss_mask"],
            batch["hidden_states"],
            None,
            peagle_segment,
            document_ids=batch.get("document_ids"),
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
    ) -> _PeaglePlan:
        """Sample COD once per row and split it into ``sequence_partitions`` segments.

        Each unit holds the segment's owned elements plus, as context, every depth-0
        element of earlier-or-equal segments that can reach them: from the first owned
        element's document start (earlier documents are invisible at every layer), and
        when every layer is windowed, within ``num_layers * (W - 1)`` anchors of it.
        ``loss_positions`` marks the owned supervised elements; units with none are skipped.
        """
        docs = self._document_ids(loss_mask, attention_mask, document_ids)
        batch, seq_len = loss_mask.shape
        # With every layer windowed, an owned element's receptive field over depth-0 rows
        # reaches back at most num_layers * (W - 1) anchors from its own anchor.
        draft = self.draft
        windowed = draft.sliding_window is not None and len(draft.sliding_window_indices) == len(
            draft.layers
        )
        reach = len(draft.layers) * (draft.sliding_window - 1) if windowed else seq_len
        units, total = [], 0
        for b in range(batch):
            doc = docs[b]
            doc_start = document_starts(doc)
            anchor, depth = self._sample_row(loss_mask[b], doc)
            ref = anchor + depth
            supervised = self._supervised(loss_mask[b], doc, ref)
            total += int(supervised.sum())
            seg = assign_cod_segments(anchor, depth, seq_len, self.sequence_partitions)
            is_ctx = depth == 0
            for s in range(self.sequence_partitions):
                owned = seg == s
                charged = owned & supervised
                if not bool(charged.any()):
                    continue
                first_owned = anchor[owned].min()
                first = torch.maximum(doc_start[first_owned], first_owned - reach)
                keep = owned | (is_ctx & (seg <= s) & (anchor >= first))
                units.append((b, anchor[keep], depth[keep], ref[keep], charged[keep]))
        return _PeaglePlan(units, torch.tensor(float(total)), docs)

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
        b, anchor, depth, ref, charged = plan.units[i]
        num, den, correct, valid = self._peagle_position_loss(
            input_ids[b],
            aux_hidden_states[b],
            _row(target_logits, b),
            anchor,
            depth,
            ref,
            charged,
            None,
            input_ids.shape[1],
            document_ids_row=plan.document_ids[b],
            verifier_row=_row(verifier_last_hidden_states, b),
        )
        total = plan.total_den.to(num)
        return PEagleStepMetrics(num / total.clamp(min=1), num.detach(), correct, valid, total)
