"""``speculators-peagle train``'s settings: one typed, validated place for each default."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

from ..common.dtypes import DTYPE_NAMES
from ..common.flags import flag_field as _opt
from ..common.reading import read_yaml_mapping
from ..core.config import CODConfig, _fail, check_int_at_least
from ..data.prompts import prompt_source_exists
from ..datagen.config import BACKENDS, DataGenConfig
from ..datagen.online import CACHE_KINDS
from ..model.build import DEFAULT_DRAFT_VOCAB_SIZE, DEFAULT_SLIDING_WINDOW

# Settings that do something only with --online, and only with --prompts.
ONLINE_FIELDS = ("target_dtype", "online_cache", "online_cache_gib")
REPLY_FIELDS = ("max_new_tokens", "temperature", "num_samples", "generation_backend")


def _coerce(name: str, value, hint):
    """Check ``value`` against a TrainConfig annotation (YAML gives lists for tuples)."""
    args = get_args(hint)
    if value is None and type(None) in args:
        return None
    if type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]
    if get_origin(hint) is tuple:
        if isinstance(value, list | tuple) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            return tuple(value)
        _fail(name, value, "a list of integers")
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint in (str, bool) and isinstance(value, hint):
        return value
    _fail(name, value, f"of type {hint.__name__}")


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``speculators-peagle train`` reads, with each default in one place.

    Names and meanings follow ``speculators train`` for the shared concepts (the flag is
    the field name with dashes). Precedence: these defaults < ``--config FILE.yaml`` <
    command-line flags. The algorithm's own knobs are validated by :class:`CODConfig`.
    """

    verifier_name_or_path: str = _opt("", "Local directory of the target (verifier) model.")
    data_path: str = _opt(
        "",
        "Training data in speculators' on-disk format (with --online, token ids and loss "
        "masks are enough).",
    )
    online: bool = _opt(
        False,
        "Compute the target's hidden states during training: every rank runs the target on "
        "its own rows; no hidden states are read or written (see --online-cache).",
    )
    prompts: str | None = _opt(
        None,
        "With --online, instead of --data-path: a prompt set as generate-data --prompts takes "
        "it; the target's replies are generated first into SAVE/replies (a rerun reuses them).",
    )
    target_dtype: str = _opt(
        "float32",
        "With --online: the target's dtype (generate-data's --dtype), also its states'.",
        choices=DTYPE_NAMES,
    )
    online_cache: str = _opt(
        "none",
        "With --online: keep hidden states for later epochs in RAM (exact) or on disk in "
        "bfloat16 under SAVE/online-cache (a cached sample trains on its bfloat16 states in "
        "every epoch); none recomputes them each epoch.",
        choices=CACHE_KINDS,
    )
    online_cache_gib: float = _opt(
        4.0, "Size cap of --online-cache in GiB: the first samples that fit are cached."
    )
    max_new_tokens: int = _opt(DataGenConfig.max_new_tokens, "With --prompts: tokens per reply.")
    temperature: float = _opt(
        DataGenConfig.temperature, "With --prompts: the replies' sampling temperature; 0 = greedy."
    )
    num_samples: int = _opt(
        DataGenConfig.num_samples, "With --prompts: replies per prompt (> 1 needs --temperature)."
    )
    generation_backend: str = _opt(
        DataGenConfig.backend,
        "With --prompts: what generates the replies (generate-data's --backend).",
        choices=BACKENDS,
    )
    save_path: str = _opt("./checkpoints", "Directory for checkpoints and the metrics log.")
    algorithm: str = _opt("peagle", "Drafting algorithm (entry point speculators.algorithms).")
    num_layers: int = _opt(1, "Number of draft decoder layers.")
    draft_arch: str = _opt("llama", "Draft decoder layer type.", choices=("llama", "qwen3"))
    draft_vocab_size: int = _opt(
        DEFAULT_DRAFT_VOCAB_SIZE, "Draft vocabulary size (d2t/t2d from token_freq.pt)."
    )
    mask_token_id: int | None = _opt(
        None, "Token id for the K-1 mask slots; default: one the tokenizer never produces."
    )
    target_layer_ids: tuple[int, ...] | None = _opt(
        None, "Aux hidden-state layer ids of the target; default: those the data was made with."
    )
    sliding_window: int | None = _opt(
        DEFAULT_SLIDING_WINDOW,
        "Sliding window of the draft layers (speculators' default); none = full attention.",
    )
    full_attention_indices: tuple[int, ...] = _opt((), "Draft layers that use full attention.")
    num_key_value_heads: int | None = _opt(
        None,
        "Key/value heads of the draft's attention (a divisor of its query heads); default: the "
        "verifier's. The K-1 mask slots see the context only through these values, so a 1-layer "
        "draft of a GQA target learns its later depths far better with more.",
    )
    draft_init: str = _opt(
        "random",
        "Initial draft: random (speculators'), or verifier: fc passes the deepest aux state "
        "through and the draft layers start as the verifier layers that follow it.",
        choices=("random", "verifier"),
    )
    norm_before_residual: bool = _opt(False, "Normalise before the residual (vLLM's default).")
    embed_requires_grad: bool = _opt(False, "Train the token embedding too.")
    num_depths: int = _opt(CODConfig.num_depths, "Parallel depths trained (COD depths).")
    num_speculative_tokens: int | None = _opt(
        None,
        "K the checkpoint declares for serving (vLLM's num_speculative_tokens), at most "
        "num_depths; default: num_depths. Training more depths than are served teaches the "
        "served ones from longer chains.",
    )
    down_sample_ratio: float = _opt(CODConfig.down_sample_ratio, "COD decay ratio r.")
    down_sample_ratio_min: float = _opt(CODConfig.down_sample_ratio_min, "COD floor r_min.")
    max_anchors: int | None = _opt(CODConfig.max_anchors, "Cap on COD chain starts per row.")
    hard_label_weight: float = _opt(
        0.0,
        "Weight w of the target's argmax in the KL target, (1-w) p + w onehot(argmax p): "
        "greedy acceptance checks only the argmax. 0 = plain KL (speculators').",
    )
    tv_weight: float = _opt(
        0.0,
        "Weight of a total-variation term, sum |p - q| / 2 per element, added to the loss: "
        "a sampled draft token is rejected at that rate. 0 = none.",
    )
    greedy_chains: bool = _opt(
        False,
        "Draw the COD rollouts that train depths >= 1 only along the target's greedy path "
        "(every reply token between anchor and position is the target's argmax): greedy "
        "serving verifies no other, and sampled replies leave it often.",
    )
    sequence_partitions: int = _opt(1, "Segments per row (P-EAGLE Algorithm 1); exact.")
    total_seq_len: int = _opt(8192, "Tokens per packed row.")
    lr: float = _opt(1e-3, "AdamW learning rate.")
    weight_decay: float = _opt(0.01, "AdamW weight decay.")
    scheduler_type: str = _opt(
        "linear", "LR schedule after warmup.", choices=("linear", "cosine", "none")
    )
    scheduler_warmup_steps: int | None = _opt(None, "Warmup steps; default 1% of the total.")
    max_grad_norm: float | None = _opt(1.0, "Gradient clipping norm; none disables it.")
    epochs: int = _opt(20, "Passes over the data.")
    max_steps: int | None = _opt(None, "Stop after this many optimizer steps.")
    checkpoint_freq: float = _opt(1.0, "Checkpoint every N epochs (< 1: several times per epoch).")
    keep_checkpoints: int = _opt(2, "How many of the newest checkpoints to keep.")
    validation_data_path: str | None = _opt(
        None,
        "Held-out data (speculators format, same target and aux layers): every checkpoint's "
        "estimated acceptance on it goes to validation.jsonl, the best checkpoint to best/.",
    )
    early_stop_patience: int | None = _opt(
        None,
        "With --validation-data-path: stop once this many checkpoints in a row have not "
        "beaten the best estimated acceptance.",
    )
    log_freq: int = _opt(1, "Write the metrics log every N steps.")
    seed: int = _opt(42, "Seed for initialisation, data order and COD sampling.")
    gradient_checkpointing: bool = _opt(False, "Recompute each draft layer in backward.")
    dtype: str = _opt("float32", "Training precision.", choices=("float32", "bfloat16", "float16"))
    autocast: str = _opt(
        "none",
        "Mixed precision: forward matmuls in this dtype under torch.autocast, weights and "
        "optimizer state in float32 (speculators' trainer autocasts to bfloat16).",
        choices=("none", "bfloat16"),
    )
    device: str = _opt("cpu", "cpu, cuda or cuda:N (under torchrun: each rank's local GPU).")
    fsdp: bool = _opt(False, "Shard the draft with FSDP2 under torchrun (large drafts).")
    no_resume_from_checkpoint: bool = _opt(
        False, "Start fresh even if save_path holds a checkpoint."
    )
    resume: str | None = _opt(None, "Resume from this checkpoint directory.")

    def __post_init__(self) -> None:
        if not self.verifier_name_or_path:
            runs = " (--online runs the target inside training)" if self.online else ""
            raise ValueError(f"verifier_name_or_path is required (--verifier-name-or-path){runs}.")
        self._check_online()
        if Path(self.save_path).is_file():
            raise ValueError(
                f"--save-path {self.save_path} is a file, not a directory; choose a new or "
                "empty directory, or the save path of the run to resume."
            )
        for f in fields(self):
            allowed = f.metadata.get("choices")
            if allowed and getattr(self, f.name) not in allowed:
                _fail(f.name, getattr(self, f.name), f"one of {', '.join(allowed)}")
        for name in (
            "num_layers",
            "draft_vocab_size",
            "total_seq_len",
            "epochs",
            "log_freq",
            "keep_checkpoints",
        ):
            check_int_at_least(name, getattr(self, name), 1)
        check_int_at_least("sequence_partitions", self.sequence_partitions, 1)
        for name, low in (
            ("max_steps", 1), ("sliding_window", 1), ("scheduler_warmup_steps", 0),
            ("num_key_value_heads", 1), ("early_stop_patience", 1),
        ):  # fmt: skip
            if getattr(self, name) is not None:
                check_int_at_least(name, getattr(self, name), low)
        if self.autocast != "none" and self.dtype != "float32":
            raise ValueError(
                f"autocast {self.autocast} keeps float32 weights: it needs dtype float32, "
                f"got {self.dtype}."
            )
        if self.num_speculative_tokens is not None and not (
            1 <= self.num_speculative_tokens <= self.num_depths
        ):
            _fail(
                "num_speculative_tokens",
                self.num_speculative_tokens,
                f"an integer in [1, num_depths={self.num_depths}]",
            )
        if not 0 <= self.hard_label_weight <= 1:
            _fail("hard_label_weight", self.hard_label_weight, "a number in [0, 1]")
        if not (self.tv_weight >= 0 and math.isfinite(self.tv_weight)):
            _fail("tv_weight", self.tv_weight, "a finite number >= 0")
        for name, low, off in (
            ("lr", 0.0, ""), ("checkpoint_freq", 0.0, ""),
            ("max_grad_norm", 0.0, " (or none: no clipping)"),
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > low):
                _fail(name, value, f"a finite number > {low:g}{off}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            _fail("weight_decay", self.weight_decay, "a finite number >= 0")
        warmup = self.scheduler_warmup_steps
        if warmup is not None and self.max_steps is not None and warmup > self.max_steps:
            raise ValueError(
                f"scheduler_warmup_steps {warmup} is more than max_steps {self.max_steps}: the "
                "learning rate would never reach lr; use at most max_steps warmup steps."
            )
        if self.early_stop_patience is not None and not self.validation_data_path:
            raise ValueError(
                "early_stop_patience needs validation_data_path: held-out data to score "
                "each checkpoint on."
            )
        if self.validation_data_path and not Path(self.validation_data_path).is_dir():
            raise ValueError(
                f"validation_data_path {self.validation_data_path} is not a directory; give "
                "data made by generate-data for held-out prompts."
            )
        self.cod  # noqa: B018 - validates the algorithm's knobs once, here

    def _check_online(self) -> None:
        """--data-path or --prompts, and no online or reply setting where it does nothing."""
        if self.prompts is not None:
            if not self.online:
                raise ValueError(
                    "--prompts needs --online (offline training reads --data-path, made by "
                    "generate-data)."
                )
            if self.data_path:
                raise ValueError("Pass one of --data-path or --prompts, not both.")
            if not prompt_source_exists(self.prompts):
                raise ValueError(f"--prompts {self.prompts} does not exist.")
        elif not self.data_path:
            instead = "; with --online, --prompts can stand in for it" if self.online else ""
            raise ValueError(f"data_path is required (--data-path){instead}.")
        defaults = {f.name: f.default for f in fields(self)}
        for name, needs, given in (
            *((n, "online", self.online) for n in ONLINE_FIELDS),
            *((n, "prompts", self.prompts is not None) for n in REPLY_FIELDS),
        ):
            if not given and getattr(self, name) != defaults[name]:
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} is used only with --{needs}; drop it or add --{needs}.")
        size = self.online_cache_gib
        if not (isinstance(size, int | float) and math.isfinite(size) and size > 0):
            _fail("online_cache_gib", size, "a finite number > 0")
        check_int_at_least("max_new_tokens", self.max_new_tokens, 1)
        check_int_at_least("num_samples", self.num_samples, 1)

    @property
    def hidden_states_dtype(self) -> str:
        """The batches' hidden states: the autocast dtype (all they meet first is ``fc`` and
        the verifier head, linears that autocast would lower them for), else ``dtype``."""
        return self.dtype if self.autocast == "none" else self.autocast

    @property
    def cod(self) -> CODConfig:
        return CODConfig(
            self.num_depths, self.down_sample_ratio, self.down_sample_ratio_min, self.max_anchors
        )

    @classmethod
    def from_sources(cls, yaml_path: str | None = None, **overrides) -> TrainConfig:
        """Defaults, then the YAML file's keys, then ``overrides`` that are not None.

        An unknown key in the file raises ``ValueError`` naming the key and the file.
        """
        values: dict = {}
        if yaml_path is not None:
            loaded = read_yaml_mapping(yaml_path)
            known = {f.name for f in fields(cls)}
            for key in loaded:
                if key.replace("-", "_") not in known:
                    raise ValueError(
                        f"Unknown key {key!r} in {yaml_path}; allowed: {', '.join(sorted(known))}."
                    )
            values = {k.replace("-", "_"): v for k, v in loaded.items()}
        values.update({k: v for k, v in overrides.items() if v is not None})
        hints = get_type_hints(cls)
        return cls(**{k: _coerce(k, v, hints[k]) for k, v in values.items()})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
