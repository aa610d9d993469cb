"""The seed contract's import surface: every name the seed documents list, from one module.

The seeds are NeMo AutoModel's ``peagle_attention``, ``peagle_data``, ``peagle_draft`` and
``peagle_trainer`` modules. Each name they list lives in the module of ours that owns it
(:data:`SEED_NAMES`) and stays importable there; this module re-exports them all, the
private ones included (``_PeaglePlan``, ``_kl_div_loss``, the ``_Peagle*Mixin`` classes, the
flex-attention helpers), so that no ``__all__`` of the package lists a private name::

    from speculators_peagle_plugin.seed_api import PEagleTrainerModule, _kl_div_loss

A name is read from its owner when it is asked for: a module-level flag such as
``_peagle_flex_attention_compile_failed`` reads its current value, and importing this
module imports nothing else.
"""

from __future__ import annotations

import importlib

# seed module -> {a name it lists: the module of ours that holds it}
SEED_NAMES: dict[str, dict[str, str]] = {
    "peagle_attention": {"create_peagle_mask_mod": "core.peagle_attention"},
    "peagle_data": {
        "assign_cod_segments": "core.peagle_data",
        "generate_cod_sample_indices": "core.peagle_data",
    },
    "peagle_draft": {
        "_PeagleAttentionMixin": "model.peagle_draft",
        "_PeagleDecoderLayerMixin": "model.peagle_draft",
        "_PeagleDraftMixin": "model.peagle_draft",
        "_PeagleVanillaLayerMixin": "model.peagle_draft",
        "_peagle_compile_supported": "kernels.flex",
        "_peagle_flex_attention": "kernels.flex",
        "_peagle_flex_attention_compile_failed": "kernels.flex",
        "_peagle_flex_attention_compiled": "kernels.flex",
        "logger": "kernels.flex",
    },
    "peagle_trainer": {
        "PEagleTrainerModule": "training.peagle_trainer",
        "_PeaglePlan": "training.peagle_trainer",
        "_kl_div_loss": "training.peagle_trainer",
    },
}
_OWNER = {name: owner for names in SEED_NAMES.values() for name, owner in names.items()}


def __getattr__(name: str):
    if name not in _OWNER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__package__}.{_OWNER[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_OWNER})
