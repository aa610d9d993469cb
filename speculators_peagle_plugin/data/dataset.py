"""Training data in speculators' on-disk format: generate it with a local target, read and pack it.

On-disk layout (speculators 0.9.0, DESIGN §4), one directory ``DIR``:

    DIR/data-*.arrow, dataset_info.json, state.json  Arrow dataset (``save_to_disk``), a row per
                                                     target reply: input_ids, loss_mask, seq_len
    DIR/hidden_states/hs_<i>.safetensors             {"hidden_states": [seq, n_aux+1, H],
                                                      "token_ids": [seq]} for dataset row i
    DIR/token_freq.pt, d2t-<V>.npy, t2d-<V>.npy      draft vocabulary (d2t holds OFFSETS)
    DIR/generation_settings.json                     what generate-data was run with (this plugin)
    DIR/vllm.log                                     what vLLM printed (``--backend vllm``)

Legend: ``seq`` = tokens of one sample, ``H`` = target hidden size, ``n_aux`` = aux layers,
``S`` = tokens per packed row. Aux layer id ``L`` is the residual stream after ``L`` decoder
layers (transformers' ``hidden_states[L]``); the last slot is the final residual stream BEFORE
the final norm (transformers' ``hidden_states[-1]`` is after it, so it is captured with a hook).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.config import check_int_at_least
from ..model.build import DEFAULT_DRAFT_VOCAB_SIZE

__all__ = [
    "DataError",
    "DataGenConfig",
    "PackedBatches",
    "TrainingData",
    "capture_hidden_states",
    "default_target_layer_ids",
    "generate_data",
    "open_training_data",
    "pack_rows",
]

logger = logging.getLogger(__name__)

HIDDEN_STATES_DIR = "hidden_states"
SETTINGS_FILE = "generation_settings.json"
RESPONSES_DIR = "responses"  # regenerated rows per batch of prompts: generation resume state
TOKEN_FREQ_FILE = "token_freq.pt"
# generate-data refuses to resume into a directory made with other values of these.
_IDENTITY_KEYS = (
    "target", "prompts", "max_samples", "target_layer_ids", "max_new_tokens",
    "temperature", "top_p", "seed", "dtype", "backend", "num_samples",
)  # fmt: skip
BACKENDS = ("transformers", "vllm")
VLLM_BATCHES_PER_SHARD = 4
VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more
MIN_SHARED_PREFIX = 16  # tokens; shorter shared prefixes are recomputed per row
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DataError(ValueError):
    """Training data that cannot be used as it is; the message names the file or setting."""


def hs_path(hidden_states_dir: Path, index: int) -> Path:
    """Path of dataset row ``index``'s hidden states (speculators' ``FileTransfer`` naming)."""
    return Path(hidden_states_dir) / f"hs_{index}.safetensors"


def _tmp(path: Path) -> Path:
    # Suffix after ".safetensors": speculators' scanners only count names ending with it. The
    # pid keeps processes apart (every DDP rank may cache the same vocab mapping).
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def _mix_seed(*values: int) -> int:
    """One well-mixed 63-bit seed from several non-negative ints (e.g. seed, epoch)."""
    return int(np.random.SeedSequence(list(values)).generate_state(1, dtype=np.uint64)[0]) >> 1


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through ``write(tmp)`` and rename: readers never see a partial file."""
    tmp = _tmp(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _save_npy(path: Path, array: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:  # a file object: np.save would append ".npy" to a name
            np.save(fh, array)

    _atomic_write(path, write)


def _save_json(path: Path, obj, indent: int | None = 1) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=indent)))


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


def default_target_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 aux layers ``(2, N//2, N-3)``; e.g. 30 layers -> ``(2, 15, 27)``."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class DataGenConfig:
    """Settings of ``speculators-peagle generate-data`` (each default lives here).

    Args:
        target: local transformers model directory (weights, config, tokenizer, chat template).
        prompts: ``.jsonl`` of ``{"messages": [...]}`` / ``{"conversations": [...]}`` /
            ``{"prompt": "..."}`` rows, or a ``datasets`` dataset saved with ``save_to_disk``.
        output: directory for the speculators-format data (created; resumed if it exists).
        max_new_tokens: tokens generated per assistant turn.
        temperature: 0 = greedy; > 0 samples (with ``top_p``, no top-k).
        top_p: nucleus mass in (0, 1] when sampling.
        batch_size: conversations generated together (transformers: one left-padded batch,
            the unit of resume; vllm: requests in flight, resumed per 4 batches).
        num_samples: replies per prompt (> 1 needs ``temperature`` > 0): each is its own row.
        backend: what generates the replies. ``transformers`` (``generate``, batched);
            ``vllm``: vLLM in a child process, about 5x the tokens/s on a 2-core CPU
            (continuous batching, paged KV cache). Hidden states always come from
            transformers (rows sharing a prompt share its forward). vLLM samples from its
            engine seed (its CPU sampler has no per-request seed), so a resumed sampled run
            draws new replies for the shards it had not finished.
        kv_cache_gb: vLLM's CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``); None = vLLM's default.
        target_layer_ids: aux layer ids, each in [0, N); None = ``(2, N//2, N-3)``.
        draft_vocab_size: size of the ``d2t``/``t2d`` files written.
        max_samples: use only the first this many usable prompts.
        seed: seed of the sampled generation (per batch, so resumed runs agree).
        dtype: the target's compute dtype, also the stored hidden states' dtype.
        device: torch device of the target.
    """

    target: str
    prompts: str
    output: str
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 8
    num_samples: int = 1
    backend: str = "transformers"
    kv_cache_gb: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE
    max_samples: int | None = None
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "draft_vocab_size", "num_samples"):
            check_int_at_least(name, getattr(self, name), 1)
        if self.kv_cache_gb is not None:
            check_int_at_least("kv_cache_gb", self.kv_cache_gb, 1)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}.")
        if self.backend == "vllm" and self.temperature > VLLM_MAX_TEMPERATURE:
            raise ValueError(
                f"temperature {self.temperature} is above vLLM's limit; with --backend vllm "
                f"it must be in [0, {VLLM_MAX_TEMPERATURE}]."
            )
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(
                f"num_samples {self.num_samples} needs temperature > 0: greedy replies to the "
                "same prompt are identical."
            )
        check_int_at_least("seed", self.seed, 0)
        if self.max_samples is not None:
            check_int_at_least("max_samples", self.max_samples, 1)
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}.")
        if not (Path(self.target) / "config.json").is_file():
            raise ValueError(
                f"--target {self.target} is not a local transformers model directory "
                "(no config.json)."
            )
        if not Path(self.prompts).exists():
            raise ValueError(f"--prompts {self.prompts} does not exist.")


def _load_prompt_rows(path: Path) -> Iterator[dict]:
    if path.is_dir():
        from datasets import load_from_disk

        try:
            yield from load_from_disk(str(path))
        except FileNotFoundError as err:
            raise ValueError(
                f"--prompts {path} is a directory but not a dataset saved with save_to_disk."
            ) from err
        return
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"--prompts {path} line {number} is not valid JSON ({err})."
                ) from err
            if not isinstance(row, dict):
                raise ValueError(f"--prompts {path} line {number} is not a JSON object.")
            yield row


def load_prompts(path: str | Path, max_samples: int | None = None) -> list[list[dict]]:
    """The system/user turns of each usable prompt row, in file order.

    Reuses speculators' ``extract_conversation`` (``messages``/``conversations`` in role/content
    or from/value form, else a plain ``prompt``): recorded assistant turns are dropped, since the
    target regenerates them. Rows without a user turn are skipped.
    Example: ``{"prompt": "hi"}`` -> ``[[{"role": "user", "content": "hi"}]]``.
    """
    from speculators.cli.regenerate_responses import extract_conversation

    path = Path(path)
    prompts, skipped = [], 0
    for row in _load_prompt_rows(path):
        turns, _tool_results = extract_conversation(row, "prompt")
        if turns:
            prompts.append(turns)
        else:
            skipped += 1
        if max_samples is not None and len(prompts) == max_samples:
            break
    if skipped:
        logger.warning("Skipped %d prompt rows of %s that have no user turn.", skipped, path)
    if not prompts:
        raise ValueError(
            f"--prompts {path} holds no usable prompt (rows need messages/conversations with a "
            "user turn, or a prompt string)."
        )
    return prompts


@torch.no_grad()
def capture_hidden_states(
    model: torch.nn.Module, input_ids: torch.Tensor, layer_ids: tuple[int, ...], cache=None
):
    """One target forward over a sample; returns its speculators hidden states.

    Args:
        model: a transformers causal LM (its decoder must have a final ``norm``).
        input_ids: ``[seq]`` token ids.
        layer_ids: aux layer ids; ``L`` = residual stream after ``L`` decoder layers.
        cache: None, or a transformers ``DynamicCache`` holding a prefix: ``input_ids`` then
            continues it, the cache grows by them, and only their states are returned.

    Returns:
        ``[seq, len(layer_ids) + 1, H]``: ``hidden_states[L]`` for each aux id, then the final
        residual stream before the final norm. Example: 4 layers, ids (1, 2, 3) ->
        ``[seq, 4, H]`` = states after layers 1, 2, 3 and the input of ``norm`` (after 4).
    """
    decoder = model.get_decoder()
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise ValueError(
            f"{type(decoder).__name__} has no final `norm` module to capture the last hidden "
            "state before it."
        )
    captured = []
    handle = norm.register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    try:
        out = decoder(
            input_ids=input_ids[None], output_hidden_states=True,
            past_key_values=cache, use_cache=cache is not None,
        )  # fmt: skip
    finally:
        handle.remove()
    states = [out.hidden_states[layer][0] for layer in layer_ids] + [captured[-1][0]]
    return torch.stack(states, dim=1)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class _PrefixStates:
    """Hidden states of rows that start alike (the samples of one prompt, the turns of one
    conversation), computing their common prefix once and reusing its KV cache.

    The prefix is the longest one the current row shares with the next (at least
    ``MIN_SHARED_PREFIX`` tokens, and shorter than both); a row that does not start with the
    current prefix gets a plain forward. Same states as a full forward up to float rounding.
    """

    def __init__(self, model, layer_ids: tuple[int, ...]):
        self.model, self.layer_ids = model, layer_ids
        self.device = next(model.parameters()).device
        self.prefix: list[int] = []
        self.prefix_states = self.cache = None

    @torch.no_grad()
    def __call__(self, ids: list[int], next_ids: list[int] | None) -> torch.Tensor:
        from transformers import DynamicCache

        device = self.device
        p = len(self.prefix)
        if not (p and len(ids) > p and ids[:p] == self.prefix):
            shared = 0 if next_ids is None else _shared_prefix(ids, next_ids)
            shared = min(shared, len(ids) - 1, len(next_ids or ()) - 1)
            if shared < MIN_SHARED_PREFIX:
                self.prefix, self.prefix_states, self.cache = [], None, None
                return capture_hidden_states(
                    self.model, torch.tensor(ids, device=device), self.layer_ids
                )
            self.prefix, self.cache = ids[:shared], DynamicCache()
            self.prefix_states = capture_hidden_states(
                self.model, torch.tensor(self.prefix, device=device), self.layer_ids, self.cache
            )
            p = shared
        rest = capture_hidden_states(
            self.model, torch.tensor(ids[p:], device=device), self.layer_ids, self.cache
        )
        self.cache.crop(p)  # back to the prefix for the next row
        return torch.cat([self.prefix_states, rest])


class _Target:
    """The target model and tokenizer, with the two jobs generate-data runs on them."""

    def __init__(self, config: DataGenConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.target)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"The tokenizer of --target {config.target} has no chat template.")
        self.model = AutoModelForCausalLM.from_pretrained(
            config.target, dtype=_DTYPES[config.dtype]
        )
        self.model.to(config.device).eval()
        gen_eos = self.model.generation_config.eos_token_id
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        tok_eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        self.eos_ids = sorted(set(gen_eos) | set(tok_eos))
        if not self.eos_ids:
            raise ValueError(f"--target {config.target} defines no end-of-sequence token.")
        pad = self.tokenizer.pad_token_id
        self.pad_id = self.eos_ids[0] if pad is None else pad
        self.vllm = None  # a running VllmWorker while the vllm backend generates

    def prompt_ids(self, turns: list[dict]) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                turns, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )

    @contextmanager
    def generator(self, log_path: Path):
        """While open, :meth:`generate` runs on the configured backend (vLLM: a child process
        that is gone again when the block ends, so the hidden-state phase has the cores)."""
        if self.config.backend != "vllm":
            yield
            return
        from ..serving.vllm_client import VllmWorker

        # In process: the engine starts in seconds, and plain decoding (no draft) runs as fast
        # as with vLLM's separate engine process, which would also reserve a core for itself.
        with VllmWorker(log_path, in_process=True, kv_cache_gb=self.config.kv_cache_gb) as worker:
            self.vllm = worker
            try:
                yield
            finally:
                self.vllm = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Completions of a batch of prompts, each cut after its first EOS.

        ``seed`` seeds transformers' sampling; vLLM samples from its engine seed.
        """
        from transformers import GenerationConfig

        cfg = self.config
        if self.vllm is not None:
            job = {
                "target": str(Path(cfg.target).resolve()), "draft": None, "prompts": prompts,
                "max_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size,
                "dtype": cfg.dtype, "seed": cfg.seed, "temperature": cfg.temperature,
                "top_p": cfg.top_p, "prefix_caching": True,
            }  # fmt: skip
            outputs = self.vllm.run(job)["outputs"]
            return [completion_tokens(out, self.eos_ids) for out in outputs]
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sample = cfg.temperature > 0
        # An explicit config: the checkpoint's own defaults (often sampling, top-k 50) must not
        # leak in; top_k=0 leaves only temperature and top-p, as vLLM's defaults do.
        gen_config = GenerationConfig(
            max_new_tokens=cfg.max_new_tokens,
            do_sample=sample,
            temperature=cfg.temperature if sample else None,
            top_p=cfg.top_p if sample else None,
            top_k=0 if sample else None,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=ids.to(cfg.device),
            attention_mask=mask.to(cfg.device),
            generation_config=gen_config,
        )
        return [completion_tokens(row.tolist(), self.eos_ids) for row in out[:, width:].cpu()]

    def decode_reply(self, completion: list[int]) -> str:
        return self.tokenizer.decode(completion, skip_special_tokens=True)


def completion_tokens(generated: list[int], eos_ids: list[int]) -> list[int]:
    """Generated tokens up to and including the first EOS (what vLLM returns as token_ids).

    Example: eos 2, ``[5, 7, 2, 2, 2]`` (padded after the end) -> ``[5, 7, 2]``.
    """
    for i, token in enumerate(generated):
        if token in eos_ids:
            return generated[: i + 1]
    return generated


def _regenerate(target: _Target, conversations: list[list[dict]], seed: int):
    """Regenerate every assistant turn of a batch of conversations, turn by turn.

    Like speculators' ``regenerate-responses``: each user turn gets the target's reply to the
    conversation so far (with its own earlier replies), and each reply is one boundary row
    (speculators' ``build_boundary_sample``: loss_mask 0 on the prompt, 1 on the reply).
    Returns ``(rows, generated_tokens)``; ``rows[k]`` lists conversation k's rows.
    """
    from speculators.cli.regenerate_responses import build_boundary_sample

    rows: list[list[dict]] = [[] for _ in conversations]
    history: list[list[dict]] = [[] for _ in conversations]
    pending = [list(turns) for turns in conversations]
    generated, round_index = 0, 0
    while any(any(t["role"] == "user" for t in p) for p in pending):
        active, prompts = [], []
        for k, turns in enumerate(pending):
            users = [i for i, t in enumerate(turns) if t["role"] == "user"]
            if not users:
                continue
            history[k].extend(turns[: users[0] + 1])
            del turns[: users[0] + 1]
            active.append(k)
            prompts.append(target.prompt_ids(history[k]))
        replies = target.generate(prompts, _mix_seed(seed, round_index))
        for k, prompt, reply in zip(active, prompts, replies, strict=True):
            input_ids, loss_mask = build_boundary_sample(prompt, reply)
            rows[k].append({"input_ids": input_ids, "loss_mask": loss_mask})
            history[k].append({"role": "assistant", "content": target.decode_reply(reply)})
            generated += len(reply)
        round_index += 1
    return rows, generated


def _settings(config: DataGenConfig, model_config) -> dict:
    text_config = getattr(model_config, "text_config", model_config)
    num_layers = text_config.num_hidden_layers
    layer_ids = config.target_layer_ids or default_target_layer_ids(num_layers)
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad or not layer_ids:
        raise ValueError(
            f"--target-layer-ids must be integers in [0, {num_layers}) for this "
            f"{num_layers}-layer target, got {list(layer_ids)}."
        )
    if config.draft_vocab_size > text_config.vocab_size:
        raise ValueError(
            f"--draft-vocab-size {config.draft_vocab_size} exceeds the target's vocabulary "
            f"size {text_config.vocab_size}."
        )
    settings = asdict(config)
    settings.update(
        target=str(Path(config.target).resolve()),
        prompts=str(Path(config.prompts).resolve()),
        target_layer_ids=list(layer_ids),
        target_vocab_size=text_config.vocab_size,
        target_hidden_size=text_config.hidden_size,
        target_num_layers=num_layers,
    )
    for key in ("output", "batch_size", "draft_vocab_size", "device", "kv_cache_gb"):
        del settings[key]  # free to change between a run and its resume
    return settings


def _check_output(output: Path, settings: dict) -> bool:
    """Whether ``output`` is a resumable run of the same settings; raise if it is another's."""
    settings_path = output / SETTINGS_FILE
    if settings_path.exists():
        old = json.loads(settings_path.read_text())
        for key in _IDENTITY_KEYS:
            if old.get(key) != settings[key]:
                raise ValueError(
                    f"--output {output} was made with different settings ({key}: "
                    f"{old.get(key)!r} there, {settings[key]!r} now); use a new --output "
                    "directory or the original settings to resume."
                )
        return True
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(
            f"--output {output} is not an empty directory and was not made by generate-data "
            f"(no {SETTINGS_FILE}); choose a new or empty directory."
        )
    return False


def _remove_stale_temporaries(output: Path) -> None:
    for directory in (output, output / HIDDEN_STATES_DIR, output / RESPONSES_DIR):
        if directory.is_dir():
            for tmp in directory.glob("*.tmp"):
                tmp.unlink()
    shutil.rmtree(output / ".dataset.tmp", ignore_errors=True)


def _done_shards(responses: Path) -> dict[int, list[dict]]:
    """Rows of every prompt already regenerated (one JSON shard per finished batch)."""
    done: dict[int, list[dict]] = {}
    for shard in sorted(responses.glob("*.json")):
        try:
            done.update({int(k): v for k, v in json.loads(shard.read_text()).items()})
        except (ValueError, AttributeError):  # unreadable: written by hand or damaged
            shard.unlink()
    return done


def _generate_responses(target: _Target, prompts: list[list[dict]], output: Path) -> list[dict]:
    """Phase 1: the target's replies to every prompt; resumable per batch. Rows in prompt order.

    With ``num_samples`` n, prompt i is conversation ``i // n`` (its ``i % n``-th sample).
    """
    from tqdm import tqdm

    cfg = target.config
    prompts = [turns for turns in prompts for _ in range(cfg.num_samples)]
    responses = output / RESPONSES_DIR
    responses.mkdir(exist_ok=True)
    done = _done_shards(responses)
    todo = [i for i in range(len(prompts)) if i not in done]
    # vLLM keeps batch_size requests in flight over a whole shard (continuous batching), so a
    # shard of several batches wastes less time on the tail of its longest replies.
    shard_size = cfg.batch_size * (VLLM_BATCHES_PER_SHARD if cfg.backend == "vllm" else 1)
    start, tokens = time.perf_counter(), 0
    with (
        target.generator(output / "vllm.log") if todo else nullcontext(),
        tqdm(total=len(prompts), initial=len(done), unit="reply", desc="Generating") as bar,
    ):
        for b in range(0, len(todo), shard_size):
            batch = todo[b : b + shard_size]
            rows, generated = _regenerate(
                target, [prompts[i] for i in batch], _mix_seed(cfg.seed, batch[0])
            )
            shard = {str(i): r for i, r in zip(batch, rows, strict=True)}
            _save_json(responses / f"{batch[0]:09d}-{batch[-1]:09d}.json", shard, indent=None)
            done.update({i: r for i, r in zip(batch, rows, strict=True)})
            tokens += generated
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
    if todo:
        elapsed = time.perf_counter() - start
        logger.info(
            "Generated %d reply tokens for %d replies in %.1f s (%.1f tokens/s).",
            tokens, len(todo), elapsed, tokens / elapsed,
        )  # fmt: skip
    return [row for i in range(len(prompts)) for row in done[i]]


def _write_dataset(rows: list[dict], output: Path, tokenizer) -> None:
    """Phase 2: the Arrow dataset (speculators' own pass-through preprocessing) + token_freq.pt."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    raw = Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows]}
    )
    longest = max(len(r["input_ids"]) for r in rows)
    dataset = build_speculator_training_dataset(raw, tokenizer, max_length=longest, num_proc=1)
    if len(dataset) == 0:
        raise ValueError("No regenerated conversation has a supervised token; nothing to write.")
    staging = output / ".dataset.tmp"
    dataset.save_to_disk(str(staging))
    # state.json last: load_from_disk needs it, so a run killed mid-move rebuilds the dataset.
    for name in sorted(os.listdir(staging), key=lambda n: n == "state.json"):
        os.replace(staging / name, output / name)
    staging.rmdir()
    _atomic_write(
        output / TOKEN_FREQ_FILE,
        lambda tmp: save_token_frequency_distribution(dataset, output_path=tmp),
    )


def _hs_file_problem(path: Path, input_ids: list[int], shape_tail: tuple[int, int]) -> str | None:
    """Cheap completeness check of a written file (header, shape, token ids); None if fine."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            if {"hidden_states", "token_ids"} - set(fh.keys()):
                return "lacks a tensor"
            shape = fh.get_slice("hidden_states").get_shape()
            token_ids = fh.get_tensor("token_ids").tolist()
    except Exception as err:  # noqa: BLE001 - any unreadable file is regenerated
        return f"unreadable ({err})"
    if token_ids != input_ids or list(shape) != [len(input_ids), *shape_tail]:
        return "of the wrong shape or tokens"
    return None


def _save_safetensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    path.chmod(0o644)  # safetensors creates 0600 files; data directories are often shared


def _write_hidden_states(target: _Target, output: Path, layer_ids: tuple[int, ...]) -> int:
    """Phase 3: hidden states of each dataset row without a valid ``hs_<i>.safetensors``
    (rows that start alike share their prefix's forward: :class:`_PrefixStates`)."""
    from datasets import load_from_disk
    from speculators.data_generation.offline import get_existing_hidden_state_indices
    from tqdm import tqdm

    dataset = load_from_disk(str(output)).with_format(None)
    hs_dir = output / HIDDEN_STATES_DIR
    hs_dir.mkdir(exist_ok=True)
    existing = set(get_existing_hidden_state_indices(hs_dir))
    shape_tail = (len(layer_ids) + 1, target.model.config.get_text_config().hidden_size)
    todo = []
    for i in range(len(dataset)):
        if i in existing:
            problem = _hs_file_problem(hs_path(hs_dir, i), dataset[i]["input_ids"], shape_tail)
            if problem is None:
                continue
            logger.warning("Regenerating %s: %s.", hs_path(hs_dir, i), problem)
        todo.append(i)
    start, tokens = time.perf_counter(), 0
    states_of = _PrefixStates(target.model, layer_ids)
    with tqdm(
        total=len(dataset), initial=len(dataset) - len(todo), unit="sample", desc="Hidden states"
    ) as bar:
        rows = (dataset[i]["input_ids"] for i in todo)
        following = next(rows, None)
        for i in todo:
            row, following = following, next(rows, None)  # the next row: a shared prefix?
            states = states_of(row, following)
            ids = torch.tensor(row, dtype=torch.long)
            tensors = {"hidden_states": states.cpu().contiguous(), "token_ids": ids}
            _atomic_write(hs_path(hs_dir, i), lambda tmp, t=tensors: _save_safetensors(t, tmp))
            tokens += len(ids)
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
    if todo:
        elapsed = time.perf_counter() - start
        logger.info(
            "Captured hidden states of %d samples (%d tokens) in %.1f s (%.1f tokens/s).",
            len(todo), tokens, elapsed, tokens / elapsed,
        )  # fmt: skip
    return len(todo)


def generate_data(config: DataGenConfig) -> TrainingData:
    """Regenerate the prompts' replies with the target and write speculators-format data.

    Three resumable phases: replies (one JSON shard per batch), the Arrow dataset and
    ``token_freq.pt``, then one hidden-state file per row; finally ``d2t``/``t2d`` for
    ``config.draft_vocab_size``. Re-running skips what is complete and valid; every file is
    written under a temporary name and renamed. Returns the opened data.
    """
    from transformers import AutoConfig

    output = Path(config.output)
    # Everything that can reject the input runs before the output directory is touched.
    settings = _settings(config, AutoConfig.from_pretrained(config.target))
    resuming = _check_output(output, settings)
    prompts = load_prompts(config.prompts, config.max_samples)
    target = _Target(config)
    if not resuming:
        output.mkdir(parents=True, exist_ok=True)
        _save_json(output / SETTINGS_FILE, settings)
    _remove_stale_temporaries(output)
    if not ((output / "state.json").exists() and (output / TOKEN_FREQ_FILE).exists()):
        rows = _generate_responses(target, prompts, output)
        _write_dataset(rows, output, target.tokenizer)
    shutil.rmtree(output / RESPONSES_DIR, ignore_errors=True)
    layer_ids = tuple(settings["target_layer_ids"])
    _write_hidden_states(target, output, layer_ids)
    data = open_training_data(output, num_aux_layers=len(layer_ids))
    data.vocab_mapping(config.draft_vocab_size)
    return data


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def _sample_problem(loaded: dict, input_ids: torch.Tensor, shape_tail: tuple[int, int]) -> str:
    """What is wrong with a loaded hidden-state sample, or "" if nothing.

    Our own checks rather than speculators' ``check_hidden_states``: its messages print the
    whole token list, and it does not check the ``[n_aux+1, H]`` tail against the data set.
    """
    if {"hidden_states", "token_ids"} - loaded.keys():
        return f"lacks {sorted({'hidden_states', 'token_ids'} - loaded.keys())}"
    hidden, tokens = loaded["hidden_states"], loaded["token_ids"]
    n = input_ids.shape[0]
    if tokens.dim() != 1 or tokens.shape[0] != n:
        return f"holds {tokens.numel()} token ids but its dataset row has {n} tokens"
    if not torch.equal(tokens.long(), input_ids.long()):
        return "holds token ids that differ from its dataset row"
    if tuple(hidden.shape) != (n, *shape_tail):
        return (
            f"holds hidden_states of shape {list(hidden.shape)} but {[n, *shape_tail]} is expected"
        )
    # min/max propagate NaN and expose inf: 5x cheaper than isfinite(hidden).all() here.
    if not bool(torch.isfinite(torch.stack(torch.aminmax(hidden))).all()):
        return "contains non-finite hidden states (NaN or inf)"
    return ""


def _checked_arrow_dataset_class():
    from speculators.train.data import ArrowDataset

    class CheckedArrowDataset(ArrowDataset):
        """speculators' ``ArrowDataset`` (on_missing="raise") whose bad files raise DataError.

        Upstream turns a token mismatch into a skipped sample with a warning and lets a corrupt
        file raise safetensors' own error; training must stop instead, naming the file.
        """

        shape_tail: tuple[int, int]

        def _get_raw_data(self, index: int) -> dict:
            file_idx = self._map_to_file_idx(index)
            path = hs_path(self.transfer.hidden_states_path, file_idx)
            try:
                loaded = self.transfer.get_cached(file_idx)
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                msg = f"Hidden-state file {path} is corrupt or truncated ({err})."
                raise DataError(msg) from err
            if loaded is None:
                raise DataError(f"Hidden-state file {path} is missing.")
            row = self.data[index]
            problem = _sample_problem(loaded, row["input_ids"], self.shape_tail)
            if problem:
                raise DataError(f"Hidden-state file {path} {problem}.")
            hidden = loaded["hidden_states"]
            return {
                "hidden_states": hidden[:, :-1].flatten(1),  # [seq, n_aux * H]
                "input_ids": row["input_ids"],  # [seq]
                "verifier_last_hidden_states": hidden[:, -1],  # [seq, H]
                "loss_mask": row["loss_mask"],  # [seq]
            }

    return CheckedArrowDataset


@dataclass
class TrainingData:
    """An opened, checked speculators data directory.

    Attributes:
        path: the directory.
        dataset: speculators' ``ArrowDataset`` (a checked subclass); ``dataset[i]`` is the
            sample dict speculators' ``CollateFn`` packs; a bad file raises :class:`DataError`.
        hidden_size: target hidden size ``H``.
        num_aux_layers: aux layers per token (the files hold ``n_aux + 1`` slots).
        num_samples: dataset rows.
        num_loss_tokens: supervised tokens over all rows.
        lengths: ``seq_len`` of each row.
        settings: generate-data's settings, or None for data made by speculators itself.
    """

    path: Path
    dataset: object
    hidden_size: int
    num_aux_layers: int
    num_samples: int
    num_loss_tokens: int
    lengths: list[int]
    settings: dict | None

    @property
    def hidden_states_dir(self) -> Path:
        return self.path / HIDDEN_STATES_DIR

    @property
    def target_layer_ids(self) -> tuple[int, ...] | None:
        """The aux layer ids the data was generated with (None if unrecorded)."""
        return None if self.settings is None else tuple(self.settings["target_layer_ids"])

    def validate(self, progress: bool = True) -> None:
        """Load and check every hidden-state file; the first bad one raises DataError."""
        from tqdm import tqdm

        for i in tqdm(
            range(self.num_samples), desc="Checking data", unit="sample", disable=not progress
        ):
            self.dataset[i]

    def check_vocab_mapping(self, draft_vocab_size: int) -> None:
        """Raise DataError unless :meth:`vocab_mapping` can give this size (builds nothing)."""
        check_int_at_least("draft_vocab_size", draft_vocab_size, 1)
        d2t_path = self.path / f"d2t-{draft_vocab_size}.npy"
        if d2t_path.exists() and d2t_path.with_name(f"t2d-{draft_vocab_size}.npy").exists():
            self.vocab_mapping(draft_vocab_size)  # loads and checks the two files
        elif not (self.path / TOKEN_FREQ_FILE).exists():
            raise DataError(
                f"{self.path} has neither d2t-{draft_vocab_size}.npy/t2d-{draft_vocab_size}.npy "
                f"nor {TOKEN_FREQ_FILE} to build a {draft_vocab_size}-token draft vocabulary from."
            )

    def vocab_mapping(
        self, draft_vocab_size: int, target_vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(d2t, t2d)`` for a draft vocabulary of ``draft_vocab_size`` tokens.

        Loads ``d2t-<V>.npy``/``t2d-<V>.npy``; when missing, builds them from ``token_freq.pt``
        with speculators' ``build_vocab_mappings_from_distribution`` (most frequent supervised
        tokens) and caches them, as ``speculators train`` does. ``d2t: [V]`` int64 OFFSETS
        (``target_id = draft_id + d2t[draft_id]``), ``t2d: [target_vocab]`` bool.
        ``target_vocab_size`` is needed only to build, when the data does not record it.
        Example: draft ids -> target ids [0, 3, 4] gives d2t [0, 2, 2].
        """
        check_int_at_least("draft_vocab_size", draft_vocab_size, 1)
        d2t_path = self.path / f"d2t-{draft_vocab_size}.npy"
        t2d_path = self.path / f"t2d-{draft_vocab_size}.npy"
        if d2t_path.exists() and t2d_path.exists():
            try:
                d2t = torch.from_numpy(np.load(d2t_path))
                t2d = torch.from_numpy(np.load(t2d_path))
            except (OSError, ValueError) as err:
                msg = f"Vocab mapping {d2t_path} or {t2d_path} is unreadable ({err})."
                raise DataError(msg) from err
            _check_vocab_mapping(d2t, t2d, draft_vocab_size, d2t_path)
            return d2t, t2d
        from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

        freq_path = self.path / TOKEN_FREQ_FILE
        if not freq_path.exists():
            raise DataError(
                f"{self.path} has neither {d2t_path.name}/{t2d_path.name} nor {TOKEN_FREQ_FILE} "
                f"to build a {draft_vocab_size}-token draft vocabulary from."
            )
        target_vocab_size = target_vocab_size or self._recorded_target_vocab_size()
        if target_vocab_size is None:
            raise DataError(
                f"Building {d2t_path.name} from {freq_path} needs the target's vocabulary size, "
                "which this data does not record; pass target_vocab_size."
            )
        if draft_vocab_size > target_vocab_size:
            raise DataError(
                f"draft_vocab_size {draft_vocab_size} exceeds the target's vocabulary size "
                f"{target_vocab_size}."
            )
        freq = torch.load(freq_path, weights_only=True)
        d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size, target_vocab_size)
        _save_npy(d2t_path, d2t.numpy())
        _save_npy(t2d_path, t2d.numpy())
        return d2t, t2d

    def _recorded_target_vocab_size(self) -> int | None:
        if self.settings is not None:
            return self.settings["target_vocab_size"]
        for t2d_path in sorted(self.path.glob("t2d-*.npy")):
            return int(np.load(t2d_path, mmap_mode="r").shape[0])
        return None


def _check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, size: int, path: Path) -> None:
    ok = d2t.shape == (size,) and t2d.dim() == 1 and t2d.dtype == torch.bool
    if ok:
        target_ids = torch.arange(size) + d2t
        ok = int(t2d.sum()) == size and bool(
            ((target_ids >= 0) & (target_ids < t2d.shape[0])).all()
        )
        ok = ok and bool(t2d[target_ids].all())
    if not ok:
        raise DataError(
            f"Vocab mapping {path} and its t2d file do not describe a {size}-token draft "
            "vocabulary (d2t offsets must select exactly the ids t2d marks)."
        )


def _hidden_states_shape(path: Path) -> list[int]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_slice("hidden_states").get_shape()
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise DataError(f"Hidden-state file {path} is corrupt or truncated ({err}).") from err


def open_training_data(
    data_path: str | os.PathLike,
    *,
    draft_vocab_size: int | None = None,
    verifier_hidden_size: int | None = None,
    num_aux_layers: int | None = None,
) -> TrainingData:
    """Open a speculators data directory for training, checking what can be checked cheaply.

    Works unchanged on data from ``speculators prepare-data`` + vLLM hidden states and on
    ``generate-data``'s output. Checks: the dataset exists and is non-empty with consistent
    columns, every row has its ``hs_<i>.safetensors``, the files' hidden size and aux-layer count
    match ``verifier_hidden_size`` / ``num_aux_layers``, and a ``draft_vocab_size`` mapping is
    available. Contents of each file are checked when it is loaded (or by ``validate()``).

    Raises:
        DataError: one sentence naming the path, file or setting that is wrong.
    """
    import pyarrow.compute as pc
    from datasets import load_from_disk

    path = Path(data_path)
    if not str(data_path) or not path.is_dir():
        raise DataError(f"Data path {str(data_path)!r} is not an existing directory.")
    try:
        raw = load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DataError(
            f"Data path {path} holds no dataset saved with save_to_disk (make one with "
            "`speculators-peagle generate-data` or `speculators prepare-data`)."
        ) from err
    except Exception as err:  # noqa: BLE001 - datasets fails on a 0-shard (empty) dataset
        state = json.loads((path / "state.json").read_text())
        if not state.get("_data_files"):
            raise DataError(f"The dataset at {path} is empty.") from err
        raise DataError(f"The dataset at {path} is unreadable ({err}).") from err
    missing = {"input_ids", "loss_mask", "seq_len"} - set(raw.column_names)
    if missing:
        raise DataError(f"The dataset at {path} lacks the column(s) {sorted(missing)}.")
    if len(raw) == 0:
        raise DataError(f"The dataset at {path} is empty.")
    table = raw.with_format("arrow")[:]
    n_ids = pc.list_value_length(table["input_ids"]).to_numpy()
    n_mask = pc.list_value_length(table["loss_mask"]).to_numpy()
    lengths = table["seq_len"].to_numpy()
    bad = np.flatnonzero((n_ids != n_mask) | (n_ids != lengths))
    if len(bad):
        i = int(bad[0])
        raise DataError(
            f"Row {i} of the dataset at {path} has {n_ids[i]} input_ids, {n_mask[i]} loss_mask "
            f"entries and seq_len {lengths[i]}; they must agree."
        )
    num_loss_tokens = int(pc.sum(pc.list_flatten(table["loss_mask"])).as_py() or 0)

    hs_dir = path / HIDDEN_STATES_DIR
    present = set(os.listdir(hs_dir)) if hs_dir.is_dir() else set()
    absent = [i for i in range(len(raw)) if hs_path(hs_dir, i).name not in present]
    if absent:
        raise DataError(
            f"{hs_dir} lacks the hidden states of {len(absent)} of {len(raw)} rows (first: "
            f"{hs_path(hs_dir, absent[0]).name}); run generate-data again to complete it."
        )
    shape = _hidden_states_shape(hs_path(hs_dir, 0))
    if len(shape) != 3 or shape[1] < 2:
        raise DataError(
            f"Hidden-state file {hs_path(hs_dir, 0)} holds hidden_states of shape {shape}, not "
            "[seq, n_aux + 1, hidden_size]."
        )
    hidden_size, n_aux = shape[2], shape[1] - 1
    if verifier_hidden_size is not None and verifier_hidden_size != hidden_size:
        raise DataError(
            f"The data at {path} holds hidden states of size {hidden_size} "
            f"({hs_path(hs_dir, 0).name}) but the verifier's hidden size is "
            f"{verifier_hidden_size}; generate the data with this verifier."
        )
    if num_aux_layers is not None and num_aux_layers != n_aux:
        raise DataError(
            f"The data at {path} holds {n_aux} aux hidden states per token "
            f"({hs_path(hs_dir, 0).name}) but {num_aux_layers} target layer ids are configured."
        )

    from hs_connectors.transfer import FP8Transfer

    dataset = _checked_arrow_dataset_class()(
        max_len=int(lengths.max()),
        datapath=str(path),
        # FP8Transfer reads plain files unchanged and dequantizes vLLM's FP8-connector files.
        transfer=FP8Transfer(hs_dir, dequantize_dtype=torch.float32),
        on_missing="raise",
    )
    dataset.shape_tail = (n_aux + 1, hidden_size)
    settings_path = path / SETTINGS_FILE
    data = TrainingData(
        path=path,
        dataset=dataset,
        hidden_size=hidden_size,
        num_aux_layers=n_aux,
        num_samples=len(raw),
        num_loss_tokens=num_loss_tokens,
        lengths=[int(x) for x in lengths],
        settings=json.loads(settings_path.read_text()) if settings_path.exists() else None,
    )
    if draft_vocab_size is not None:
        data.check_vocab_mapping(draft_vocab_size)
    return data


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def pack_rows(lengths: list[int], capacity: int, order: list[int]) -> list[list[int]]:
    """Greedy best-fit-decreasing packing of samples into rows of ``capacity`` tokens.

    Samples are taken longest first (a stable sort of ``order``, so equal lengths keep
    ``order``'s shuffle) and each goes to the fullest row it fits in, else a new row. A sample
    longer than ``capacity`` fills a row alone (speculators truncates it). The number of rows
    depends only on the lengths, never on ``order``: every epoch has the same number of steps.
    Example: lengths [5, 3, 4, 2], capacity 8, order [0, 1, 2, 3] -> [[0, 1], [2, 3]].
    """
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(order, key=lambda i: -min(lengths[i], capacity)):
        need = min(lengths[i], capacity)
        k = bisect.bisect_left(free, (need, -1))
        if k == len(free):
            rows.append([i])
            room, row = capacity - need, len(rows) - 1
        else:
            room, row = free.pop(k)
            rows[row].append(i)
            room -= need
        if room > 0:
            bisect.insort(free, (room, row))
    return rows


class PackedBatches:
    """Deterministic, addressable packed rows: ``batch(epoch, step)`` is this rank's row.

    Each epoch shuffles the samples with a generator seeded from ``(seed, epoch)``, packs them
    into rows of ``total_seq_len`` tokens (:func:`pack_rows`), and shuffles the rows. Global
    step ``g`` gives rank ``r`` row ``g * world_size + r``; on the last step a rank past the end
    gets an all-padding row (loss_mask 0, document_ids -1). Every sample appears once per epoch
    across all ranks, and the same ``(epoch, step)`` always gives the same rows, so resuming
    needs only ``(epoch, step)``.

    Args:
        training_data: from :func:`open_training_data`.
        total_seq_len: ``S``, tokens per row.
        seed: data-order seed (>= 0), the same on every rank.
        rank, world_size: this process and the number of data-parallel processes.
        shuffle: False keeps dataset order (rows still packed longest first).
        hidden_states_dtype: dtype of both hidden-state tensors.

    ``batch()`` returns speculators' packed batch (built by its ``CollateFn``):
    ``input_ids [1, S]``, ``hidden_states [1, S, n_aux*H]``, ``verifier_last_hidden_states
    [1, S, H]``, ``loss_mask [1, S]`` (int64), ``position_ids [1, S]``, ``document_ids [1, S]``
    (-1 for padding) and ``lengths [n_docs]``.
    Example: lengths [5, 3, 4, 2], S 8, world_size 2 -> one step; each rank gets one row.
    """

    def __init__(
        self,
        training_data: TrainingData,
        total_seq_len: int,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        hidden_states_dtype: torch.dtype = torch.float32,
    ):
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.data import CollateFn

        check_int_at_least("total_seq_len", total_seq_len, 1)
        check_int_at_least("seed", seed, 0)
        check_int_at_least("world_size", world_size, 1)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}.")
        self.data = training_data
        self.total_seq_len = total_seq_len
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        # shift_batch (what `speculators train` applies for eagle3 and peagle): slot t
        # carries (token t+1, aux states t) and is supervised by the target at t+1, as
        # vLLM drafts: each sample loses its first token.
        self._collate = CollateFn(
            total_seq_len,
            training_data.hidden_size,
            num_target_layers=training_data.num_aux_layers,
            dtype=hidden_states_dtype,
            preprocess=shift_batch,
        )
        self._cache: tuple[int, list[list[int]]] = (-1, [])
        self.num_rows = len(self.rows(0))

    def __len__(self) -> int:
        return math.ceil(self.num_rows / self.world_size)

    def rows(self, epoch: int) -> list[list[int]]:
        """Sample indices of every packed row of ``epoch``, in global row order."""
        if self._cache[0] == epoch:
            return self._cache[1]
        n, lengths, capacity = self.data.num_samples, self.data.lengths, self.total_seq_len
        if self.shuffle:
            gen = torch.Generator().manual_seed(_mix_seed(self.seed, epoch))
            rows = pack_rows(lengths, capacity, torch.randperm(n, generator=gen).tolist())
            rows = [rows[j] for j in torch.randperm(len(rows), generator=gen).tolist()]
        else:
            rows = pack_rows(lengths, capacity, list(range(n)))
        self._cache = (epoch, rows)
        return rows

    def step_samples(self, epoch: int, step: int, rank: int | None = None) -> list[int]:
        """Sample indices in ``rank``'s (default: this rank's) row of global step ``step``."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} is outside this epoch's {len(self)} steps.")
        row = step * self.world_size + (self.rank if rank is None else rank)
        rows = self.rows(epoch)
        return rows[row] if row < len(rows) else []

    def batch(self, epoch: int, step: int) -> dict:
        """This rank's packed row of global step ``step`` of ``epoch``."""
        return self._collate_row(self.step_samples(epoch, step))

    def global_rows(self, epoch: int, step: int) -> list[dict]:
        """All ``world_size`` rows of global step ``step``, in rank order."""
        ranks = range(self.world_size)
        return [self._collate_row(self.step_samples(epoch, step, r)) for r in ranks]

    def _collate_row(self, samples: list[int]) -> dict:
        batch = self._collate([self.data.dataset[i] for i in samples])
        docs = batch["document_ids"]
        out = {key: batch[key] for key in (
            "input_ids", "hidden_states", "verifier_last_hidden_states", "position_ids",
        )}  # fmt: skip
        # CollateFn's empty-row placeholder has a bool loss_mask; real rows are int64.
        out["loss_mask"] = batch["loss_mask"].long()
        out["document_ids"] = docs
        out["lengths"] = torch.bincount(docs[docs >= 0], minlength=len(samples))
        return out
