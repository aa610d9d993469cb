"""Every command's options, generated from its config's settings, and the one error handler.

A setting's metadata (:func:`~.common.settings.setting`) gives its flag, help, choices and
shown default; its type gives how the text is read (``none`` clears an optional setting).
``--config FILE.yaml`` gives any setting by its key; flags override the file. ``--help``
lists the options under a heading per config section (:class:`SectionedCommand`).
:func:`config_argv` is the inverse: the command line that gives a command these values.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import MISSING
from pathlib import Path
from typing import Any, get_args, get_origin

import click

from .common.errors import TRACEBACK_ENV, UserError, bug_report_line, one_sentence
from .common.paths import check_output_dir
from .common.reading import read_yaml_mapping
from .common.settings import Leaf, _coerce, build, flatten, leaves

_METAVARS = {int: "INTEGER", float: "FLOAT", str: "TEXT"}
_NOT_GIVEN = object()
CONFIG_FLAG = "--config"  # a command's file of settings, unless config_command names another


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
    give it), so click only marks it in the help; ``section``: the config section that holds
    it (None: the config's own), its heading in the help."""

    def __init__(self, *args, setting_required: bool = False, section: str | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.setting_required = setting_required
        self.section = section

    def get_help_extra(self, ctx):
        extra = super().get_help_extra(ctx)
        if self.setting_required:
            extra["required"] = "required"
        return extra


def section_of(leaf: Leaf) -> str | None:
    """The section of its config that holds ``leaf`` (the YAML group of its key); None for
    the config's own settings."""
    return leaf.path[0] if len(leaf.path) > 1 else None


def section_heading(section: str | None) -> str:
    """The help's heading of a section's options: ``optimizer options`` (the YAML group that
    may hold its keys); ``Options`` for the config's own settings, ``--config`` and
    ``--help``."""
    return "Options" if section is None else f"{section} options"


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists its options under a heading per config section, in
    the order the config declares them, its own settings first."""

    def format_options(self, ctx, formatter):
        groups: dict[str | None, list] = {None: []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and not isinstance(param, click.Argument):
                groups.setdefault(getattr(param, "section", None), []).append(record)
        for section, records in groups.items():
            if records:
                with formatter.section(section_heading(section)):
                    formatter.write_dl(records)


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
                        setting_required=leaf.default is MISSING, section=section_of(leaf),
                        **kwargs)


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


def file_with(cls, mapping: Mapping, values: Mapping[str, Any], drop=()) -> dict:
    """A config file's ``mapping`` (flat or grouped) with ``values`` (``{flat key: value}``)
    set and the keys ``drop`` left out, each where the file writes it: flat if the file has
    it flat, else under its section if the file has that section, else flat at the end. So a
    file changed by a tool keeps its shape, and each key is written once.

    Example: ``file_with(TrainConfig, {"runtime": {"autocast": "bfloat16"}}, {"autocast":
    "none", "lr": 0.01})`` -> ``{"runtime": {"autocast": "none"}, "lr": 0.01}``.
    """
    by_key = {leaf.key: leaf for leaf in leaves(cls)}
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}
    for key in [*values, *drop]:
        section = section_of(by_key[key]) if key in by_key else None
        flat = key in out and not (key == section and isinstance(out[key], dict))
        group = out.get(section) if not flat and isinstance(out.get(section), dict) else out
        if key in values:
            group[key] = values[key]
        else:
            group.pop(key, None)
            if group is not out and not group:
                del out[section]
    return out


def config_command(cls, *, repr_defaults: bool = False, file_flag: str = CONFIG_FLAG,
                   file_help: str = "YAML file of option: value (flags override it).",
                   load=None):
    """The decorated ``fn(config)`` as a command whose options are ``cls``'s settings: it
    parses them, builds the config (``load(file, given values)`` when the command reads its
    file its own way), checks its output paths and runs ``fn`` under :func:`user_errors`.
    ``fn`` keeps ``cls`` as ``config_class`` (docs/config.md lists every command's); a
    :class:`SectionedCommand` heads its options by section."""

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
        command.config_class = cls
        file_option = click.option(file_flag, "config_file", type=click.Path(dir_okay=False),
                                   default=None, help=file_help)
        return file_option(command)

    return decorate


def _unsaid(leaf: Leaf, value) -> list[str]:
    """No tokens: the value a command gets when its flag is absent (the file's, else the
    default), so only the default may be left unsaid."""
    if value != leaf.default:
        raise ValueError(f"{leaf.flag} cannot give {leaf.key} {value!r}; only "
                         f"{leaf.default!r}, by leaving the flag out.")
    return []


def _bool_tokens(leaf: Leaf, value) -> list[str]:
    meta = leaf.field.metadata
    if meta.get("negate"):  # the flag sets False
        return [leaf.flag] if value is False else _unsaid(leaf, value)
    if meta.get("switch"):  # the flag sets True
        return [leaf.flag] if value is True else _unsaid(leaf, value)
    if value is None:
        return _unsaid(leaf, value)
    return [leaf.flag if value else f"--no-{leaf.flag[2:]}"]


def _text(leaf: Leaf, value) -> str:
    """``value`` as :func:`_value` reads it back: a tuple of ints as a comma list."""
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    text = str(value)
    if type(None) in get_args(leaf.hint) and text.lower() == "none":
        raise ValueError(f"{leaf.flag} reads {text!r} as None; it cannot give that text.")
    return text


def _leaf_tokens(leaf: Leaf, value) -> list[str]:
    """The tokens that give ``value`` to ``leaf``'s flag (its short form where it has one)."""
    meta = leaf.field.metadata
    flag = meta.get("short") or leaf.flag
    value = _coerce(leaf.key, value, leaf.hint)  # as build reads it: a list as a tuple
    if meta.get("argument"):
        return [str(v) for v in value] if meta.get("multiple") else [str(value)]
    if meta.get("multiple"):
        return [t for v in value for t in (flag, str(v))] or _unsaid(leaf, tuple(value))
    if _base(leaf.hint) is bool:
        return _bool_tokens(leaf, value)
    if value is None and "choices" in meta:
        return _unsaid(leaf, value)
    return [flag, "none" if value is None else _text(leaf, value)]


def config_argv(config, values: Mapping[str, Any], *, config_file: str | Path | None = None,
                file_flag: str = CONFIG_FLAG) -> list[str]:
    """The command line (after the command's name) that gives the command of ``config`` (a
    config class or instance) ``values``, ``{flat key: value}`` (read as a config file's
    are: a list for a tuple, a path for a string), in the order given: each under its
    setting's flag (the short one where declared), a switch alone, a ``multiple`` setting's
    items each under the flag, a tuple of ints as a comma list, None as ``none``;
    ``config_file`` first, under ``file_flag``. The inverse of :func:`config_command`'s
    parsing. Raises ``ValueError`` for a key that is no flag of the config, or a value its
    flag cannot give.

    Example: ``config_argv(EvalConfig, {"target": "t", "ks": (2, 4), "baseline": False,
    "prompt_sets": ("a", "b")})`` -> ``["--target", "t", "-k", "2,4", "--no-baseline",
    "--prompts", "a", "--prompts", "b"]``.
    """
    cls = config if isinstance(config, type) else type(config)
    flags = {leaf.key: leaf for leaf in leaves(cls) if leaf.has_flag}
    argv = [] if config_file is None else [file_flag, str(config_file)]
    for key, value in values.items():
        if key not in flags:
            raise ValueError(f"{key!r} is no flag of {cls.__name__}; its flags' keys: "
                             f"{', '.join(flags)}.")
        argv += _leaf_tokens(flags[key], value)
    return argv
