"""The target's replies to the prompts: generated with transformers or vLLM, resumable per shard.

Each shard (``DIR/responses/<first>-<last>.json``) maps a prompt index to its rows
``{"input_ids", "loss_mask"}``; a run that is stopped regenerates only the shards it lacks,
and draws the same replies (each reply samples with its own seed). vLLM gets the prompts of
several shards as one job (``VLLM_SHARDS_PER_JOB``), so its engine stays full across shard
boundaries; a shard is written as soon as its last reply is in. Conversations of several
user turns are regenerated turn by turn, each conversation's next turn asked as soon as its
reply is in, so a shard waits for its longest conversation: meanwhile, every
``TURNS_SAVE_EVERY_S`` at most, the job's replies so far go to ``<first>-<last>.turns``, and
a stopped run takes its conversations up again from their last saved turn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from functools import cached_property
from pathlib import Path

import torch

from ..common.dtypes import DTYPES
from ..common.errors import UserError
from ..data.layout import RESPONSES_DIR, VLLM_LOG_FILE, mix_seed
from ..data.prompts import render_conversation
from ..engine.engine_start import check_parallel_size
from ..engine.vllm_client import VllmJob, VllmWorker
from ..model.target import eos_token_ids, load_target_model
from .datagen_config import VLLM_BATCHES_PER_SHARD, VLLM_SHARDS_PER_JOB, DataGenConfig
from .turn_state import Conversations, ShardFiles, TurnFiles, done_shards
from .vllm_recorder import recording_extension

logger = logging.getLogger(__name__)

FollowUps = list[tuple[list[int], int | None]]  # (prompt, seed) of the requests that follow
TURNS_SAVE_EVERY_S = 60.0  # how often a job's finished turns go to its .turns file, at most


class Target:
    """The target model and tokenizer, with the two jobs generate-data runs on them."""

    def __init__(self, config: DataGenConfig):
        from transformers import AutoTokenizer

        self.config = config
        if "vllm" in (config.replies.backend, config.capture_backend):
            check_parallel_size(config.tensor_parallel_size)
        self.tokenizer = AutoTokenizer.from_pretrained(config.target)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise UserError(f"The tokenizer of --target {config.target} has no chat template.")
        self.eos_ids = eos_token_ids(self.tokenizer, _generation_config(config.target))
        if not self.eos_ids:
            raise UserError(f"--target {config.target} defines no end-of-sequence token.")
        pad = self.tokenizer.pad_token_id
        self.pad_id = self.eos_ids[0] if pad is None else pad
        self.vllm = None  # a running VllmWorker while the vllm backend generates
        # vLLM's prefix cache over this target's jobs: prompt tokens looked up, found cached
        self.prefix_cache = {"queries": 0, "hits": 0}
        self.record_error: str | None = None  # why vLLM could not record states, once it said

    @cached_property
    def model(self):
        """The transformers model, loaded on first use: a run whose replies and states both
        come from vLLM never loads it (a target served with tensor parallelism may not fit)."""
        cfg = self.config
        return load_target_model(cfg.target, DTYPES[cfg.dtype], cfg.device)

    def prompt_ids(self, turns: list[dict]) -> list[int]:
        return render_conversation(self.tokenizer, turns)

    @contextmanager
    def generator(self, log_path: Path):
        """While open, :meth:`generate` runs on the configured backend (vLLM: a child process
        that is gone again when the block ends, so the hidden-state phase has the cores)."""
        if self.config.replies.backend != "vllm":
            yield
            return
        # In process: the engine starts in seconds, and plain decoding (no draft) runs as fast
        # as with vLLM's separate engine process, which would also reserve a core for itself.
        in_process = self.config.tensor_parallel_size == 1  # several ranks need processes
        with VllmWorker(
            log_path, in_process=in_process, kv_cache_gb=self.config.engine.kv_cache_gb
        ) as worker:
            self.vllm = worker
            try:
                yield
            finally:
                self.vllm = None

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        on_reply: Callable[[int, list[int]], FollowUps | None],
        on_event: Callable[[dict], None] | None = None,
        record: dict | None = None,
        follow_ups: bool = False,
    ) -> None:
        """Complete every prompt; ``on_reply(j, completion)`` gets prompt ``j``'s completion,
        cut after its first EOS, as soon as it is done (vLLM: when its request finishes;
        transformers: after the batch, in order).

        With ``follow_ups``, ``on_reply`` may return ``(prompt, seed)`` pairs that follow
        reply ``j`` (a conversation's next turn): they are completed too, as prompts
        ``len(prompts)``, ``len(prompts) + 1``, ... in the order returned. vLLM runs them
        as soon as they are given, ahead of the prompts not started yet, so that the
        prefix they share with reply ``j`` is still in its prefix cache; transformers
        runs them as the next batch once this one is done.

        ``seeds[j]`` seeds prompt ``j``'s sampling. On vLLM it is the request's own seed
        (greedy requests get none), so a reply depends on its prompt and seed, not on the
        requests that shared its steps (up to the rounding of batched arithmetic); transformers
        samples the whole batch from one generator seeded with ``seeds[0]``. On vLLM,
        ``on_event`` receives the worker's event after every finished request
        (:meth:`~..engine.vllm_client.VllmWorker.run`), and ``record`` (a
        :class:`~.vllm_recorder.HiddenStatesRecorder` spec) has the engine record the hidden
        states of every token it computes; an engine that cannot record says why in the
        log once, and generates as usual.
        """
        if self.vllm is not None:
            self._vllm_generate(prompts, seeds, on_reply, on_event, record, follow_ups)
            return
        first = 0
        while prompts:  # a batch, then the follow-ups its replies brought
            added = []
            for j, completion in enumerate(self._transformers_generate(prompts, seeds)):
                added += on_reply(first + j, completion) or []
            first += len(prompts)
            prompts, seeds = [p for p, _ in added], [seed for _, seed in added]

    def _vllm_generate(
        self, prompts, seeds, on_reply, on_event, record, follow_ups: bool
    ) -> None:
        """:meth:`generate` as one job of the running vLLM worker (an open job with
        ``follow_ups``); adds its prefix-cache counts to ``prefix_cache``."""
        cfg, replies = self.config, self.config.replies
        record = record if self.record_error is None else None
        sampled = replies.temperature > 0  # greedy requests get no seed
        job = VllmJob(
            target=str(Path(cfg.target).resolve()), prompts=prompts,
            max_tokens=replies.max_new_tokens, batch_size=replies.batch_size,
            dtype=cfg.dtype, seed=cfg.seed, seeds=seeds if sampled else None,
            temperature=replies.temperature, top_p=replies.top_p,
            prefix_caching=True,
            engine_overrides={"tensor_parallel_size": cfg.tensor_parallel_size},
            extension=recording_extension(record) if record else None,
            follow_ups=follow_ups,
        )

        def event(message: dict) -> FollowUps:
            added = []
            if message["event"] == "progress":
                completion = completion_tokens(message["token_ids"], self.eos_ids)
                added = on_reply(message["index"], completion) or []
            if on_event is not None:
                on_event(message)
            return [(prompt, seed if sampled else None) for prompt, seed in added]

        result = self.vllm.run(job, event)
        for key, tokens in result["prefix_cache"].items():
            self.prefix_cache[key] += tokens
        if record and (result["extension"] or {}).get("error"):
            self.record_error = result["extension"]["error"]
            logger.warning(
                "vLLM could not record the hidden states while generating (%s); a "
                "second pass will capture them.", self.record_error,
            )

    @torch.no_grad()
    def _transformers_generate(self, prompts: list[list[int]], seeds: list[int]) -> list:
        """Every prompt's completion, cut after its first EOS: one batch, sampled from one
        generator seeded with ``seeds[0]``."""
        from transformers import GenerationConfig

        cfg, replies = self.config, self.config.replies
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sample = replies.temperature > 0
        # An explicit config: the checkpoint's own defaults (often sampling, top-k 50) must not
        # leak in; top_k=0 leaves only temperature and top-p, as vLLM's defaults do.
        gen_config = GenerationConfig(
            max_new_tokens=replies.max_new_tokens,
            do_sample=sample,
            temperature=replies.temperature if sample else None,
            top_p=replies.top_p if sample else None,
            top_k=0 if sample else None,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        torch.manual_seed(seeds[0])
        out = self.model.generate(
            input_ids=ids.to(cfg.device),
            attention_mask=mask.to(cfg.device),
            generation_config=gen_config,
        )
        return [completion_tokens(row.tolist(), self.eos_ids) for row in out[:, width:].cpu()]

    def decode_reply(self, completion: list[int]) -> str:
        return self.tokenizer.decode(completion, skip_special_tokens=True)


def _generation_config(target: str):
    """The target's generation config as ``from_pretrained`` would attach it to the model."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(target)
    except OSError:  # no generation_config.json: transformers derives one from config.json
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(target))


def completion_tokens(generated: list[int], eos_ids: list[int]) -> list[int]:
    """Generated tokens up to and including the first EOS (what vLLM returns as token_ids).

    Example: eos 2, ``[5, 7, 2, 2, 2]`` (padded after the end) -> ``[5, 7, 2]``.
    """
    for i, token in enumerate(generated):
        if token in eos_ids:
            return generated[: i + 1]
    return generated


def _regenerate(
    target: Target,
    conversations: list[list[dict]],
    indices: list[int],
    seed: int,
    on_complete: Callable[[int, list[dict]], None],
    on_event=None,
    record=None,
    started: dict[int, dict] | None = None,
    on_turn: Callable[[dict[int, dict]], None] | None = None,
    save_every_s: float | None = None,
) -> int:
    """Regenerate every assistant turn of a batch of conversations, each turn once the reply
    before it is in.

    Like speculators' ``regenerate-responses``: each user turn gets the target's reply to the
    conversation so far (with its own earlier replies), and each reply is one boundary row
    (speculators' ``build_boundary_sample``: loss_mask 0 on the prompt, 1 on the reply; with
    ``record``, 0 on the reply's last token too, which has no recorded state). A
    conversation's next turn is asked as soon as its reply lands (:meth:`Target.generate`'s
    follow-ups: on vLLM ahead of the turns not started yet, while its prefix is cached).
    ``on_complete(k, rows)`` gets conversation k's rows as soon as its last reply is in.
    Turn t of conversation k samples with seed ``mix_seed(seed, indices[k], t)``: its reply
    does not depend on the batch, so a resumed run draws what an uninterrupted one would.
    ``started[k]`` (``{"rows", "replies"}``: the rows and reply texts of conversation k's
    first turns) resumes k after them; ``on_turn`` gets the same, for every conversation with
    a reply, after a reply that another turn follows, at most once every ``save_every_s``
    seconds (None: ``TURNS_SAVE_EVERY_S``). Returns the number of generated tokens.
    ``on_event`` and ``record`` as in :meth:`Target.generate`.
    """
    from speculators.cli.regenerate_responses import build_boundary_sample

    state = Conversations(conversations)
    state.resume(started or {})
    save_every_s = TURNS_SAVE_EVERY_S if save_every_s is None else save_every_s
    asked: list[tuple[int, list[int]]] = []  # request j: (its conversation, its prompt)
    generated, saved = 0, time.perf_counter()

    def ask(k: int) -> tuple[list[int], int]:
        state.next_user_turn(k)
        prompt = target.prompt_ids(state.history[k])
        asked.append((k, prompt))
        return prompt, mix_seed(seed, indices[k], len(state.rows[k]))

    def on_reply(j: int, reply: list[int]) -> FollowUps:
        nonlocal generated, saved
        k, prompt = asked[j]
        input_ids, loss_mask = build_boundary_sample(prompt, reply)
        if record:
            loss_mask[-1] = 0
        row = {"input_ids": input_ids, "loss_mask": loss_mask}
        state.add_reply(k, row, target.decode_reply(reply))
        generated += len(reply)
        if not state.has_user_turn(k):
            on_complete(k, state.rows[k])
            return []
        if on_turn is not None and time.perf_counter() - saved >= save_every_s:
            on_turn(state.so_far())
            saved = time.perf_counter()
        return [ask(k)]

    for k in range(len(conversations)):
        if not state.has_user_turn(k):
            on_complete(k, state.rows[k])
    first = [ask(k) for k in range(len(conversations)) if state.has_user_turn(k)]
    if first:
        more = any(state.has_user_turn(k) for k, _ in asked)  # a turn after the first ones
        target.generate(
            [prompt for prompt, _ in first], [s for _, s in first], on_reply, on_event, record,
            follow_ups=more,
        )
    return generated


def _unit(prompts: list[list[dict]]) -> str:
    """What the progress bar counts: a finished conversation, which is one reply unless some
    conversation has several user turns."""
    several = any(sum(t["role"] == "user" for t in turns) > 1 for turns in prompts)
    return "conversation" if several else "reply"


def generate_responses(
    target: Target, prompts: list[list[dict]], output: Path, record: dict | None = None,
    span: tuple[int, int] | None = None,
) -> list[tuple[int, dict]]:
    """The target's replies to the conversations ``span`` (``[start, stop)``, None = all);
    resumable per shard. ``(conversation, row)`` pairs in conversation order.

    With ``num_samples`` n, conversation c is prompt ``c // n`` (its ``c % n``-th sample).
    Conversations keep their global index (their seeds, their resume files), so a part
    makes what the run over all of them makes for it (:mod:`.shard_plan`). ``record`` as in
    :meth:`Target.generate`.
    """
    from tqdm import tqdm

    cfg = target.config
    prompts = [turns for turns in prompts for _ in range(cfg.replies.num_samples)]
    responses = output / RESPONSES_DIR
    responses.mkdir(exist_ok=True)
    done = done_shards(responses)
    turns = TurnFiles(responses)
    start, stop = (0, len(prompts)) if span is None else span
    todo = [i for i in range(start, stop) if i not in done]
    vllm = cfg.replies.backend == "vllm"
    shard_size = cfg.replies.batch_size * (VLLM_BATCHES_PER_SHARD if vllm else 1)
    job_size = shard_size * (VLLM_SHARDS_PER_JOB if vllm else 1)
    began, tokens = time.perf_counter(), 0
    with (
        target.generator(output / VLLM_LOG_FILE) if todo else nullcontext(),
        tqdm(total=stop - start, initial=stop - start - len(todo), unit=_unit(prompts),
             desc="Generating") as bar,
    ):

        def live(event: dict) -> None:
            if event["event"] == "progress":
                rate = (tokens + event["output_tokens"]) / (time.perf_counter() - began)
                bar.set_postfix(tok_s=f"{rate:.1f}")

        for j in range(0, len(todo), job_size):
            job = todo[j : j + job_size]
            shards = ShardFiles(responses, job, shard_size, done, bar)
            conversations = [prompts[i] for i in job]
            tokens += _regenerate(
                target, conversations, job, cfg.seed, shards.complete, live, record,
                started=turns.started_of(job), on_turn=turns.saver(job),
            )
            turns.path(job).unlink(missing_ok=True)  # the job's shards are written
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - began):.1f}")
    turns.drop_finished(done)  # a stopped run's jobs, cut otherwise
    if todo:
        elapsed = time.perf_counter() - began
        cache = target.prefix_cache
        logger.info(
            "Generated %d reply tokens for %d %ss in %.1f s (%.1f tokens/s)%s.",
            tokens, len(todo), _unit(prompts), elapsed, tokens / elapsed,
            f"; vLLM found {cache['hits']} of {cache['queries']} prompt tokens in its prefix "
            "cache" if cache["queries"] else "",
        )
    return [(i, row) for i in range(start, stop) for row in done[i]]
