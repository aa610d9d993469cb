"""The target (verifier) model as a draft needs it: where a reply ends, and the
last hidden state before the final norm.

Aux layer id ``L`` is the residual stream after ``L`` decoder layers (transformers'
``hidden_states[L]``, vLLM's ``_maybe_add_hidden_state``). For ``L = N`` transformers
reports the stream AFTER the final norm, while the draft is trained on (and vLLM passes)
the stream before it: :class:`FinalNormInput` captures that one with a hook.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.errors import UserError
from ..common.settings import setting


@dataclass(frozen=True)
class VerifierConfig:
    """The ``verifier`` section: the target model whose drafts are trained."""

    verifier_name_or_path: str = setting(
        "", "Local directory of the target (verifier) model.", path=True
    )


def eos_token_ids(tokenizer, generation_config) -> list[int]:
    """The ids that end a reply, sorted: the tokenizer's eos plus ``generation_config``'s.

    vLLM stops on the tokenizer's ``eos_token_id`` and adds ``generation_config.json``'s
    ``eos_token_id`` (an int or a list) as stop ids; generation and the reference runtime
    stop on the same set. Example: tokenizer eos 2, generation_config ``[2, 7]`` -> ``[2, 7]``.
    """
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = None if generation_config is None else generation_config.eos_token_id
    if eos is not None:
        ids.update(int(i) for i in (eos if isinstance(eos, list | tuple) else [eos]))
    return sorted(ids)


class FinalNormInput:
    """Records the input of the decoder's final ``norm`` on every forward of ``model``.

    ``value`` is that input of the latest forward, ``[B, L, H]``: the final residual stream
    before the norm. Use as a context manager, or call :meth:`remove` when done.
    """

    def __init__(self, model: torch.nn.Module):
        decoder = model.get_decoder()
        norm = getattr(decoder, "norm", None)
        if norm is None:
            raise UserError(
                f"{type(decoder).__name__} has no final `norm` module to capture the last hidden "
                "state before it."
            )
        self.value: torch.Tensor | None = None
        self._handle = norm.register_forward_pre_hook(self._record)

    def _record(self, _module, args) -> None:
        self.value = args[0]

    def remove(self) -> None:
        self._handle.remove()

    def __enter__(self) -> FinalNormInput:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def load_target_model(path, dtype: torch.dtype, device) -> torch.nn.Module:
    """The target as a frozen transformers causal LM in ``dtype`` on ``device``, in eval mode.

    Every place that runs the target for data (reply generation, offline capture, online
    training) loads it here, so they compute with the same weights, dtype and attention.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval().requires_grad_(False)
