"""Random packed rows: ragged documents, padding, random supervision."""

from __future__ import annotations

import torch


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
