"""Reference implementations the tests compare the product against.

Each oracle is the rule written the plainest way: loops over Python ints, dense
``[N, N]`` masks, float64 softmax. They are slow on purpose and share no code with the
package.
"""

from __future__ import annotations

import torch


def brute_force_mask(anchor, depth, lengths, total_seq_len, window=None) -> torch.Tensor:
    """``[N, N]`` bool: the P-EAGLE visibility rule, one (query, key) pair at a time.

    Query q sees key k iff q is not padding, both anchors lie in the same document, and
    either k is depth-0 context at or before q's anchor (within ``window`` of q's reference
    position ``anchor + depth`` when given) or k is earlier-or-equal in q's own rollout.
    """
    doc = []
    for i, n in enumerate(lengths):
        doc += [i] * int(n)
    doc += [-1] * (total_seq_len - len(doc))
    anchor, depth = anchor.tolist(), depth.tolist()
    n = len(anchor)
    out = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            if doc[anchor[q]] == -1 or doc[anchor[q]] != doc[anchor[k]]:
                continue
            in_window = window is None or anchor[k] > anchor[q] + depth[q] - window
            context = depth[k] == 0 and anchor[k] <= anchor[q] and in_window
            rollout = anchor[k] == anchor[q] and depth[k] <= depth[q]
            out[q, k] = context or rollout
    return out


def masked_attention(q, k, v, allowed, scale) -> torch.Tensor:
    """Softmax attention over a dense bool mask; a query that sees no key outputs 0.

    Args:
        q: ``[..., Nq, hd]``; k, v: ``[..., Nk, hd]``; allowed: ``[Nq, Nk]`` (broadcast).
    """
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num() @ v


def kl_target_draft(target_logits, draft_logits) -> torch.Tensor:
    """``KL(softmax(target) || softmax(draft))`` per row, summed over the last axis."""
    log_p = torch.log_softmax(target_logits, -1)
    return (log_p.exp() * (log_p - torch.log_softmax(draft_logits, -1))).sum(-1)
