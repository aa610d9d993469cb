"""Training data: prompt sets, generate-data (replies + hidden states), reading and packing.

Modules: ``prompts`` (prompt sets, chat rendering), ``config`` (on-disk layout,
``DataGenConfig``), ``generation`` (the target's replies), ``capture`` (hidden states with
transformers), ``capture_vllm`` + ``vllm_connector`` (with vLLM), ``storage`` (disk estimate,
the 8-bit format), ``build`` (``generate_data``), ``dataset`` (opening and checking data),
``packing``.
"""

from .build import generate_data
from .capture import capture_hidden_states
from .config import BACKENDS, DataGenConfig, default_target_layer_ids, hs_path
from .dataset import DataError, TrainingData, open_training_data
from .generation import completion_tokens
from .packing import PackedBatches, pack_rows
from .prompts import PromptSet, load_prompt_set, load_prompts, render_conversation, render_prompts

__all__ = [
    "BACKENDS",
    "DataError",
    "DataGenConfig",
    "PackedBatches",
    "PromptSet",
    "TrainingData",
    "capture_hidden_states",
    "completion_tokens",
    "default_target_layer_ids",
    "generate_data",
    "hs_path",
    "load_prompt_set",
    "load_prompts",
    "open_training_data",
    "pack_rows",
    "render_conversation",
    "render_prompts",
]
