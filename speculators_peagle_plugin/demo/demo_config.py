"""What the demo runs: :class:`DemoConfig` (every default) and its CI-sized :data:`QUICK`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..common.dtypes import DTYPE_NAMES
from ..common.errors import UserError
from ..common.reading import read_yaml_mapping
from ..common.settings import Settings, build, check_optional_ints, leaves, section, setting
from ..datagen.datagen_config import ReplyConfig
from ..engine.engine_config import EngineConfig
from ..engine.vllm_client import CPU_KV_CACHE_GB
from ..evaluation.eval_config import SweepConfig

__all__ = ["DemoConfig", "QUICK", "quick_config"]

QUICK_RUN_DIR = "runs/demo-quick"


def _demo_replies() -> ReplyConfig:
    return ReplyConfig(max_new_tokens=200, temperature=0.7, batch_size=128, num_samples=5,
                       backend="vllm")


def _demo_sweep() -> SweepConfig:
    # MT-Bench: every tenth question, one per category (the full 80: eval --prompts mt_bench)
    return SweepConfig(
        prompt_sets=("humaneval[120:164]", "chat[100:]", "mt_bench[::10]"), ks=(2, 4),
        concurrency=(1, 16), prompts_per_slot=4, max_new_tokens=128, enforce_eager=False,
    )


@dataclass(frozen=True)
class DemoConfig(Settings):
    """What the demo runs (each default lives here; ``quick_config`` shortens them).

    Args:
        run_dir: directory for everything the demo writes (resumed if it exists).
        train_config: the training YAML given to ``speculators-peagle train --config``.
        train_prompts: prompt-set specs (``data.prompts.load_prompt_set``); the eval sets
            must not overlap them.
        validation_prompts: held-out prompts whose replies score every checkpoint
            (``train --validation-data-path``; the best checkpoint is the one served);
            empty: no validation. One that opens as a training conversation (the same
            first prompt) is left out.
        early_stop_patience: with validation prompts, stop training once this many
            checkpoints in a row have not beaten the best (None: train every epoch).
        max_prompt_tokens: training and validation prompts longer than this (chat template
            applied) are left out: a reply after them would not fit the training rows. A
            conversation of several user turns is cut before the first whose prompt, each
            reply before it at its longest, is longer (``artifacts.prompt_length_cut``).
        replies: generate-data's reply settings (keys ``max_new_tokens``, ``num_samples``,
            ``temperature``, ``gen_backend``, ``gen_batch_size``).
        max_steps: cap on optimizer steps (None: the YAML's epochs).
        num_speculative_tokens: K the draft is trained and checked for.
        sweep: the eval's sweep (keys ``eval_prompts``, ``eval_ks``, ``eval_concurrency``,
            ``eval_prompts_per_slot``, ``eval_max_new_tokens``, ``eval_enforce_eager``,
            ``eval_ks_at_max_concurrency``): at concurrency c it decodes the first
            ``eval_prompts_per_slot * c`` prompts of each set, since single-request decoding
            is slow on a CPU and at the largest concurrency every held-out prompt still runs;
            ``eval_enforce_eager`` starts engines sooner, but their tokens/s are not those of
            ``vllm serve``. The K run at the largest concurrency: :meth:`ks_at_max_concurrency`.
        engine: the vLLM engines' settings (key ``kv_cache_gb``: the CPU KV cache of data
            generation and eval).
        target_dtype: the target's dtype when it writes the data and serves in eval (the
            draft learns the states it will be served); ``auto`` = bfloat16, as SmolLM2 ships,
            on CPUs that multiply it natively, float32 elsewhere.
        quick: a CI-sized run whose figures mean nothing.

    A recipe (``demo --recipe FILE.yaml``, :meth:`from_recipe`) sets any of these keys.
    """

    run_dir: str = setting(
        "runs/demo", "Where everything goes; rerunning resumes it.",
        show=f"runs/demo, {QUICK_RUN_DIR} with --quick", output=True,
    )
    train_config: str = setting(
        str(Path(__file__).with_name("demo_smollm2.yaml")), "Training YAML.", flag="--config",
        show="configs/demo_smollm2.yaml",
    )
    train_prompts: tuple[str, ...] = ("humaneval[0:120]", "chat[0:100]")
    validation_prompts: tuple[str, ...] = ()
    max_prompt_tokens: int | None = None
    early_stop_patience: int | None = None
    replies: ReplyConfig = section(
        ReplyConfig, factory=_demo_replies, hidden=("top_p",), flags=False,
        keys={"backend": "gen_backend", "batch_size": "gen_batch_size"},
    )
    max_steps: int | None = None
    num_speculative_tokens: int = 4
    sweep: SweepConfig = section(
        SweepConfig, factory=_demo_sweep, prefix="eval_", keys={"prompt_sets": "eval_prompts"},
        flags=False,
    )
    engine: EngineConfig = section(
        EngineConfig, factory=lambda: EngineConfig(kv_cache_gb=CPU_KV_CACHE_GB),
        hidden=("max_model_len", "in_process"), flags=False,
    )
    target_dtype: str = "auto"
    quick: bool = setting(
        False, "CI-sized run: 6 prompts, 2 steps, a short eval.", switch=True, show=None
    )

    def __post_init__(self) -> None:
        if not Path(self.train_config).is_file():
            raise UserError(f"training config {self.train_config} does not exist.")
        check_optional_ints(self, {"num_speculative_tokens": 1, "max_steps": 1,
                                   "max_prompt_tokens": 1, "early_stop_patience": 1})
        if self.target_dtype not in ("auto", *DTYPE_NAMES):
            raise UserError(
                f"target_dtype must be auto or one of {', '.join(DTYPE_NAMES)}, "
                f"got {self.target_dtype!r}."
            )
        if self.early_stop_patience is not None and not self.validation_prompts:
            raise UserError("early_stop_patience needs validation_prompts to score on.")

    def ks_at_max_concurrency(self) -> tuple[int, ...] | None:
        """The K the eval runs at its largest concurrency (None: every K).

        ``eval_ks_at_max_concurrency`` when given; else the trained K alone, when it is swept
        beside others over several concurrencies: drafting pays less with more requests in
        flight, and the other K stay under 1x there on every machine measured, so they do not
        change the recommendation (`speculators-peagle eval -k 2,4 --concurrency 1,16`).
        """
        sweep = self.sweep
        if sweep.ks_at_max_concurrency is not None:
            return sweep.ks_at_max_concurrency
        trained = self.num_speculative_tokens
        several = len(sweep.ks) > 1 and len(sweep.concurrency) > 1
        return (trained,) if several and trained in sweep.ks else None

    @classmethod
    def from_recipe(cls, path: str | Path, **overrides) -> DemoConfig:
        """The demo configured by the YAML recipe ``path`` (keys: this class's; a
        relative ``train_config`` is read beside the recipe), then ``overrides``.

        Example: ``configs/recipes/long_smollm2.yaml`` -> ShareGPT + MBPP prompts, validation,
        early stopping, MT-Bench's 80 questions in the eval.
        """
        return cls.from_command(path, overrides)

    @classmethod
    def from_command(cls, recipe: str | Path | None, given: dict) -> DemoConfig:
        """``demo``'s settings: :data:`QUICK`'s with ``--quick``, else a recipe's, then the
        flags ``given``."""
        if given.get("quick") and recipe:
            raise UserError("--quick and --recipe are exclusive: choose one.")
        values = dict(QUICK) if given.get("quick") else {}
        if recipe is not None:
            path = Path(recipe)
            values = dict(read_yaml_mapping(path))
            known = [leaf.key for leaf in leaves(cls)]
            known += dict.fromkeys(leaf.path[0] for leaf in leaves(cls) if len(leaf.path) > 1)
            unknown = sorted(set(values) - set(known))
            if unknown:
                raise UserError(
                    f"recipe {path} has unknown key(s) {', '.join(unknown)}; allowed: "
                    f"{', '.join(known)}."
                )
            if "train_config" in values:
                values["train_config"] = str(path.parent / values["train_config"])
        return build(cls, {**values, **given}, recipe)


# The CI-sized demo: 6 training prompts, 24-token replies, 2 steps, a 2 x 1 sweep of 4
# short eval prompts on uncompiled engines.
QUICK = dict(
    run_dir=QUICK_RUN_DIR,
    train_prompts=("humaneval[0:3]", "chat[0:3]"),
    eval_prompts=("humaneval[120:122]", "chat[100:102]"),
    max_new_tokens=24,
    num_samples=2,
    gen_batch_size=6,
    max_steps=2,
    eval_ks=(2,),
    eval_concurrency=(1, 2),
    eval_prompts_per_slot=1,
    eval_max_new_tokens=24,
    eval_enforce_eager=True,
    quick=True,
)


def quick_config(**overrides) -> DemoConfig:
    """:data:`QUICK`'s values, then ``overrides``, over :class:`DemoConfig`'s defaults."""
    return build(DemoConfig, {**QUICK, **overrides})
