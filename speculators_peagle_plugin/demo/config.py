"""What the demo runs: :class:`DemoConfig` (every default) and its CI-sized :data:`QUICK`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from ..common.dtypes import DTYPE_NAMES
from ..common.reading import read_yaml_mapping
from ..datagen.config import BACKENDS

__all__ = ["DemoConfig", "QUICK", "quick_config"]


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs (each default lives here; ``quick_config`` shortens them).

    Args:
        run_dir: directory for everything the demo writes (resumed if it exists).
        train_config: the training YAML given to ``speculators-peagle train --config``.
        train_prompts / eval_prompts: prompt-set specs (``data.prompts.load_prompt_set``);
            the eval sets must not overlap the training sets.
        validation_prompts: held-out prompts whose replies score every checkpoint
            (``train --validation-data-path``; the best checkpoint is the one served);
            empty: no validation.
        early_stop_patience: with validation prompts, stop training once this many
            checkpoints in a row have not beaten the best (None: train every epoch).
        max_prompt_tokens: training and validation prompts longer than this (chat template
            applied) are left out: a reply after them would not fit the training rows.
        max_new_tokens: reply length cap when generating training data.
        num_samples / temperature: replies sampled per training prompt, at this temperature.
        gen_backend: generate-data's ``--backend`` (vllm batches the requests in flight).
        gen_batch_size: replies generated together (vLLM: requests in flight).
        max_steps: cap on optimizer steps (None: the YAML's epochs).
        num_speculative_tokens: K the draft is trained and checked for.
        eval_ks / eval_concurrency: the eval's sweep: K values x requests in flight.
        eval_prompts_per_slot: at concurrency c the eval decodes the first
            ``eval_prompts_per_slot * c`` prompts of each set: single-request decoding is
            slow on a CPU, and at the largest concurrency every held-out prompt still runs.
        eval_max_new_tokens: per request in vLLM.
        eval_enforce_eager: eval's ``--enforce-eager``: engines start sooner, but tokens/s
            are not those of ``vllm serve``, which compiles the models.
        kv_cache_gb: vLLM's CPU KV cache (data generation and eval).
        target_dtype: the target's dtype when it writes the data and serves in eval (the
            draft learns the states it will be served); ``auto`` = bfloat16, as SmolLM2 ships,
            on CPUs that multiply it natively, float32 elsewhere.
        quick: a CI-sized run whose figures mean nothing.

    A recipe (``demo --recipe FILE.yaml``, :meth:`from_recipe`) sets any of these fields.
    """

    run_dir: str = "runs/demo"
    train_config: str = str(Path(__file__).with_name("demo_smollm2.yaml"))
    train_prompts: tuple[str, ...] = ("humaneval[0:120]", "chat[0:100]")
    validation_prompts: tuple[str, ...] = ()
    max_prompt_tokens: int | None = None
    early_stop_patience: int | None = None
    # MT-Bench: every tenth question, one per category (the full 80: eval --prompts mt_bench)
    eval_prompts: tuple[str, ...] = ("humaneval[120:164]", "chat[100:]", "mt_bench[::10]")
    max_new_tokens: int = 200
    num_samples: int = 5
    temperature: float = 0.7
    gen_backend: str = "vllm"
    gen_batch_size: int = 128
    max_steps: int | None = None
    num_speculative_tokens: int = 4
    eval_ks: tuple[int, ...] = (2, 4)
    eval_concurrency: tuple[int, ...] = (1, 16)
    eval_prompts_per_slot: int = 4
    eval_max_new_tokens: int = 128
    eval_enforce_eager: bool = False
    kv_cache_gb: int = 4
    target_dtype: str = "auto"
    quick: bool = False

    def __post_init__(self) -> None:
        if not Path(self.train_config).is_file():
            raise ValueError(f"training config {self.train_config} does not exist.")
        for name in ("max_new_tokens", "num_samples", "gen_batch_size", "num_speculative_tokens",
                     "eval_max_new_tokens", "eval_prompts_per_slot", "kv_cache_gb"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        for name in ("eval_ks", "eval_concurrency"):
            values = getattr(self, name)
            if not values or not all(isinstance(v, int) and v >= 1 for v in values):
                raise ValueError(f"{name} must be integers >= 1, got {values!r}.")

        if self.gen_backend not in BACKENDS:
            raise ValueError(
                f"gen_backend must be one of {', '.join(BACKENDS)}, got {self.gen_backend!r}."
            )
        if not self.temperature >= 0 or (self.num_samples > 1 and self.temperature == 0):
            raise ValueError(
                f"temperature must be >= 0, and > 0 with num_samples > 1; got {self.temperature}."
            )
        if self.target_dtype not in ("auto", *DTYPE_NAMES):
            raise ValueError(
                f"target_dtype must be auto or one of {', '.join(DTYPE_NAMES)}, "
                f"got {self.target_dtype!r}."
            )
        if self.early_stop_patience is not None and not self.validation_prompts:
            raise ValueError("early_stop_patience needs validation_prompts to score on.")
        for name in ("max_steps", "max_prompt_tokens", "early_stop_patience"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):  # fmt: skip
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}.")

    @classmethod
    def from_recipe(cls, path: str | Path, **overrides) -> DemoConfig:
        """The demo configured by the YAML recipe ``path`` (keys: this class's fields; a
        relative ``train_config`` is read beside the recipe), then ``overrides``.

        Example: ``configs/recipes/long_smollm2.yaml`` -> ShareGPT + MBPP prompts, validation,
        early stopping, MT-Bench's 80 questions in the eval.
        """
        path = Path(path)
        values = read_yaml_mapping(path)
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(
                f"recipe {path} has unknown key(s) {', '.join(unknown)}; allowed: "
                f"{', '.join(known)}."
            )
        for name, value in values.items():
            if isinstance(value, list):
                values[name] = tuple(value)
        if "train_config" in values:
            values["train_config"] = str(path.parent / values["train_config"])
        return cls(**{**values, **overrides})


# The CI-sized demo: 6 training prompts, 24-token replies, 2 steps, a 2 x 1 sweep of 4
# short eval prompts on uncompiled engines.
QUICK = dict(
    run_dir="runs/demo-quick",
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
    return DemoConfig(**{**QUICK, **overrides})
