"""Reading a saved draft's speculators ``config.json``: the facts a card, a check and an
export all read the same way.

Example: ``declared_k({"speculators_config": {"proposal_methods": [{"speculative_tokens":
4}]}})`` -> ``4``; a missing or malformed entry -> ``None``.
"""

from __future__ import annotations

__all__ = ["declared_k", "is_int", "object_at"]


def object_at(config: dict, key: str) -> dict:
    """``config[key]`` when it is a JSON object, else an empty one (missing, null, a list)."""
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def declared_k(config: dict) -> int | None:
    """The ``speculative_tokens`` (K) a checkpoint config declares for serving, or ``None``."""
    try:
        k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    except (KeyError, IndexError, TypeError):
        return None
    return k if is_int(k) and k >= 1 else None


def is_int(value) -> bool:
    """A JSON integer (``true`` is a bool in Python, not an id or a count)."""
    return isinstance(value, int) and not isinstance(value, bool)
