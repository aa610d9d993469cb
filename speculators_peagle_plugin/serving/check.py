"""Checkpoint checker: every way vLLM would reject or silently mis-serve a draft.

The rules come from vLLM's loading path for ``speculators_model_type: "peagle"``
(``vllm/transformers_utils/configs/speculators/{base,algos}.py``,
``vllm/model_executor/models/{llama,qwen3}_eagle3.py``, ``vllm/v1/worker/gpu_model_runner.py``).
:func:`check_checkpoint` runs them in order and returns one :class:`Finding` per problem,
each with its fix; :func:`~.export.export_checkpoint` applies the mechanical fixes.

Each rule is a function of the :class:`~.check_config.CheckedDraft` being checked that
returns its findings: the config rules (:mod:`.check_config`), then the weights
(:mod:`.check_weights`), the target (:mod:`.check_target`) and the model card
(:mod:`.check_card`); :data:`_RULES` lists them in
report order. A gate's finding ends the check, because what follows cannot be judged
without what it found missing.

Example::

    for f in check_checkpoint("ckpt/", target_dir="target/"):
        print(f)        # error [mask-hidden]: ... Fix: ...
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import UserError
from ..common.settings import Settings, setting
from .check_card import card_findings
from .check_config import CONFIG_GATES, CONFIG_RULES, LAYER_TYPES, CheckedDraft, Rule
from .check_target import check_target
from .check_weights import check_weights
from .draft_checkpoint import (
    CPU_HEAD_DIMS,
    DraftCheckpoint,
    Finding,
    default_device,
    resolve_target,
    trained_depths,
)

__all__ = [
    "CPU_HEAD_DIMS",
    "DEVICES",
    "LAYER_TYPES",
    "Finding",
    "check_checkpoint",
    "run_rules",
    "trained_depths",
]

DEVICES = ("cpu", "cuda", "any")  # where a draft will be served; any = no device rules


@dataclass(frozen=True, kw_only=True)
class ServedDraft(Settings):
    """A checkpoint, the target it drafts for and the device it will be served on."""

    checkpoint: str = setting(help="The draft checkpoint directory.", argument=True)
    target: str | None = setting(
        None, "Local target directory.", show="the checkpoint's verifier"
    )
    device: str | None = setting(
        None, "Serving device; cpu checks CPU head dims.", choices=DEVICES, show="this machine"
    )


@dataclass(frozen=True, kw_only=True)
class CheckConfig(ServedDraft):
    """What ``speculators-peagle check`` checks."""

    num_speculative_tokens: int | None = setting(
        None, "K it will be served with.", short="-k", show=None
    )


def check_checkpoint(
    draft_dir: str | Path,
    target_dir: str | Path | None = None,
    *,
    num_speculative_tokens: int | None = None,
    device: str | None = None,
    scan_values: bool = True,
) -> list[Finding]:
    """Every reason vLLM would reject or silently mis-serve ``draft_dir``, errors first.

    Args:
        draft_dir: a speculators-format checkpoint directory.
        target_dir: the local target; defaults to the checkpoint's verifier path when
            that is a local directory. Without one, target checks are skipped (warning).
        num_speculative_tokens: the K it will be served with (warns past the trained K).
        device: where it will be served: ``cpu`` also checks head dims against vLLM's
            CPU attention, ``cuda`` / ``any`` do not; default: ``cuda`` if available.
        scan_values: also read every tensor for NaN/Inf (never-loaded or diverged weights).

    Raises ``ValueError`` for a missing directory or unreadable config (bad input);
    everything else is a finding.
    """
    if device not in (None, *DEVICES):
        allowed = f"{', '.join(DEVICES[:-1])} or {DEVICES[-1]}"
        raise UserError(f"device must be {allowed}, got {device!r}.")
    ckpt = DraftCheckpoint.read(draft_dir)
    target = resolve_target(ckpt, target_dir)
    findings = run_rules(
        ckpt, target, num_speculative_tokens, device or default_device(), scan_values
    )
    return sorted(findings, key=lambda f: f.severity != "error")


def run_rules(
    ckpt: DraftCheckpoint, target: Path | None, k: int | None, device: str, scan_values: bool
) -> list[Finding]:
    """The findings of every rule, in rule order, up to the first gate that finds one."""
    draft = CheckedDraft(ckpt, target, k, device, scan_values)
    found: list[Finding] = []
    for rule in _RULES:
        new = list(rule(draft))
        found += new
        if new and rule in CONFIG_GATES:
            break
    return found


def _weights(d: CheckedDraft) -> Iterable[Finding]:
    return check_weights(d.ckpt, d.scan_values)


def _target(d: CheckedDraft) -> Iterable[Finding]:
    return check_target(d.config, d.target, d.device)


def _card(d: CheckedDraft) -> Iterable[Finding]:
    return card_findings(d.ckpt)


_RULES: tuple[Rule, ...] = (*CONFIG_RULES, _weights, _target, _card)
