"""Mask-token choice: an embedding row the target's tokenizer never produces."""

import pytest
from tiny import tiny_tokenizer

from speculators_peagle_plugin.model.mask_token import choose_mask_token_id, mask_token_problem

BASE = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def produced_ids(tok, seed):
    """Every id the target can emit, found by brute force: all words as text, every role
    token, and chat-template renderings."""
    import random

    rng = random.Random(seed)
    words = [w for w in tok.get_vocab() if not w.startswith("<") and w != "[UNK]"]
    rng.shuffle(words)
    ids = set(tok(" ".join(words))["input_ids"])
    chat = [{"role": "user", "content": words[0]}, {"role": "assistant", "content": words[1]}]
    ids |= set(tok.apply_chat_template(chat, tokenize=True, return_dict=False))
    ids |= {tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    return ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_produced_id_is_refused_and_the_choice_is_never_produced(seed):
    tok = tiny_tokenizer(specials=(*BASE, "<tool>", "<reserved_7>", "<empty>"))
    vocab = len(tok)
    produced = produced_ids(tok, seed)
    for i in range(vocab):
        if i in produced:
            assert mask_token_problem(tok, i, vocab) is not None, i
    chosen, why = choose_mask_token_id(tok, vocab)
    assert chosen not in produced and mask_token_problem(tok, chosen, vocab) is None
    assert tok.convert_ids_to_tokens(chosen) == "<reserved_7>" and "<reserved_7>" in why


def test_rows_past_the_tokenizer_come_first():
    tok = tiny_tokenizer(specials=(*BASE, "<reserved_0>"))
    chosen, why = choose_mask_token_id(tok, len(tok) + 6)
    assert chosen == len(tok) and "past the tokenizer" in why
    assert mask_token_problem(tok, len(tok) + 5, len(tok) + 6) is None


def test_without_reserved_names_the_last_unused_special_is_chosen():
    tok = tiny_tokenizer(specials=(*BASE, "<a>", "<b>"))
    chosen, _ = choose_mask_token_id(tok, len(tok))
    assert tok.convert_ids_to_tokens(chosen) == "<b>"


def test_no_free_token_is_an_error():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="no unused token"):
        choose_mask_token_id(tok, len(tok))


@pytest.mark.parametrize(
    ("token", "message"),
    [("<|im_end|>", "special token the target emits"), ("w3", "ordinary vocabulary token")],
)
def test_problem_sentences(token, message):
    tok = tiny_tokenizer()
    assert message in mask_token_problem(tok, tok.convert_tokens_to_ids(token), len(tok))
    assert "outside the embedding" in mask_token_problem(tok, len(tok), len(tok))
    assert "outside the embedding" in mask_token_problem(tok, -1, len(tok))
