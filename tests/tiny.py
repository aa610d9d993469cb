"""Tiny random P-EAGLE drafts built from configs (no download)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config

from speculators_peagle_plugin.model.peagle_draft import PEagleDraftModel
from speculators_peagle_plugin.selftest.shapes import peagle_config

TARGET_VOCAB, DRAFT_VOCAB, MASK_TOKEN = 96, 40, 95


def tiny_target(path, seed=0):
    """A 4-layer random llama target with the draft's shapes, saved to ``path``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=4, vocab_size=TARGET_VOCAB, max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def tiny_config(
    model_type="llama", num_layers=1, sliding_window=None, num_depths=4, verifier_path=None
):
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[model_type]
    extra = {"use_sliding_window": bool(sliding_window)} if model_type == "qwen3" else {}
    layer_cfg = cls(
        **extra, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=num_layers, vocab_size=TARGET_VOCAB,
        max_position_embeddings=4096, rms_norm_eps=1e-6, sliding_window=sliding_window,
        layer_types=["sliding_attention" if sliding_window else "full_attention"] * num_layers,
    )
    return peagle_config(
        layer_cfg, num_depths=num_depths, draft_vocab=DRAFT_VOCAB, layer_ids=[1, 2, 3],
        mask_token=MASK_TOKEN, verifier_path=verifier_path,
    )


def vocab_map(seed=0):
    """t2d / d2t for a random draft vocabulary (d2t holds offsets, speculators' format)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(TARGET_VOCAB - 1, generator=gen)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(TARGET_VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return ids, t2d, ids - torch.arange(DRAFT_VOCAB)


def tiny_draft(seed=0, dtype=torch.float32, **config_kwargs):
    torch.manual_seed(seed)
    draft = PEagleDraftModel(tiny_config(**config_kwargs))
    ids, t2d, d2t = vocab_map(seed)
    draft.load_vocab_mappings(t2d, d2t)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(torch.randn(TARGET_VOCAB, 64, generator=gen))
        head = torch.randn(TARGET_VOCAB, 64, generator=gen) * 0.3
        draft.lm_head.weight.copy_(head[ids])
        draft.verifier_lm_head.weight.copy_(head[ids])
        draft.verifier_norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=gen))
    draft.lm_head.weight.requires_grad_(True)
    return draft.to(dtype), ids, t2d


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(num_words=80, specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    """A word-level tokenizer with a ChatML template: ids 0.. are ``specials``, then words
    ``w0 w1 ...`` plus the words the template renders (``system user assistant``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["system", "user", "assistant"] + [f"w{i}" for i in range(num_words)]
    vocab = {tok: i for i, tok in enumerate([*specials, *words, "[UNK]"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="[UNK]",
    )
    tok.add_special_tokens({"additional_special_tokens": list(specials[3:])})
    tok.chat_template = CHATML
    return tok


def tiny_workdir(root, draft_vocab_size=40):
    """``root/target`` (tiny target, tokenizer, chat template) and ``root/data``: 16 samples
    of its own sampled replies to random prompts, in speculators' format. Returns ``root``."""
    import json

    from speculators_peagle_plugin.datagen.build_data import generate_data
    from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig

    target = tiny_target(root / "target")
    tiny_tokenizer().save_pretrained(target)
    gen = torch.Generator().manual_seed(0)
    with open(root / "prompts.jsonl", "w") as fh:
        for _ in range(16):
            n = int(torch.randint(3, 12, (1,), generator=gen))
            words = " ".join(f"w{int(i)}" for i in torch.randint(0, 80, (n,), generator=gen))
            fh.write(json.dumps({"prompt": words}) + "\n")
    generate_data(
        DataGenConfig.from_sources(
            target=target, prompts=str(root / "prompts.jsonl"), output=str(root / "data"),
            max_new_tokens=40, temperature=1.0, batch_size=8, target_layer_ids=(1, 2, 3),
            draft_vocab_size=draft_vocab_size,
        )
    )
    return root
