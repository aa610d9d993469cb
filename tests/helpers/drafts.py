"""One P-EAGLE draft config for the tiny drafts of ``tiny`` and ``tiny_vllm``."""

from __future__ import annotations

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.peagle.config import PEagleSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig


def peagle_config(layer_config, *, num_depths, draft_vocab, layer_ids, mask_token, verifier_path,
                  **options) -> PEagleSpeculatorConfig:  # fmt: skip
    """speculators' config of a draft with ``layer_config``'s decoder, greedy ``num_depths``
    tokens, aux layers ``layer_ids`` and a llama verifier at ``verifier_path``."""
    verifier = VerifierConfig(
        name_or_path=None if verifier_path is None else str(verifier_path),
        architectures=["LlamaForCausalLM"],
    )
    proposal = GreedyTokenProposalConfig(speculative_tokens=num_depths)
    return PEagleSpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=draft_vocab,
        eagle_aux_hidden_state_layer_ids=list(layer_ids),
        mask_token_id=mask_token,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[proposal],
            default_proposal_method="greedy",
            verifier=verifier,
        ),
        **options,
    )
