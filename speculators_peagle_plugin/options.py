"""Every command's options, generated from its config's settings, and the one error handler.

A setting's metadata (:func:`~.common.settings.setting`) gives its flag, help, choices and
shown default; its type gives how the text is read (``none`` clears an optional setting).
``--config FILE.yaml`` gives any setting by its key; flags override the file.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from contextlib import contextmanager
from dataclasses import MISSING
from pathlib import Path
from typing import get_args, get_origin

import click

from .common.errors import TRACEBACK_ENV, UserError, bug_report_line, one_sentence
from .common.paths import check_output_dir
from .common.reading import read_yaml_mapping
from .common.settings import Leaf, build, flatten, leaves

_METAVARS = {int: "INTEGER", float: "FLOAT", str: "TEXT"}
_NOT_GIVEN = object()


@contextmanager
def user_errors():
    """Bad input, a full disk, too little memory, a failed engine or stage: ``Error: <one
    sentence>``, exit 1 (with its traceback too under ``SPECULATORS_PEAGLE_TRACEBACK=1``).
    Any other exception is a bug: its traceback, then :func:`bug_report_line`, exit 1."""
    try:
        yield
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except Exception as exc:  # noqa: BLE001 - every error is either a sentence or a bug
        sentence = one_sentence(exc)
        if sentence is None or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            traceback.print_exception(exc, file=sys.stderr)
        if sentence is not None:
            raise click.ClickException(sentence) from None
        click.echo(bug_report_line(), err=True)
        raise SystemExit(1) from None


def check_output_paths(config) -> None:
    """Every output directory setting of ``config`` (metadata ``output``) can be made and
    written, refused naming its flag. ``output`` is True, or the key of the setting without
    which the path is not used (``log_dir``: ``logger``)."""
    values = flatten(config)
    for leaf in leaves(type(config)):
        when = leaf.field.metadata.get("output")
        if when and values[leaf.key] and (when is True or values.get(when)):
            check_output_dir(leaf.flag, values[leaf.key])


class SettingOption(click.Option):
    """A setting's option. A required setting is checked by its config (``--config`` may
    give it), so click only marks it in the help."""

    def __init__(self, *args, setting_required: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.setting_required = setting_required

    def get_help_extra(self, ctx):
        extra = super().get_help_extra(ctx)
        if self.setting_required:
            extra["required"] = "required"
        return extra


def _base(hint):
    args = get_args(hint)
    return next(a for a in args if a is not type(None)) if type(None) in args else hint


def _decorator(leaf: Leaf, repr_defaults: bool):
    meta = leaf.field.metadata
    shown = repr(leaf.default) if repr_defaults else meta.get("show", leaf.default)
    kwargs = {"help": leaf.help + ("" if shown is None else f" [default: {shown}]")}
    if meta.get("argument"):
        return click.argument(leaf.key, required=False, nargs=-1 if meta.get("multiple") else 1)
    decls = [d for d in (meta.get("short"), leaf.flag) if d]
    base = _base(leaf.hint)
    if base is bool and not (meta.get("negate") or meta.get("switch")):
        decls = [f"{leaf.flag}/--no-{leaf.flag[2:]}"]
    elif base is bool:
        kwargs["is_flag"] = True
    elif "choices" in meta:
        kwargs["type"] = click.Choice(meta["choices"])
    elif meta.get("multiple"):
        kwargs["multiple"] = True
    else:
        kwargs["metavar"] = "INTS" if get_origin(base) is tuple else _METAVARS[base]
    return click.option(*decls, leaf.key, cls=SettingOption, default=None,
                        setting_required=leaf.default is MISSING, **kwargs)


def _value(leaf: Leaf, given):
    """A flag's value as its setting's type; ``_NOT_GIVEN`` when the flag was not used."""
    meta = leaf.field.metadata
    if given is None or given == () or (given is False and meta.get("switch")):
        return _NOT_GIVEN
    if meta.get("negate"):
        return False
    if isinstance(given, bool) or meta.get("multiple") or "choices" in meta:
        return tuple(given) if meta.get("multiple") else given
    if type(None) in get_args(leaf.hint) and given.lower() == "none":
        return None
    base = _base(leaf.hint)
    try:
        if get_origin(base) is tuple:
            return tuple(int(t) for t in given.replace(",", " ").split())
        return base(given)
    except ValueError:
        kinds = {int: "an integer", float: "a number"}
        kind = kinds.get(base, "a comma-separated list of integers")
        raise UserError(f"{leaf.flag} {given!r} is not {kind}.") from None


def given_values(cls, flags: dict) -> dict:
    """``{key: value}`` of the flags given (click's ``flags``), read as their settings' types."""
    values = {}
    for leaf in leaves(cls):
        value = _value(leaf, flags.get(leaf.key))
        if value is not _NOT_GIVEN:
            values[leaf.key] = value
    return values


def load_config(cls, config_file: str | Path | None, flags: dict):
    """``cls`` from its defaults < ``config_file``'s keys < the flags given."""
    values = {}
    if config_file:
        values = cls.file_values(read_yaml_mapping(Path(config_file)), config_file)
    return build(cls, {**values, **given_values(cls, flags)}, config_file)


def config_command(cls, *, repr_defaults: bool = False, file_flag: str = "--config",
                   file_help: str = "YAML file of option: value (flags override it).",
                   load=None):
    """The decorated ``fn(config)`` as a command whose options are ``cls``'s settings: it
    parses them, builds the config (``load(file, given values)`` when the command reads its
    file its own way), checks its output paths and runs ``fn`` under :func:`user_errors`."""

    def decorate(fn):
        @functools.wraps(fn)
        def command(config_file=None, **flags):
            with user_errors():
                if load is None:
                    config = load_config(cls, config_file, flags)
                else:
                    config = load(config_file, given_values(cls, flags))
                check_output_paths(config)
                return fn(config)

        for leaf in reversed([leaf for leaf in leaves(cls) if leaf.has_flag]):
            command = _decorator(leaf, repr_defaults)(command)
        file_option = click.option(file_flag, "config_file", type=click.Path(dir_okay=False),
                                   default=None, help=file_help)
        return file_option(command)

    return decorate
