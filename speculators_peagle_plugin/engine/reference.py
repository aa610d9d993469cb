"""Reference P-EAGLE runtime: parallel drafting + greedy verification in torch/transformers.

For machines without vLLM, and as an independent check that the draft trained here is
served the way it was trained. It reproduces vLLM's parallel-drafting EAGLE proposer
(``vllm/v1/spec_decode/llm_base_proposer.py`` + ``copy_and_expand_eagle_inputs_kernel``
in ``vllm/v1/spec_decode/utils.py``) slot for slot. After the target commits tokens
``x_0 .. x_{p+1}`` (``x_{p+1}`` is the bonus token it just chose) with aux states
``h_0 .. h_p``, the draft runs one forward over:

    slot                  token              hidden (before ``fc``)   position
    context ``t < p``     ``x_{t+1}``        ``h_t``                  ``t``
    bonus                 ``x_{p+1}``        ``h_p``                  ``p``
    mask ``1 <= i < K``   ``mask_token_id``  ``mask_hidden``          ``p + i``

with causal attention; the logits of slots ``p .. p+K-1`` are the K drafts for positions
``p+2 .. p+K+1``. The target then scores ``[x_{p+1}, d_1 .. d_K]`` in one forward and
keeps the longest prefix of drafts equal to its own greedy choices plus one token of its
own (the next bonus). vLLM keeps the draft's KV cache, rewriting each position with its
context slot as soon as the token there is committed; recomputing the draft over all
context slots every step, as here, gives the same keys and values.

The draft forward is :meth:`PEagleDraftModel.forward_peagle` itself with the slots
described as one COD chain (context = depth 0 anchored at ``t``; mask slot ``i`` = depth
``i`` anchored at ``p``): the P-EAGLE mask then reduces to exactly this causal mask, so an
agreement with vLLM also shows that the training forward is the serving forward.

Legend: ``p`` = last committed position with a target hidden state, ``K`` = drafts per
step, ``V`` / ``V_d`` = target / draft vocabulary, ``H_t`` = target hidden size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig

from ..common.errors import UserError
from ..model.build import load_reference_draft
from ..model.target import FinalNormInput, eos_token_ids
from .counters import SpecDecodeCounters

__all__ = [
    "ReferenceRuntime",
    "stop_token_ids",
]


def stop_token_ids(target_dir: str | Path, tokenizer=None) -> set[int]:
    """The ids that end a greedy request, as vLLM stops on them
    (:func:`~speculators_peagle_plugin.model.target.eos_token_ids` of the target's
    ``generation_config.json``, when it has one, and ``tokenizer``)."""
    try:
        generation_config = GenerationConfig.from_pretrained(str(target_dir))
    except OSError:  # no generation_config.json
        generation_config = None
    return set(eos_token_ids(tokenizer, generation_config))


class _TargetWithAux:
    """The target with a KV cache, returning logits and the draft's aux states.

    Aux layer ids follow :mod:`~speculators_peagle_plugin.model.target`: ``hidden_states[L]``
    for ``L < N``, and the final norm's input for ``L = N``.
    """

    def __init__(self, model, layer_ids: Sequence[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.num_layers = model.config.num_hidden_layers
        self._pre_norm = FinalNormInput(model)  # lives as long as the runtime

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, cache: DynamicCache):
        """``ids [n]`` after ``cache`` -> ``(logits [n, V], aux [n, n_aux*H_t] or None)``."""
        want_aux = bool(self.layer_ids)
        out = self.model(
            input_ids=ids[None], past_key_values=cache, use_cache=True,
            output_hidden_states=want_aux,
        )
        if not want_aux:
            return out.logits[0].float(), None
        states = [
            self._pre_norm.value if i == self.num_layers else out.hidden_states[i]
            for i in self.layer_ids
        ]
        return out.logits[0].float(), torch.cat(states, dim=-1)[0]


class ReferenceRuntime:
    """Greedy speculative decoding of one target with an optional P-EAGLE draft.

    Args:
        target_dir: a local transformers causal-LM directory.
        draft_dir: a speculators-format P-EAGLE checkpoint, or ``None`` for plain greedy
            decoding (the baseline).
        num_speculative_tokens: ``K`` drafts per step (required with a draft).
        dtype: weights and activations (float32 to compare with vLLM in float32).

    Example::

        rt = ReferenceRuntime("target/", "draft/", num_speculative_tokens=4)
        tokens, counters = rt.generate([1, 2, 3], max_new_tokens=64)
        counters.acceptance_length  # 1 + accepted / drafts
    """

    def __init__(
        self,
        target_dir: str | Path,
        draft_dir: str | Path | None = None,
        num_speculative_tokens: int | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
        self.draft = None
        layer_ids: list[int] = []
        if draft_dir is not None:
            if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
                raise UserError(
                    "num_speculative_tokens must be an integer >= 1 with a draft, "
                    f"got {num_speculative_tokens!r}."
                )
            self.draft = load_reference_draft(draft_dir, target_dir, dtype)
            layer_ids = list(self.draft.config.eagle_aux_hidden_state_layer_ids)
            # chunked = the exact CPU path; flex needs a compiled kernel to be fast.
            self.draft.attention_impl = "chunked"
        self.num_speculative_tokens = num_speculative_tokens
        self.target = _TargetWithAux(model, layer_ids)
        self.dtype = dtype

    @torch.no_grad()
    def draft_logits(self, tokens: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the K drafting slots (bonus + K-1 mask slots).

        Args:
            tokens: ``[p + 2]`` committed tokens, the last one the bonus token.
            aux: ``[p + 1, n_aux*H_t]`` the target's aux states at positions ``0..p``.

        Returns:
            ``[K, V_d]`` logits of slots ``p .. p+K-1``.
        """
        draft, k = self.draft, self.num_speculative_tokens
        n_ctx = aux.shape[0]  # p + 1
        ids = torch.cat([tokens[1:], tokens.new_full((k - 1,), draft.mask_token_id)])
        hidden = torch.cat(
            [
                draft.project_hidden_states(aux.to(self.dtype)),
                draft.masked_projected_hidden().expand(k - 1, -1),
            ]
        )
        # One COD chain: context = depth 0 at anchor t; mask slot i = depth i at anchor p.
        anchor = torch.cat([torch.arange(n_ctx), torch.full((k - 1,), n_ctx - 1)])
        depth = torch.cat([torch.zeros(n_ctx, dtype=torch.long), torch.arange(1, k)])
        length = n_ctx + k - 1
        masks = draft.build_peagle_block_mask(anchor, depth, torch.tensor([length]), length)
        out = draft.forward_peagle(ids[None], hidden[None], (anchor + depth)[None], masks)[0]
        return draft.compute_logits(out[n_ctx - 1 :])

    def propose(self, tokens: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """The K greedy drafts as target-vocabulary ids ``[K]`` (see :meth:`draft_logits`)."""
        drafts = self.draft_logits(tokens, aux).argmax(-1)
        if self.draft.d2t is not None:  # offsets: target id = draft id + d2t[draft id]
            drafts = drafts + self.draft.d2t[drafts]
        return drafts

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: set[int] | frozenset[int] = frozenset(),
        counters: SpecDecodeCounters | None = None,
    ) -> tuple[list[int], SpecDecodeCounters]:
        """Greedy decode ``prompt_ids``; returns ``(new tokens, counters)``.

        Stops after ``max_new_tokens`` tokens or at the first id in ``stop_ids`` (kept,
        as vLLM keeps eos in the output ids). Every verify step drafts ``K`` tokens and
        is counted in full, even the last one, as vLLM's scheduler does.
        """
        counters = counters if counters is not None else SpecDecodeCounters()
        cache = DynamicCache()
        prompt = torch.tensor(list(prompt_ids), dtype=torch.long)
        logits, aux = self.target(prompt, cache)
        tokens = torch.cat([prompt, logits[-1:].argmax(-1)])
        out = [int(tokens[-1])]
        while len(out) < max_new_tokens and out[-1] not in stop_ids:
            if self.draft is None:
                logits, _ = self.target(tokens[-1:], cache)
                new = logits.argmax(-1)
                num_accepted = None
            else:
                drafts = self.propose(tokens, aux)
                k = drafts.shape[0]
                logits, new_aux = self.target(torch.cat([tokens[-1:], drafts]), cache)
                greedy = logits.argmax(-1)  # [K + 1]
                match = (greedy[:k] == drafts).long()
                num_accepted = int(match.cumprod(0).sum())
                counters.observe(k, num_accepted)
                new = torch.cat([drafts[:num_accepted], greedy[num_accepted : num_accepted + 1]])
                # Keep states of the bonus token and the accepted drafts; drop the rest.
                aux = torch.cat([aux, new_aux[: num_accepted + 1]])
                if num_accepted < k:
                    cache.crop(num_accepted - k)  # drop the rejected drafts' entries
            tokens = torch.cat([tokens, new])
            for t in new.tolist():
                if len(out) >= max_new_tokens or (out and out[-1] in stop_ids):
                    break
                out.append(t)
        return out, counters

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_ids: set[int] | frozenset[int] = frozenset(),
        on_prompt: Callable[[int, SpecDecodeCounters], None] | None = None,
    ) -> dict:
        """Decode every prompt; the result has the vLLM worker's JSON keys.

        ``on_prompt(new_tokens, counters)`` is called after each prompt (progress bars).
        """
        counters = SpecDecodeCounters()
        outputs, start = [], time.perf_counter()
        for prompt in prompts:
            new, counters = self.generate(prompt, max_new_tokens, stop_ids, counters)
            outputs.append(new)
            if on_prompt is not None:
                on_prompt(len(new), counters)
        wall = time.perf_counter() - start
        k = self.num_speculative_tokens if self.draft is not None else 0
        if len(counters.accepted_per_pos) < k:
            counters.accepted_per_pos += [0] * (k - len(counters.accepted_per_pos))
        return {
            "backend": "reference",
            "num_speculative_tokens": k,
            "counters": counters.to_dict() if self.draft is not None else None,
            "output_tokens": sum(len(o) for o in outputs),
            "wall_s": wall,
            "outputs": outputs,
        }
