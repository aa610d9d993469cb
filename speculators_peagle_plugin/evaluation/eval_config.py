"""``speculators-peagle eval``'s settings: one typed, validated place for each default.

Every field that is a flag carries its help text (and its choices, its flag name when it
is not the field's name) in its metadata (:func:`~..common.settings.setting`); the ``eval``
command's options are generated from them, so a default or a choice list is written here
and nowhere else. :class:`SweepConfig` (what each cell measures) is the section the demo
composes too.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from ..common.dtypes import DTYPE_NAMES
from ..common.errors import UserError
from ..common.settings import Settings, flatten, leaves, section
from ..common.settings import setting as _opt
from ..engine.engine_config import EngineConfig
from ..engine.vllm_client import CPU_KV_CACHE_GB
from ..model.model_card import check_base_model

BACKENDS = ("vllm", "reference")


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


@dataclass
class SweepConfig:
    """The cells of a sweep and what each decodes (the ``sweep`` section).

    Args:
        prompt_sets: prompt-set specs (:func:`~speculators_peagle_plugin.data.prompts.
            load_prompt_set`).
        ks: ``num_speculative_tokens`` values; several = a sweep.
        max_new_tokens: per request.
        concurrency: requests in flight; several = a sweep, all on one engine per (draft, K)
            whose ``max_num_seqs`` is the largest.
        ks_at_max_concurrency: the K run at the largest concurrency (None: every K). The
            recommendation there compares no draft with these alone: for a sweep whose other
            K do not pay at that load (drafting pays less with more requests in flight).
        prompts_per_slot: at concurrency c, decode only the first ``prompts_per_slot * c``
            prompts of each set (None: all), so that low-concurrency cells stay short.
        enforce_eager: vLLM's ``enforce_eager``; False (vLLM's default, what ``vllm serve``
            runs) compiles the target and the draft at each engine start.
    """

    prompt_sets: tuple[str, ...] = _opt(
        ("humaneval",),
        "humaneval, mt_bench, gsm8k, chat or a .jsonl, optionally sliced: humaneval[120:164] "
        "(repeatable).",
        flag="--prompts",
        multiple=True,
        show="humaneval",
    )
    ks: tuple[int, ...] = _opt(
        (1, 2, 4),
        "K, or a comma-separated sweep: 1,2,4.",
        flag="--num-speculative-tokens",
        short="-k",
        show="1,2,4",
        engine=True,
    )
    max_new_tokens: int = _opt(128, "Tokens decoded per request.", card=True)
    concurrency: tuple[int, ...] = _opt(
        (1, 4, 16), "Requests in flight, or a comma-separated sweep: 1,4,16.", show="1,4,16"
    )
    ks_at_max_concurrency: tuple[int, ...] | None = _opt(
        None,
        "At the largest concurrency run only these K, comma-separated (of -k's).",
        show="every K",
        engine=True,
    )
    prompts_per_slot: int | None = _opt(
        None,
        "At concurrency c, decode only the first N*c prompts of each set.",
        show="all prompts",
    )
    enforce_eager: bool = _opt(
        False,
        "Run the models without compiling them (vLLM's --enforce-eager): each engine starts "
        "sooner, but decodes slower than `vllm serve` does by default, so tokens/s and "
        "speedups are not the served ones.",
        switch=True,
        show=None,
        card=True,
        engine=True,
    )

    def __post_init__(self) -> None:
        self.prompt_sets = tuple(self.prompt_sets)
        self.ks = tuple(sorted(set(self.ks)))
        self.concurrency = tuple(sorted(set(self.concurrency)))
        for name in ("max_new_tokens", "prompts_per_slot"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise UserError(f"{name} must be an integer >= 1, got {value!r}.")
        for name, values in (("K", self.ks), ("concurrency", self.concurrency)):
            if not values or not all(map(_positive_int, values)):
                raise UserError(f"every {name} must be an integer >= 1, got {list(values)!r}.")
        if not self.prompt_sets:
            raise UserError("give at least one prompt set.")
        if self.ks_at_max_concurrency is not None:
            self.ks_at_max_concurrency = tuple(sorted(set(self.ks_at_max_concurrency)))
            if not self.ks_at_max_concurrency or not set(self.ks_at_max_concurrency) <= set(
                self.ks
            ):
                raise UserError(
                    f"ks_at_max_concurrency must be some of the K swept ({list(self.ks)}), "
                    f"got {list(self.ks_at_max_concurrency)}."
                )

    def runs_at(self, k: int, concurrency: int) -> bool:
        """Whether the sweep measures K (0: no draft) at ``concurrency``."""
        at_max = concurrency == max(self.concurrency) and self.ks_at_max_concurrency
        return not (k and at_max and k not in self.ks_at_max_concurrency)


@dataclass
class EvalConfig(Settings):
    """What to evaluate and how.

    Args:
        target: local target directory (transformers format, with its tokenizer).
        drafts: P-EAGLE checkpoint directories; each is run at every K.
        sweep: the cells and what each decodes (:class:`SweepConfig`).
        backend: ``vllm`` (the real engine, out of process) or ``reference``.
        baseline: also run without a draft (tokens/s for the speedup).
        ignore_eos: decode exactly ``max_new_tokens`` tokens.
        dtype: model dtype; output_dir: where record.json and the PNG figures go.
        seed: the engine's seed.
        engine: how each vLLM engine starts (:class:`~..engine.engine_config.EngineConfig`):
            its KV cache is shared by the engines alive at once, None = ``CPU_KV_CACHE_GB``
            on CPU, vLLM's default on GPU (:meth:`resolved_kv_cache_gb`); ``in_process``
            is for tests and acceptance-only runs.
        interleave: on CPU, keep every engine alive and run the concurrency-1 cells in
            turns, one prompt per engine per turn (:func:`~.harness.plan_turns`), so that
            the machine's drift between minutes cancels out of their speedups. False, or a
            GPU (whose memory one engine claims), runs one engine after another.
        servers: base URLs of running OpenAI-compatible vLLM servers to measure instead of
            starting engines (:mod:`.server`); then the settings marked ``engine`` keep
            their defaults (each server has its own).
        labels: the table's name for each server, in the order of ``servers`` (empty: the
            model name each server reports).
        base_model: the target's hub model id, written as ``base_model`` into the model
            card of each draft (:mod:`.card`).
    """

    target: str = _opt(help="Local target directory.", show=None)
    drafts: tuple[str, ...] = _opt(
        (), "P-EAGLE checkpoint (repeatable).", flag="--draft", multiple=True, show=None,
        engine=True,
    )
    sweep: SweepConfig = section(SweepConfig)
    backend: str = _opt(
        "vllm", "Where the drafts run.", choices=BACKENDS, card=True, engine=True
    )
    baseline: bool = _opt(
        True, "Skip the no-draft run (no speedup).", flag="--no-baseline", negate=True, show=None,
        engine=True,
    )
    ignore_eos: bool = _opt(
        False, "Always decode --max-new-tokens tokens.", switch=True, show=None, card=True
    )
    dtype: str = _opt("float32", "Model dtype.", choices=DTYPE_NAMES, card=True, engine=True)
    engine: EngineConfig = section(EngineConfig, says={"kv_cache_gb": {
        "help": "vLLM CPU KV cache in GiB (VLLM_CPU_KVCACHE_SPACE), shared by the engines "
                "alive at once.",
        "show": f"{CPU_KV_CACHE_GB} on CPU",
    }})
    output_dir: str = _opt(
        help="Run directory.",
        factory=lambda: f"runs/eval-{_stamp()}",
        flag="--out",
        show="runs/eval-<UTC time>",
        output=True,
    )
    seed: int = 0  # the engine's seed; not a flag
    interleave: bool = _opt(
        True,
        "Run the concurrency-1 cells one engine after another instead of in turns, one "
        "prompt per engine (on CPU, where every engine then stays alive at once).",
        flag="--no-interleave",
        negate=True,
        show=None,
        engine=True,
    )
    servers: tuple[str, ...] = _opt(
        (), "URL of a running OpenAI-compatible vLLM server to measure instead of starting engines "
        "(repeatable); one that does not draft is the no-draft baseline.",
        flag="--server", multiple=True, show=None,
    )
    labels: tuple[str, ...] = _opt(
        (), "The table's name for each --server, in the same order (repeatable).", flag="--label",
        multiple=True, show="the model name the server reports",
    )
    base_model: str | None = _opt(
        None, "The target's hub model id (owner/name), for the model cards' base_model.",
        show="the id the target's config names, or none",
    )

    def __post_init__(self) -> None:
        self.drafts = tuple(self.drafts)
        self.servers, self.labels = tuple(self.servers), tuple(self.labels)
        if self.servers:
            self._check_server_mode()
        elif self.labels:
            raise UserError("--label names a --server: give the servers' URLs with --server.")
        if self.backend not in BACKENDS:
            raise UserError(f"backend must be one of {BACKENDS}, got {self.backend!r}.")
        if self.dtype not in DTYPE_NAMES:
            raise UserError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}.")
        if not self.drafts and not self.baseline:
            raise UserError("nothing to evaluate: give a draft or keep the baseline run.")
        if not (Path(self.target) / "config.json").is_file():
            raise UserError(
                f"target {self.target!r} is not a local model directory (no config.json)."
            )
        check_base_model(self.base_model)
        for draft in self.drafts:
            if not Path(draft).is_dir():
                raise UserError(f"draft checkpoint {draft!r} is not a directory.")

    def _check_server_mode(self) -> None:
        """One --label per server, and none of the settings a server has of its own."""
        if self.labels and len(self.labels) != len(self.servers):
            raise UserError(
                f"give one --label per --server, in the same order ({len(self.servers)} "
                f"server(s), {len(self.labels)} label(s))."
            )
        if len(set(self.labels)) < len(self.labels):
            raise UserError(f"each --label must name one server, got {list(self.labels)!r}.")
        values = flatten(self)
        given = [leaf.field.metadata.get("short") or leaf.flag for leaf in leaves(type(self))
                 if leaf.field.metadata.get("engine") and values[leaf.key] != leaf.default]
        if given:
            raise UserError(
                f"{', '.join(given)} cannot be used with --server: each server decodes with "
                "its own draft, K and engine settings (start one `vllm serve` per draft and K "
                "and give each URL to --server)."
            )

    def resolved_kv_cache_gb(self, engines_alive: int = 1) -> int | None:
        """The KV cache each vLLM worker gets: the flag, else ``CPU_KV_CACHE_GB`` on CPU,
        shared by the engines alive at once (at least 1 GiB each)."""
        if self.backend != "vllm":
            return self.engine.kv_cache_gb
        total = self.engine.kv_cache_gb
        if total is None:
            import torch

            total = None if torch.cuda.is_available() else CPU_KV_CACHE_GB
        return None if total is None else max(1, total // engines_alive)

    def resolved_interleave(self) -> bool:
        """Whether the concurrency-1 cells run in turns: asked for, vLLM, and no GPU."""
        if not self.interleave or self.backend != "vllm":
            return False
        import torch

        return not torch.cuda.is_available()


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
