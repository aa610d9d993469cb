"""Config fields that are also command-line flags.

A field's help text, choices and flag name live in its metadata, so a command's options
are generated from its config class and each default is written once, in the dataclass.
"""

from __future__ import annotations

from dataclasses import MISSING, field


def flag_field(default=MISSING, help: str = "", factory=None, **meta):  # noqa: A002 - click's word
    """A dataclass field and its ``--flag``: no ``default`` and no ``factory`` = required.

    ``meta``: ``flag`` (the long option when it is not ``--field-name``), ``short``,
    ``choices``, ``multiple`` (repeatable), ``ints`` (a comma-separated list of integers),
    ``negate`` (a switch that sets the field to False), ``show`` (the default as the help
    shows it; ``None``: not shown; absent: the default itself).
    """
    metadata = {"help": help, **meta}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)
