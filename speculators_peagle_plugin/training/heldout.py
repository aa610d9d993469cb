"""Teacher-forced loss and accuracy per depth of a trained draft on data it never saw.

The figures are the training log's, computed the same way (the algorithm's trainer over
packed rows, every segment, COD samples from a seeded generator) on another dataset,
without gradients. Per-depth accuracy on held-out replies is what vLLM's per-position
acceptance follows; it costs one pass over the data instead of an engine per draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..data import PackedBatches, open_training_data
from ..model.build import load_reference_draft
from .algorithm import load_algorithm
from .metrics import acceptance_length, depth_accuracy
from .step import autocast_context, cod_generator, to_device
from .train_config import TrainConfig

__all__ = ["heldout_metrics"]


@torch.no_grad()
def heldout_metrics(
    checkpoint: str | Path,
    config: TrainConfig,
    data_path: str | Path,
    *,
    seed: int = 0,
    samples: Sequence[int] | None = None,
) -> dict:
    """Loss and accuracy per depth of ``checkpoint`` on ``data_path`` (speculators format).

    Args:
        checkpoint: a checkpoint directory ``train`` wrote.
        config: the run's settings (algorithm, depths, COD ratios, row length, dtype); its
            ``verifier_name_or_path`` is the local target the checkpoint's embeddings and
            verifier head are read from.
        data_path: held-out data made by ``generate-data`` with the same target and aux
            layers; its rows are packed as training packs them.
        seed: seed of the packing order and of the COD draws (a pure function of it).
        samples: the sample indices of ``data_path`` to score (default: all), e.g. the
            held-out side of :func:`~..data.split_samples`.

    Returns:
        ``{"loss", "accuracy_per_depth" [K], "acceptance_length", "supervised"}``: the
        count-weighted training objective (KL and the config's loss terms), argmax accuracy
        per depth, the greedy-chain estimate from it, and the supervised elements per depth.
    """
    runtime = config.runtime
    device = torch.device(runtime.device)
    draft = load_reference_draft(checkpoint, config.verifier.verifier_name_or_path)
    draft = draft.to(device, getattr(torch, runtime.dtype))
    # every rollout is scored, whichever ones the recipe trained on
    module = load_algorithm(config.algorithm).build_trainer(
        draft, config.replace(greedy_chains=False), mask_token_id=draft.config.mask_token_id
    )
    module.eval()
    data = open_training_data(
        data_path,
        draft_vocab_size=draft.lm_head.out_features,
        verifier_hidden_size=draft.config.target_hidden_size or draft.hidden_size,
        aux_layer_ids=draft.config.eagle_aux_hidden_state_layer_ids,
    )
    states_dtype = getattr(torch, runtime.hidden_states_dtype)
    batches = PackedBatches(
        data, config.data.total_seq_len, seed=seed, samples=samples, rank=0, world_size=1,
        hidden_states_dtype=states_dtype,
    )
    k = module.num_depths
    loss_sum = torch.zeros((), dtype=torch.float64)
    correct, valid = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
    for step in range(len(batches)):
        batch = to_device(batches.batch(0, step), device, states_dtype)
        module.generator = cod_generator(seed, step, 0, device)
        for segment in module.segments(batch):
            with autocast_context(runtime, device):
                metrics = module.forward_batch(batch, segment)
            loss_sum += metrics.loss_sum.double().cpu()
            correct += metrics.correct.double().cpu()
            valid += metrics.valid.double().cpu()
    accuracy = depth_accuracy(correct, valid)
    return {
        "loss": float(loss_sum / valid.sum().clamp(min=1)),
        "accuracy_per_depth": accuracy.tolist(),
        "acceptance_length": acceptance_length(accuracy),
        "supervised": valid.long().tolist(),
    }
