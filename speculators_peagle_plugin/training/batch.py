"""The trainer's view of a batch: shape checks, document ids, supervised elements.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``B`` batch rows, ``L`` tokens per
row, ``N`` COD elements of a row, ``A`` aux layers, ``H`` target hidden size.
"""

from __future__ import annotations

import torch


def row(tensor: torch.Tensor | None, b: int) -> torch.Tensor | None:
    """Row ``b`` of an optional batched tensor."""
    return None if tensor is None else tensor[b]


def batch_document_ids(input_ids, attention_mask, document_ids) -> torch.Tensor:
    """``[B, L]`` document ids: given, or one document of each row's valid length.

    Example: no ``document_ids``, ``attention_mask`` row [1, 1, 1, 0] -> [0, 0, 0, -1];
    neither given -> every position in document 0.
    """
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


def check_batch_shapes(
    input_ids, loss_mask, aux_hidden_states, target_logits, verifier, aux_width: int
) -> None:
    """Raise a one-sentence ValueError unless the batch's tensors agree.

    Every tensor starts with ``input_ids``' ``[B, L]``; ``aux_hidden_states`` is
    ``[B, L, A * H]`` with ``A * H = aux_width`` (the draft's ``fc`` input); exactly one
    of ``target_logits`` and ``verifier`` (the verifier's last hidden states) is given.
    """
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
                f"{name} must start with input_ids' shape {list(lead)}, got {list(tensor.shape)}."
            )
    if aux_hidden_states.shape[-1] != aux_width:
        raise ValueError(
            f"aux_hidden_states must have n_aux * target_hidden = {aux_width} features, "
            f"got {aux_hidden_states.shape[-1]}."
        )
    if (target_logits is None) == (verifier is None):
        raise ValueError("pass exactly one of target_logits or verifier_last_hidden_states.")


def supervised_elements(loss_mask_row, document_ids_row, orig_positions) -> torch.Tensor:
    """``[N]`` bool: the element's reference position is supervised and not padding."""
    return (loss_mask_row[orig_positions] != 0) & (document_ids_row[orig_positions] >= 0)
