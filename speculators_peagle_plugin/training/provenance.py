"""How a checkpoint was made, as its model card states it (:mod:`..model.model_card`).

The recipe is the run's settings marked ``card`` (:func:`~..common.settings.setting`):
the draft's shape, the COD knobs, the optimizer and how long it trained, each by its key.
"""

from __future__ import annotations

from ..common.reading import read_json
from ..common.settings import keys_with
from ..data.layout import SETTINGS_FILE
from .online_data import online_data_path
from .train_config import TrainConfig

__all__ = ["how_it_was_made"]


def how_it_was_made(config: TrainConfig, step: int) -> dict:
    """The model card's account of a checkpoint: its data's generation settings (from the
    data directory, or the replies ``--online --prompts`` generated), recipe and steps.

    Example: a run with ``lr: 0.001`` saved at step 40 -> ``{"steps": 40, "data_path":
    "data", "recipe": {"num_layers": 1, ..., "lr": 0.001, ...}}``.
    """
    values = config.to_dict()
    recipe = {key: values[key] for key in keys_with(TrainConfig, "card")}
    made = {"steps": step, "data_path": config.data.data_path or None, "recipe": recipe}
    settings = online_data_path(config) / SETTINGS_FILE
    if (config.online.prompts or config.data.data_path) and settings.is_file():
        made["data"] = read_json(settings)
    return made
