"""Choosing and checking the mask token: an embedding row the target never produces.

P-EAGLE fills the K-1 speculative slots with ``embed_tokens[mask_token_id]`` (plus
``mask_hidden``). If the target can produce that token, a real context slot and a mask
slot share an embedding and the draft cannot tell them apart, so the id must be one the
tokenizer never emits: an embedding row past the tokenizer's vocabulary, or an added
special token that neither the chat template nor a special role (bos/eos/pad/unk) uses.
Ordinary vocabulary tokens are produced from plain text and are never allowed.
"""

from __future__ import annotations

import re

from ..common.errors import UserError

# Conversations rendered to find the special tokens a chat template emits. Some templates
# reject a system turn, so each is tried on its own.
_PROBE_CONVERSATIONS = (
    [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "v"},
    ],
    [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
)
_RESERVED_NAME = re.compile(r"reserved|unused", re.IGNORECASE)


def _added_token_ids(tokenizer) -> dict[int, str]:
    """``{id: content}`` of every token added on top of the base vocabulary."""
    return {i: tok.content for i, tok in tokenizer.added_tokens_decoder.items()}


def _used_special_ids(tokenizer) -> set[int]:
    """Added-token ids the target emits: special roles and whatever the chat template renders."""
    used = {
        i
        for i in (
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            tokenizer.unk_token_id,
        )
        if i is not None
    }
    if getattr(tokenizer, "chat_template", None):
        for conversation in _PROBE_CONVERSATIONS:
            for generation_prompt in (False, True):
                try:
                    ids = tokenizer.apply_chat_template(
                        conversation[:-1] if generation_prompt else conversation,
                        tokenize=True,
                        add_generation_prompt=generation_prompt,
                        return_dict=False,
                    )
                except Exception:  # noqa: BLE001 - a template may reject a probe conversation
                    continue
                used.update(int(i) for i in ids)
    return used & set(_added_token_ids(tokenizer))


def mask_token_problem(tokenizer, token_id: int, vocab_size: int) -> str | None:
    """Why ``token_id`` cannot be the mask token, as one sentence, or ``None`` if it can.

    Args:
        tokenizer: the target's tokenizer.
        token_id: the candidate id.
        vocab_size: rows of the draft's (= target's) embedding.

    Example: for SmolLM2 id 2 (``<|im_end|>``) is refused because the chat template emits
    it; id 16 (``<empty_output>``, an added special token the template never uses) is fine.
    """
    if not 0 <= token_id < vocab_size:
        return (
            f"mask_token_id {token_id} is outside the embedding; it must be in [0, {vocab_size})."
        )
    if token_id >= len(tokenizer):
        return None
    added = _added_token_ids(tokenizer)
    name = tokenizer.convert_ids_to_tokens(token_id)
    if token_id not in added:
        return (
            f"mask_token_id {token_id} ({name!r}) is an ordinary vocabulary token the "
            "tokenizer produces from text; use an unused special token or an embedding row "
            f"past the tokenizer (len {len(tokenizer)})."
        )
    if token_id in _used_special_ids(tokenizer):
        return (
            f"mask_token_id {token_id} ({name!r}) is a special token the target emits "
            "(chat template or bos/eos/pad/unk); use an unused special token instead."
        )
    return None


def choose_mask_token_id(tokenizer, vocab_size: int) -> tuple[int, str]:
    """Pick a mask token the target never produces, and say why it qualifies.

    Preference: the first embedding row past the tokenizer's vocabulary (Qwen3: 151669 of
    151936 rows), then an added token named reserved/unused (Llama-3's
    ``<|reserved_special_token_*|>``), then the last added special token the chat
    template and special roles never use (SmolLM2: 16, ``<empty_output>``). Raises
    ``ValueError`` if there is none.
    """
    if len(tokenizer) < vocab_size:
        token_id = len(tokenizer)
        return token_id, (
            f"id {token_id}: an embedding row past the tokenizer's {len(tokenizer)} tokens, "
            "never produced"
        )
    used = _used_special_ids(tokenizer)
    free = {i: name for i, name in _added_token_ids(tokenizer).items() if i not in used}
    free = {i: name for i, name in free.items() if i < vocab_size}
    if not free:
        raise UserError(
            "The tokenizer has no unused token for mask_token_id: every embedding row is an "
            "ordinary token or a special token the target emits; pass --mask-token-id "
            "explicitly after extending the embedding."
        )
    reserved = sorted(i for i, name in free.items() if _RESERVED_NAME.search(name))
    # Without reserved names, the last added token is the least likely to be in use.
    token_id = reserved[0] if reserved else max(free)
    return token_id, (
        f"id {token_id} ({free[token_id]!r}): an added special token that the chat template "
        "and bos/eos/pad/unk never use"
    )
