"""Reference implementations the tests and ``selftest`` compare the product against.

Each oracle is the rule written the plainest way: loops over Python ints, dense
``[N, N]`` masks, float64 softmax. They are slow on purpose and share no code with the
rest of the package (the product's draft modules are read for their weights only).
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
        q: ``[..., nh, Nq, hd]``; k, v: ``[..., nkv, Nk, hd]`` (each key/value head serves
            ``nh / nkv`` query heads); allowed: ``[Nq, Nk]`` (broadcast).
    """
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num() @ v


def kl_target_draft(target_logits, draft_logits) -> torch.Tensor:
    """``KL(softmax(target) || softmax(draft))`` per row, summed over the last axis."""
    log_p = torch.log_softmax(target_logits, -1)
    return (log_p.exp() * (log_p - torch.log_softmax(draft_logits, -1))).sum(-1)


def rms_norm(norm, x) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` in the input's dtype (transformers' RMSNorm
    upcasts to float32 whatever the input, which would blur a float64 comparison)."""
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def rope(x, cos, sin) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x [N, heads, hd]`` with ``cos, sin [N, hd]``."""
    d = x.shape[-1]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def dense_draft_hidden(draft, ids, projected, positions, allowed) -> torch.Tensor:
    """The draft's decoder layers written out with a dense mask; ``[N, D]`` before the norm.

    Args:
        draft: a P-EAGLE draft (llama or qwen3 layers; the first takes ``[embeds, hidden]``).
        ids: ``[N]`` token ids; projected: ``[N, D]`` ``fc``-projected hidden states.
        positions: ``[N]`` RoPE positions; allowed: ``[N, N]`` bool visibility.
    """
    cfg = draft.config.transformer_layer_config
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    emb, h = draft.embed_tokens(ids), projected
    # transformers' rotary table (it computes the angles in float32 whatever the dtype)
    cos, sin = (t[0] for t in draft.rotary_emb(emb[None], positions[None]))
    for i, layer in enumerate(draft.layers):
        attn = layer.self_attn
        if i == 0:
            resid = h
            x = torch.cat(
                [rms_norm(layer.input_layernorm, emb), rms_norm(layer.hidden_norm, h)], -1
            )
        else:
            resid, x = h, rms_norm(layer.input_layernorm, h)
        q = attn.q_proj(x).view(-1, nh, hd)
        k = attn.k_proj(x).view(-1, nkv, hd)
        if hasattr(attn, "q_norm"):  # qwen3 normalises each head before RoPE
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k = k.repeat_interleave(nh // nkv, 1)
        v = attn.v_proj(x).view(-1, nkv, hd).repeat_interleave(nh // nkv, 1)
        out = masked_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), allowed,
                               hd**-0.5)
        h = resid + attn.o_proj(out.transpose(0, 1).reshape(-1, nh * hd))
        h = h + layer.mlp(rms_norm(layer.post_attention_layernorm, h))
    return h


def dense_reference_loss(draft, batch, rows, mask_token_id) -> torch.Tensor:
    """The P-EAGLE loss of ``batch`` with attention by plain softmax over dense masks.

    Args:
        draft: a P-EAGLE draft (weights only: every computation is written out here).
        batch: speculators' packed batch (``input_ids``, ``loss_mask``, ``document_ids``,
            ``hidden_states``, ``verifier_last_hidden_states``), ``[B, L, ...]``.
        rows: per batch row ``(anchor, depth, allowed)``: its COD elements ``[N]`` and
            their ``[N, N]`` visibility (the same sample the product drew).
        mask_token_id: the id fed at depth >= 1 slots.

    Returns the summed KL over supervised elements divided by their count.
    """
    total, parts = 0, []
    for b, (anchor, depth, allowed) in enumerate(rows):
        doc = batch["document_ids"][b]
        ref = anchor + depth
        is0 = depth == 0
        ids = torch.where(is0, batch["input_ids"][b][ref], mask_token_id)
        hid = torch.where(
            is0[:, None],
            batch["hidden_states"][b][ref],
            draft.mask_hidden[0].expand(ref.shape[0], -1),
        )
        h = dense_draft_hidden(draft, ids, draft.fc(hid), ref, allowed)
        sup = (batch["loss_mask"][b][ref] != 0) & (doc[ref] >= 0)
        logits = draft.lm_head(rms_norm(draft.norm, h[sup]))
        target = draft.verifier_lm_head(
            rms_norm(draft.verifier_norm, batch["verifier_last_hidden_states"][b][ref[sup]])
        )
        parts.append(kl_target_draft(target, logits).sum())
        total += int(sup.sum())
    return torch.stack(parts).sum() / total
