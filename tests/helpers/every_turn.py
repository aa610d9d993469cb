"""Shared by the every-turn tests: ShareGPT-shaped turns, a fake ShareGPT file, words."""

from __future__ import annotations

import json

from speculators_peagle_plugin.data import prompt_sources

VOCAB = "alpha beta gamma delta eps zeta eta theta iota kappa lam mu nu xi".split()


def turn(speaker, text):
    """One ShareGPT turn."""
    return {"from": speaker, "value": text}


def user(text):
    return {"role": "user", "content": text}


def sentence(rng, n):
    """``n`` words of ``VOCAB`` drawn by ``rng``."""
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def sharegpt_file(tmp_path, monkeypatch):
    """A fixture body: yields ``write(rows)``, which makes ``rows`` the ShareGPT file both
    ShareGPT sets read (the parse cache cleared before and after)."""
    path = tmp_path / "sharegpt.json"
    real = prompt_sources.wheel_set_file
    monkeypatch.setattr(
        prompt_sources, "wheel_set_file", lambda name: path if name == "sharegpt" else real(name)
    )

    def write(rows):
        path.write_text(json.dumps(rows))
        clear()

    def clear():
        prompt_sources.sharegpt_first_turns.cache_clear()
        prompt_sources.sharegpt_conversations.cache_clear()

    yield write
    clear()
