"""The floating-point dtypes the product accepts, by the name users type."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)
