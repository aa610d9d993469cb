"""Random packed rows: ragged documents, padding, random supervision."""

from __future__ import annotations

import torch

from ..core.peagle_data import generate_cod_sample_indices


def ragged_lengths(gen: torch.Generator, used: int, n_docs: int, min_cut: int = 1) -> list[int]:
    """``n_docs`` positive lengths summing to ``used``, cut at random places."""
    cuts = sorted(torch.randperm(used - min_cut, generator=gen)[: n_docs - 1].add(1).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, used], strict=True)]


def packed_document_ids(gen, batch: int, seq_len: int, n_docs: int, pad: int, shrink: int = 0):
    """``[batch, seq_len]`` document ids (``-1`` = padding); row ``b`` uses
    ``seq_len - pad - b * shrink`` positions, so rows are ragged when ``shrink > 0``."""
    docs = torch.full((batch, seq_len), -1, dtype=torch.long)
    for b in range(batch):
        used = seq_len - pad - b * shrink
        start = 0
        for i, n in enumerate(ragged_lengths(gen, used, n_docs, min_cut=2)):
            docs[b, start : start + n] = i
            start += n
    return docs


def random_cod_elements(seed, length=71, num_depths=5, drop_context=False):
    """``(anchor, depth, doc)``: a COD sample of a ragged packed row (several documents,
    padding); optionally with random elements removed, so some rows lose their own anchor
    (an empty context band under a short window) and some rollouts have gaps."""
    gen = torch.Generator().manual_seed(seed)
    used = length - int(torch.randint(0, 9, (1,), generator=gen))
    cuts = sorted(torch.randperm(used - 2, generator=gen)[:3].add(1).tolist())
    doc = torch.full((length,), -1, dtype=torch.long)
    for i, (s, e) in enumerate(zip([0, *cuts], [*cuts, used], strict=True)):
        doc[s:e] = i
    loss_mask = (torch.rand(length, generator=gen) < 0.85).long()
    anchor, depth = generate_cod_sample_indices(
        length, loss_mask, num_depths, 0.9, 0.4, document_ids=doc, generator=gen
    )
    if drop_context:  # also leaves gaps in rollouts
        keep = torch.rand(anchor.shape, generator=gen) < torch.where(depth == 0, 0.6, 0.8)
        anchor, depth = anchor[keep], depth[keep]
    return anchor, depth, doc


def packed_batch(seed, *, vocab, aux_width, hidden, batch=2, seq_len=61, n_docs=3, pad=7,
                 dtype=torch.float64) -> dict:
    """speculators' packed batch of ragged rows with padding (document ids -1) and random
    supervision; token ids below ``vocab - 1`` (the last id is left for a mask token).

    Shapes: ``input_ids, loss_mask, document_ids [batch, seq_len]``, ``hidden_states
    [batch, seq_len, aux_width]``, ``verifier_last_hidden_states [batch, seq_len, hidden]``.
    """
    gen = torch.Generator().manual_seed(seed)
    docs = packed_document_ids(gen, batch, seq_len, n_docs, pad, shrink=3)
    loss_mask = (torch.rand(batch, seq_len, generator=gen) < 0.8).long()
    return dict(
        input_ids=torch.randint(0, vocab - 1, (batch, seq_len), generator=gen),
        loss_mask=loss_mask,
        document_ids=docs,
        hidden_states=torch.randn(batch, seq_len, aux_width, generator=gen, dtype=dtype),
        verifier_last_hidden_states=torch.randn(batch, seq_len, hidden, generator=gen, dtype=dtype),
    )
