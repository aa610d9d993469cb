"""speculators 0.9.0's ``train`` YAML read by ``speculators-peagle train --config``.

speculators nests its keys in groups (``verifier``, ``draft``, ``data``, ``loss``, ...;
``speculators/train/config/schema.py``), optionally under a top-level ``train:`` stage
block, and its ``run.yaml`` holds only the keys a run set. :data:`SPECULATORS_KEYS` answers
every key of that schema: it sets our setting of the same meaning (the same name unless
said), it is accepted only at the values that mean what ours does, or it has no effect
here and says so, as speculators itself ignores the groups of other algorithms.
:func:`from_speculators` turns such a mapping into our flat keys; keys speculators does
not have (ours, in any group or flat) pass through unchanged. docs/speculators_keys.md is
:func:`render_table`; tests/test_speculators_keys.py walks speculators' own schema.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from speculators.train.config.schema import TrainConfig as SpeculatorsTrainConfig

from ..common.errors import UserError

logger = logging.getLogger(__name__)

__all__ = ["SPECULATORS_KEYS", "Answer", "from_speculators", "render_table"]


@dataclass(frozen=True)
class Answer:
    """What one speculators key does here.

    ``ours``: the key of ours it sets (None: none); ``accepted``: the values taken (None:
    any); ``convert``: speculators' value to ours; ``note``: the why, for the table and
    for the one sentence refusing a value; ``ignored``: taken, with no effect (a warning).
    """

    ours: str | None = None
    accepted: tuple | None = None
    convert: Callable | None = None
    note: str = ""
    ignored: bool = False

    def kind(self) -> str:
        if self.ignored:
            return "no effect here"
        if self.ours is None:
            return "only " + ", ".join(_show(v) for v in self.accepted or ())
        return (
            "works"
            if self.accepted is None
            else "works for " + ", ".join(_show(v) for v in self.accepted)
        )


def _show(value) -> str:
    if value is None or value == "":
        return "unset"
    return f"`{value}`"


SAME = object()  # placeholder: our key of the same name


def _works(note: str = "", ours=SAME, accepted=None, convert=None) -> Answer:
    return Answer(ours, accepted, convert, note)


def _only(*accepted, note: str) -> Answer:
    return Answer(None, accepted, None, note)


def _ignored(note: str) -> Answer:
    return Answer(None, None, None, note, ignored=True)


def _endpoints(value) -> tuple:
    return (value,) if isinstance(value, str) else tuple(value)


def _autocast_of(dtype: str) -> str:
    return {"bfloat16": "bfloat16", "float32": "none"}[dtype]


_OTHER_ALGORITHM = "a group of another algorithm: speculators ignores it for peagle too"
_BACKENDS = (
    "hidden states are files: generate-data's, or those a vLLM server's connector writes "
    "(plain or 8-bit, both read by hs_connectors' FP8Transfer); Mooncake is not offered"
)
_VOCAB_FROM_DATA = "the draft vocabulary is counted from the data (its token_freq.pt)"

# Every key of speculators 0.9.0's TrainConfig, as "group.key" (root keys bare).
SPECULATORS_KEYS: dict[str, Answer] = {
    "speculator_type": _only("peagle", note="this command trains P-EAGLE drafts (--algorithm)"),
    "dry_run": _only(False, note="not offered: --max-steps 1 runs one step"),
    "seed": _works(),
    "deterministic_cuda": _only(False, note="not offered"),
    "verifier.verifier_name_or_path": _works(),
    "verifier.trust_remote_code": _only(
        False, note="targets load with transformers' own architectures only"
    ),
    "draft.from_pretrained": _works("our checkpoints or speculators' drafts"),
    "draft.draft_config": _only("", note="the draft is built from the target and these keys"),
    "draft.num_layers": _works("ours defaults to 1, speculators' to the draft config's"),
    "draft.draft_arch": _works(),
    "draft.draft_hidden_act": _only("silu", note="the draft's MLP is SiLU, as vLLM's"),
    "draft.draft_mrope_full_head_hack": _ignored("only for multimodal-rope targets, not built"),
    "draft.target_layer_ids": _works(),
    "draft.token_freq_path": _only(None, note=_VOCAB_FROM_DATA),
    "draft.draft_vocab_size": _works(),
    "draft.d2t_path": _only(None, note=_VOCAB_FROM_DATA),
    "draft.t2d_path": _only(None, note=_VOCAB_FROM_DATA),
    "draft.mask_token_id": _works(),
    "draft.norm_before_residual": _works("ours defaults to False (vLLM's), speculators' to True"),
    "draft.embed_requires_grad": _works(),
    "draft.norm_before_fc": _only(None, False, note="the draft has no norm before fc"),
    "draft.fc_norm": _only(False, note="the draft has no norm after fc"),
    "draft.norm_output": _ignored(
        "Eagle 3.1 feeds post-norm states back across TTT steps; P-EAGLE drafts every depth "
        "in one pass, and the logits are the same either way"
    ),
    "draft.sliding_window": _works(),
    "draft.full_attention_indices": _works(convert=tuple),
    "draft.sliding_window_non_causal": _only(None, False, note="COD attention is causal"),
    "draft.draft_attn_impl": _only(
        "simple_flex_attention",
        note="flex attention (CUDA) or the exact block-sparse kernel (CPU) is chosen per device",
    ),
    "data.data_path": _works(),
    "data.hidden_states_backend": _only("file", "fp8", note=_BACKENDS),
    "data.total_seq_len": _works(),
    "data.train_data_ratio": _works("ours defaults to 1.0 (no split), speculators' to 0.9"),
    "data.hidden_states_dtype": _works(
        "sets --autocast: bfloat16 = float32 weights with bfloat16 autocast, as speculators; "
        "ours defaults to no autocast",
        ours="autocast",
        accepted=("bfloat16", "float32"),
        convert=_autocast_of,
    ),
    "data.num_workers": _ignored("rows are read one step ahead on a thread"),
    "data.prefetch_factor": _ignored("rows are read one step ahead on a thread"),
    "data.max_anchors": _works("ours defaults to no cap, speculators' to 512"),
    "generation.vllm_endpoint": _works(
        "--vllm-endpoint may be repeated: rows go to the servers in turn (docs/training.md)",
        convert=_endpoints,
    ),
    "generation.on_missing": _works(),
    "generation.on_generate": _works(),
    "generation.request_timeout": _works(),
    "generation.max_retries": _works(),
    "generation.generation_validation_retries": _works(),
    "generation.max_consecutive_generation_failures": _works(),
    "loss.loss_implementation": _ignored("one fused-linear KL loss; both give the same values"),
    "loss.loss_fn": _only(
        None,
        "kl_div",
        note="the loss is forward KL to the target (--tv-weight, --hard-label-weight add terms)",
    ),
    "loss.ttt_steps": _ignored("EAGLE-3's unrolling; P-EAGLE drafts all depths in one pass"),
    "loss.ttt_step_loss_decay": _ignored(
        "EAGLE-3's unrolling; P-EAGLE drafts all depths in one pass"
    ),
    "optimizer.optimizer": _works(),
    "optimizer.lr": _works(),
    "optimizer.weight_decay": _works(),
    "optimizer.muon_lr": _works(),
    "optimizer.muon_momentum": _works(),
    "optimizer.muon_weight_decay": _works(),
    "optimizer.muon_ns_steps": _works(),
    "optimizer.muon_adjust_lr_fn": _works(),
    "scheduler.scheduler_type": _works(),
    "scheduler.scheduler_warmup_steps": _works("ours defaults to 1% of the steps"),
    "scheduler.scheduler_warmup_ratio": _works(),
    "scheduler.scheduler_total_steps": _only(
        None, note="the schedule spans the run's steps (--max-steps or the epochs)"
    ),
    "scheduler.scheduler_num_cosine_cycles": _only(
        0.5, note="the cosine schedule is half a cycle, to 0 at the last step"
    ),
    "trainer.epochs": _works(),
    "trainer.checkpoint_freq": _works(),
    "trainer.save_best": _works(
        "unset: on whenever there is validation (speculators: off); the best is ranked by "
        "estimated acceptance, speculators' by validation loss"
    ),
    "trainer.no_resume_from_checkpoint": _works(),
    "trainer.log_freq": _works(),
    "trainer.save_path": _works(),
    "trainer.fsdp_shard": _works("sets --fsdp", ours="fsdp"),
    "trainer.gradient_checkpointing": _works(),
    "trainer.max_steps": _works(),
    "logging.logger": _works(),
    "logging.log_dir": _works(),
    "logging.run_name": _works(),
    "peagle.num_depths": _works(),
    "peagle.down_sample_ratio": _works(),
    "peagle.down_sample_ratio_min": _works(),
}
for _group in ("dflash", "dflash2", "dspark", "xpress", "mtp"):
    for _key in SpeculatorsTrainConfig.model_fields[_group].annotation.model_fields:
        SPECULATORS_KEYS[f"{_group}.{_key}"] = _ignored(_OTHER_ALGORITHM)
SPECULATORS_KEYS = {
    name: replace(a, ours=name.rsplit(".", 1)[-1]) if a.ours is SAME else a
    for name, a in SPECULATORS_KEYS.items()
}
GROUPS = sorted({name.split(".")[0] for name in SPECULATORS_KEYS if "." in name})


def from_speculators(values: Mapping, source: object = None) -> dict:
    """Our keys from a mapping that may be speculators-shaped (see the module docstring).

    A ``train:`` block is the config (its sibling stages are left, as speculators leaves
    them). Raises ``ValueError`` with one sentence for a value we do not take.
    """
    if isinstance(values.get("train"), Mapping):
        values = values["train"]
    where = f" in {source}" if source is not None else ""
    out: dict = {}
    for key, value in values.items():
        if key in GROUPS and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                name = f"{key}.{sub}"
                if name in SPECULATORS_KEYS:
                    _apply(name, sub_value, out, where)
                else:  # a key of ours under our section of that name (build checks it)
                    out.setdefault(key, {})[sub] = sub_value
        elif key in SPECULATORS_KEYS:
            _apply(key, value, out, where)
        else:
            out[key] = value
    return out


def _apply(name: str, value, out: dict, where: str) -> None:
    answer = SPECULATORS_KEYS[name]
    if answer.ignored:
        logger.warning("speculators key %s%s has no effect here: %s.", name, where, answer.note)
        return
    if answer.accepted is not None and value not in answer.accepted:
        shown = [str(v) for v in answer.accepted if v not in (None, "")]
        instead = f" or give {' or '.join(shown)}" if shown else ""
        raise UserError(
            f"speculators key {name}: {value!r}{where} is not taken here ({answer.note}); "
            f"leave it out{instead}."
        )
    if answer.ours is not None:
        out[answer.ours] = answer.convert(value) if answer.convert else value


def render_table() -> str:
    """The markdown table of docs/speculators_keys.md: every key and our answer."""
    rows = ["| speculators key | here | ours / why |", "|---|---|---|"]
    for name, answer in SPECULATORS_KEYS.items():
        ours = (
            ""
            if answer.ours is None or answer.ours == name.rsplit(".", 1)[-1]
            else (f"`{answer.ours}`; ")
        )
        rows.append(f"| `{name}` | {answer.kind()} | {ours}{answer.note} |")
    return "\n".join(rows) + "\n"
