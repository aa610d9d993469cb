"""The tiny chat target of the generate-data tests, its prompt rows and command line."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB, HIDDEN, LAYERS, LAYER_IDS, MAX_NEW = 320, 64, 4, (1, 2, 3), 6

# Expected regeneration turns per usable row (assistant turns dropped, from/value mapped).
PROMPT_ROWS = [
    ({"prompt": "hello world"}, [[{"role": "user", "content": "hello world"}]]),
    (
        {
            "messages": [
                {"role": "system", "content": "be kind"},
                {"role": "user", "content": "how are you"},
                {"role": "assistant", "content": "recorded reply, ignored"},
                {"role": "user", "content": "the quick fox"},
            ]
        },
        [
            [{"role": "system", "content": "be kind"}, {"role": "user", "content": "how are you"}],
            [{"role": "user", "content": "the quick fox"}],
        ],
    ),
    (
        {"conversations": [{"from": "human", "value": "quick brown"},
                           {"from": "gpt", "value": "x"}]},
        [[{"role": "user", "content": "quick brown"}]],
    ),
    ({"no_prompt_here": 1}, None),
    ({"prompt": "fox, how are you?"}, [[{"role": "user", "content": "fox, how are you?"}]]),
    ({"prompt": "are"}, [[{"role": "user", "content": "are"}]]),
]


def tiny_chat_target(path: Path, seed: int = 0, chat_template: bool = True) -> Path:
    """A 4-layer random llama with a small byte-level BPE tokenizer and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["hello world, how are you?", "the quick brown fox"] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML if chat_template else None,
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=LAYERS, vocab_size=VOCAB, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_prompt_rows(path: Path) -> Path:
    """``PROMPT_ROWS``' rows as a prompts file, one JSON object a line."""
    path.write_text("\n".join(json.dumps(row) for row, _ in PROMPT_ROWS) + "\n")
    return path


def gen_args(target, prompts, output, *extra):
    return [
        "generate-data", "--target", str(target), "--prompts", str(prompts), "--output",
        str(output), "--max-new-tokens", str(MAX_NEW), "--batch-size", "3",
        "--target-layer-ids", ",".join(map(str, LAYER_IDS)), "--draft-vocab-size", "40", *extra,
    ]
