"""The settings of ``generate-data`` (:class:`DataGenConfig`, with its ``replies`` section,
:class:`ReplyConfig`, which online training and the demo compose too) and its generators'
constants.

The directory it writes is :mod:`..data.layout`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..common.devices import checked_device
from ..common.dtypes import DTYPE_NAMES
from ..common.errors import UserError
from ..common.settings import (
    Settings,
    check_choices,
    check_int_at_least,
    check_optional_ints,
    section,
    setting,
)
from ..data.prompts import prompt_source_exists
from ..data.storage import FLOAT8
from ..engine.engine_config import EngineConfig
from ..model.build import DEFAULT_DRAFT_VOCAB_SIZE
from .shard_plan import WHOLE, Shard

BACKENDS = ("transformers", "vllm")
# what computes the hidden states: a pass over the rows (a backend), or the replies' engine
STATE_SOURCES = (*BACKENDS, "generation")
STORAGE_DTYPES = ("target", FLOAT8)  # float8: hs_connectors' 8-bit format (data/storage.py)
# The resume unit of vLLM generation (and of the vLLM capture pass): batch_size x this many
# replies per shard file.
VLLM_BATCHES_PER_SHARD = 4
# Shards per vLLM job: the engine keeps batch_size requests in flight across a job, and only
# its end waits for the longest replies with the engine part empty (the job's prompts travel
# to the worker as one message, which bounds it).
VLLM_SHARDS_PER_JOB = 16
VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more


@dataclass(frozen=True)
class ReplyConfig:
    """The target's replies to the prompts (the ``replies`` section; each default lives here).

    Args:
        max_new_tokens: tokens generated per assistant turn.
        temperature: 0 = greedy; > 0 samples (with ``top_p``, no top-k).
        top_p: nucleus mass in (0, 1] when sampling.
        batch_size: conversations generated together (transformers: one left-padded batch,
            the unit of resume; vllm: requests in flight, resumed per
            ``VLLM_BATCHES_PER_SHARD`` batches, ``VLLM_SHARDS_PER_JOB`` shards per job).
        num_samples: replies per prompt (> 1 needs ``temperature`` > 0): each is its own row.
        backend: what generates the replies. ``transformers`` (``generate``, batched);
            ``vllm``: vLLM in a child process, faster on CPU (continuous batching, paged KV
            cache). vLLM samples each reply with its own seed (the generation's seed, the
            prompt's index and the turn), so its replies do not depend on ``batch_size``, and
            a resumed run draws the replies an uninterrupted one would (up to the rounding of
            batched arithmetic).
    """

    max_new_tokens: int = setting(256, "Tokens per reply.")
    temperature: float = setting(0.0, "The replies' sampling temperature; 0 = greedy.")
    top_p: float = setting(1.0, "Nucleus mass when sampling.")
    batch_size: int = setting(8, "Prompts generated together.", resumable=True)
    num_samples: int = setting(1, "Replies per prompt (> 1 needs --temperature > 0).")
    backend: str = setting(
        "transformers",
        "What generates the replies (vllm: continuous batching).",
        choices=BACKENDS,
    )

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("max_new_tokens", "batch_size", "num_samples"):
            check_int_at_least(name, getattr(self, name), 1)
        if not self.temperature >= 0:
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.backend == "vllm" and self.temperature > VLLM_MAX_TEMPERATURE:
            raise UserError(
                f"temperature {self.temperature} is above vLLM's limit; with --backend vllm "
                f"it must be in [0, {VLLM_MAX_TEMPERATURE}]."
            )
        if self.num_samples > 1 and self.temperature == 0:
            raise UserError(
                f"num_samples {self.num_samples} needs temperature > 0: greedy replies to the "
                "same prompt are identical."
            )


@dataclass(frozen=True)
class DataGenConfig(Settings):
    """Settings of ``speculators-peagle generate-data`` (each default lives here).

    Args:
        target: local transformers model directory (weights, config, tokenizer, chat template).
        prompts: a prompt-set spec as ``eval --prompts`` takes it (``humaneval``, ``chat``,
            ``sharegpt``, ``sharegpt_turns``, ``mbpp``, ..., a ``.jsonl`` file or a dataset
            saved with ``save_to_disk``, optionally ``[start:stop]``, or a ``+`` mix of those);
            rows as :func:`~..data.prompts.load_prompts` reads them.
        output: directory for the speculators-format data (created; resumed if it exists).
        replies: the replies' settings (:class:`ReplyConfig`).
        hidden_states_from: what computes the hidden states: ``vllm`` (a prefill of each row
            through vLLM's ``extract_hidden_states`` method; where vLLM cannot, the
            transformers pass runs instead and the log says why), ``transformers`` (one
            forward per row, rows sharing a prompt share its forward) or ``generation``
            (``--backend vllm`` only: the replies' engine records the states of every token
            it computes, :mod:`.vllm_recorder`, so no second pass runs; a reply's last token
            is never fed back, so it has no state and its row no loss on it, a target
            distribution after the reply that serving never asks for; rows it could not
            record go to the ``vllm`` pass). None = ``generation`` with the ``vllm``
            backend (the fastest at the same draft quality: `generate-data --hidden-states-from`),
            ``transformers`` with the ``transformers`` backend.
        hidden_states_dtype: ``target`` stores them in ``dtype``; ``float8`` in hs_connectors'
            8-bit format (float8_e4m3fn, one float32 scale per token), read back dequantized.
        tensor_parallel_size: vLLM's tensor parallel size (GPUs per engine).
        data_parallel_size: replicas of the whole generation on this machine, each a process
            of its own making a part of the conversations (:mod:`.shard_plan`), joined into
            ``output`` when all are done (:mod:`.replicas`): on CUDA each gets
            ``tensor_parallel_size`` GPUs of its own; on CPU each its share of the cores.
        shard: ``"I/N"``: make only part ``I`` (from 0) of ``N`` of the data, for the same
            command run on ``N`` machines; ``join-data`` joins the parts into the data one run
            makes. None = all of it.
        engine: the vLLM engines' settings (:class:`~..engine.engine_config.EngineConfig`):
            ``kv_cache_gb``, the CPU KV cache of each replica's; None = vLLM's default (with
            replicas on CPU: ``CPU_KV_CACHE_GB`` shared).
        target_layer_ids: aux layer ids, each in [0, N); None = ``(2, N//2, N-3)``.
        draft_vocab_size: size of the ``d2t``/``t2d`` files written.
        max_samples: use only the first this many usable prompts.
        contamination_guard: drop the prompts that copy a held-out evaluation prompt
            (:mod:`..data.contamination`; the count is recorded in ``generation_settings.json``).
            Off for users whose evaluation uses other sets.
        seed: seed of the sampled generation (vllm: mixed with each reply's prompt index and
            turn; transformers: with each batch's first, so resumed runs agree).
        dtype: the target's compute dtype, also the stored hidden states' dtype.
        device: torch device of the target.
    """

    target: str = setting(help="Local transformers target model directory.", show=None, path=True)
    prompts: str = setting(
        help="Prompt set, as eval --prompts takes it: humaneval, chat, sharegpt (first turns), "
        "sharegpt_turns (every user turn of each conversation, answered in order), mbpp, ..., "
        "a .jsonl file (messages/conversations/prompt rows; each user turn of a row gets a "
        "reply) or a dataset saved with save_to_disk, optionally sliced like chat[100:]; a mix "
        "joins them with +, sharegpt[:4000]+mbpp.",
        show=None,
        prompts=True,
    )
    output: str = setting(
        help="Output directory (resumed if it exists).", show=None, output=True, resumable=True
    )
    replies: ReplyConfig = section(ReplyConfig)
    hidden_states_from: str | None = setting(
        None,
        "What computes the hidden states (vllm falls back to transformers where it cannot, "
        "and logs why; generation: the replies' vLLM engine records them as it generates, "
        "no second pass; the reply's last token then has no state and no loss).",
        choices=STATE_SOURCES,
        show="generation with --backend vllm, else transformers",
    )
    hidden_states_dtype: str = setting(
        "target",
        "Stored hidden states: target = in --dtype; float8 = float8_e4m3fn with a float32 "
        "scale per token (half of bfloat16's disk; lossy: 3 mantissa bits to bfloat16's 7).",
        choices=STORAGE_DTYPES,
    )
    tensor_parallel_size: int = setting(1, "vLLM's tensor parallel size (vllm only).")
    data_parallel_size: int = setting(
        1,
        "Replicas on this machine, each making its part of the data: one per "
        "--tensor-parallel-size GPUs on CUDA, or CPU processes sharing the cores; joined into "
        "--output at the end.",
        resumable=True,
    )
    shard: str | None = setting(
        None,
        "I/N: make only part I (counted from 0) of N, to run the same command on N machines; "
        "join-data joins the parts.",
        show=None,
    )
    engine: EngineConfig = section(
        EngineConfig, hidden=("max_model_len", "in_process"),
        says={"kv_cache_gb": {"help": "vLLM's CPU KV cache in GiB (vllm backend; per replica)."}},
    )
    target_layer_ids: tuple[int, ...] | None = setting(
        None, "Aux layer ids, e.g. 2,15,27.", show="2,N//2,N-3"
    )
    draft_vocab_size: int = setting(
        DEFAULT_DRAFT_VOCAB_SIZE, "Size of the d2t/t2d written.", resumable=True
    )
    max_samples: int | None = setting(None, "Use only the first N prompts.", show=None)
    contamination_guard: bool = setting(
        True,
        "Keep the prompts that copy a held-out evaluation prompt (HumanEval[120:164], "
        "MT-Bench, GSM8K test, chat[100:]), which are dropped by default.",
        flag="--no-contamination-guard",
        negate=True,
        show=None,
    )
    seed: int = setting(0, "Sampling seed.")
    dtype: str = setting(
        "float32", "Target dtype, also the hidden states' dtype.", choices=DTYPE_NAMES
    )
    device: str = setting("cpu", "Torch device of the target.", resumable=True)

    @property
    def capture_backend(self) -> str:
        """What computes the hidden states (a ``STATE_SOURCES`` name)."""
        if self.hidden_states_from is not None:
            return self.hidden_states_from
        return "generation" if self.replies.backend == "vllm" else "transformers"

    @property
    def storage_dtype(self) -> str:
        """The stored hidden states' dtype name (a DTYPES name or ``"float8"``)."""
        return self.dtype if self.hidden_states_dtype == "target" else self.hidden_states_dtype

    @property
    def part(self) -> Shard:
        """The part of the data this run makes (``WHOLE`` without ``--shard``)."""
        return WHOLE if self.shard is None else Shard.parse(self.shard)

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("draft_vocab_size", "tensor_parallel_size", "data_parallel_size"):
            check_int_at_least(name, getattr(self, name), 1)
        if self.shard is not None:
            Shard.parse(self.shard)
        check_optional_ints(self, {"max_samples": 1})
        check_int_at_least("seed", self.seed, 0)
        if self.hidden_states_from == "generation" and self.replies.backend != "vllm":
            raise UserError(
                "hidden_states_from generation records the states in the replies' vLLM "
                f"engine, so it needs backend vllm, got backend {self.replies.backend!r}."
            )
        checked_device(self.device)
        if not (Path(self.target) / "config.json").is_file():
            raise UserError(
                f"--target {self.target} is not a local transformers model directory "
                "(no config.json)."
            )
        if not prompt_source_exists(self.prompts):
            raise UserError(f"--prompts {self.prompts} does not exist.")
