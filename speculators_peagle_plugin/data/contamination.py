"""The contamination guard: training prompts that copy a held-out evaluation prompt.

Generation's reader (:func:`~.prompts.read_training_prompts`) drops, before the target
answers them, the prompts this rule calls contaminated:

- text is normalised: lowercased, every run of non-alphanumeric characters a space, split
  into words (``"Act as a math-teacher."`` -> ``act as a math teacher``);
- a held-out prompt of at least ``RUN`` (8) words is copied by a training prompt holding
  at least ``MIN_SHARE`` (half) of its distinct 8-word runs; a shorter one is copied by a
  training turn equal to it;
- a conversation's runs are taken turn by turn (none spans two turns), and it is
  contaminated when it copies any held-out prompt.

Why, from the sets this package reads (what a set loses: ``read_training_prompts(spec)``'s
record): the usual rule, any shared 13-word run (the GPT-3 and Llama contamination
studies), drops a training prompt for one shared sentence. Here that drops HumanEval/71
(``triangle_area``), a training problem whose signature and first docstring sentence
HumanEval/157 repeats, and at 8 words the same "any run" rule drops ShareGPT and MBPP
prompts for boilerplate: runs of consecutive integers in test lists (``1 2 3 4 5 6 7 8``)
and stock phrases of role-play prompts (the one 8-word run a ShareGPT first turn shares
with MT-Bench's "Act as a math teacher" question is such a phrase, not the question).
Asking for half of a held-out prompt's runs keeps all of those (each holds a small share)
while a copy, whole or wrapped in an instruction or a longer message, holds every run.
With that share, 8-word runs rather than 13 also catch the short held-out prompts, MT-Bench's
second turns and the chat prompts of 8 to 12 words, inside a longer message, where 13 words
would need the message to equal them; neither length drops a ShareGPT human turn, an MBPP
or MATH problem, HumanEval[:120] or chat[:100].

Example: held-out ``"Write a function that returns the sum of the squares of the odd
numbers in a list."`` (17 words, 10 runs); ``"Please help. " + that`` holds all 10 and is
dropped; ``"Write a function that returns the sum of the squares."`` holds 3 and is kept.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

RUN = 8
MIN_SHARE = 0.5
RULE = (
    f"word {RUN}-grams after lowercasing and mapping non-alphanumerics to spaces: a prompt is "
    f"dropped when it holds at least {MIN_SHARE:g} of a held-out prompt's distinct {RUN}-grams, "
    f"or a turn of it equals a held-out prompt shorter than {RUN} words"
)
_NOT_WORD = re.compile(r"[^0-9a-z]+")


def normalise(text: str) -> list[str]:
    """The words of ``text``: lowercased, non-alphanumerics as spaces.

    Example: ``"Act as a math-teacher."`` -> ``["act", "as", "a", "math", "teacher"]``.
    """
    return _NOT_WORD.sub(" ", text.lower()).split()


def word_runs(words: list[str], n: int = RUN) -> set[str]:
    """The distinct runs of ``n`` consecutive words, each joined by spaces.

    Example: ``(["a", "b", "c"], 2)`` -> ``{"a b", "b c"}``; fewer than ``n`` words -> ``set()``.
    """
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


class HeldOutIndex:
    """The held-out prompts' word runs, built once, asked per training conversation.

    Args:
        texts: the held-out prompts (one string per prompt or turn).
        n: words per run.
        min_share: the share of a held-out prompt's runs that makes a copy.

    Example: ``HeldOutIndex(["tell me a joke"]).contaminated(["Tell me a joke!"])`` -> True.
    """

    def __init__(self, texts: Iterable[str], n: int = RUN, min_share: float = MIN_SHARE):
        self.n, self.min_share = n, min_share
        self._owners: dict[str, list[int]] = {}  # run -> the held-out prompts holding it
        self._sizes: list[int] = []  # distinct runs per held-out prompt
        self._short: set[str] = set()  # held-out prompts of fewer than n words, normalised
        for text in texts:
            words = normalise(text)
            runs = word_runs(words, n)
            if not runs:
                if words:
                    self._short.add(" ".join(words))
                continue
            for run in runs:
                self._owners.setdefault(run, []).append(len(self._sizes))
            self._sizes.append(len(runs))

    def contaminated(self, texts: Iterable[str]) -> bool:
        """Whether the conversation of turns ``texts`` copies a held-out prompt (module rule)."""
        runs = set()
        for text in texts:
            words = normalise(text)
            if " ".join(words) in self._short:
                return True
            runs |= word_runs(words, self.n)
        held = Counter(j for run in runs for j in self._owners.get(run, ()))
        return any(count >= self.min_share * self._sizes[j] for j, count in held.items())
