"""Config sections: typed dataclasses whose fields are flags and YAML keys as well.

A config is a dataclass of settings (:func:`setting`: a value, its help text and choices)
and sections (:func:`section`: another such dataclass, defined and validated by the module
that uses it). Each setting has one flat key, its name unless the section that holds it
renames it; flags and flat YAML files use these keys, and a nested YAML may group them
under their section's name instead (``optimizer: {lr: 0.001}``), as speculators' does. So
a default is written once, in its section, and validated once, in its ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path, PurePath
from typing import Any, get_args, get_origin, get_type_hints

from .errors import UserError
from .reading import read_yaml_mapping


def fail(name: str, value: object, allowed: str) -> None:
    raise UserError(f"{name} must be {allowed}, got {value!r}.")


def check_int_at_least(name: str, value: object, low: int) -> int:
    """Return ``value`` if it is an int >= ``low``; else raise a one-sentence UserError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        fail(name, value, f"an integer >= {low}")
    return value


def check_optional_ints(obj, lows: Mapping[str, int]) -> None:
    """:func:`check_int_at_least` for each named field of ``obj`` that is not None."""
    for name, low in lows.items():
        if getattr(obj, name) is not None:
            check_int_at_least(name, getattr(obj, name), low)


def check_finite(name: str, value, low: float, *, strict: bool = True, off: str = "") -> None:
    """``value`` a finite number ``> low`` (``>= low`` when not strict); ``off``: what None
    means, for the message."""
    if not (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if strict else value >= low)
    ):
        fail(name, value, f"a finite number {'>' if strict else '>='} {low:g}{off}")


def check_choices(obj) -> None:
    """Every setting of ``obj`` that lists its choices holds one of them."""
    for f in fields(obj):
        allowed = f.metadata.get("choices")
        value = getattr(obj, f.name)
        if allowed and value is not None and value not in allowed:
            fail(f.name, value, f"one of {', '.join(allowed)}")


def setting(default=MISSING, help: str = "", factory=None, **meta):  # noqa: A002 - click's word
    """A setting and its ``--flag``: no ``default`` and no ``factory`` = required.

    ``meta``: ``flag`` (the long option when it is not ``--key``), ``short``, ``choices``,
    ``multiple`` (repeatable), ``negate`` (a switch that sets the setting to False),
    ``switch`` (a bool given by one switch instead of ``--x/--no-x``), ``show`` (the default
    as the help shows it; None: not shown; absent: the default itself), ``output`` (a
    directory the command writes, checked before it starts: True, or the key of the setting
    without which it is not written).

    A setting's roles beyond its flag are metadata too, read where the role matters (see
    :func:`keys_with`): ``resumable`` (may change when a run resumes from a checkpoint: how
    long, how often, where to, not what is learnt), ``path`` (a local path: compared
    resolved, so that two spellings of one directory agree), ``prompts`` (a prompt-set spec,
    whose sources are compared resolved), ``card`` (stated on the model card; an eval
    setting: in the card's eval entries), ``engine`` (a setting of the engines a command
    starts, which a running server has of its own), ``unrecorded`` (the value a checkpoint
    that does not record the setting was made with, where the default has changed since the
    setting was added).
    """
    metadata = {"help": help, **meta}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def keys_with(cls, role: str) -> tuple[str, ...]:
    """The flat keys of the settings of config class ``cls`` whose metadata marks ``role``
    (:func:`setting`), in declaration order.

    Example: ``keys_with(TrainConfig, "path")`` -> ``("verifier_name_or_path", "data_path",
    "from_pretrained")``.
    """
    return tuple(leaf.key for leaf in leaves(cls) if leaf.field.metadata.get(role))


def section(cls, *, factory=None, keys=None, prefix: str = "", hidden=(), help_prefix: str = "",
            flags: bool = True, says=None):
    """A field holding the config section ``cls`` (default: ``factory()``, else ``cls()``).

    ``keys`` / ``prefix`` rename the section's settings for the config that holds it (a
    setting's key is ``keys[name]``, else ``prefix + name``); ``hidden`` settings keep
    their defaults and are neither flags nor keys there; ``help_prefix`` heads their help;
    ``flags=False``: its settings are keys only, not flags; ``says``: ``{name: {metadata
    key: value}}``, what a setting's help and shown default say in this config (``help``,
    ``show``) where it means more there (example: eval's KV cache is shared by its engines).
    """
    meta = {"section": cls, "keys": dict(keys or {}), "prefix": prefix,
            "hidden": tuple(hidden), "help_prefix": help_prefix, "flags": flags,
            "says": {name: dict(said) for name, said in (says or {}).items()}}
    return field(default_factory=factory or cls, metadata=meta)


@dataclass(frozen=True)
class Leaf:
    """One setting of a config tree as its root sees it."""

    key: str  # the flat key: YAML key, click parameter name
    path: tuple[str, ...]  # attribute names from the root
    field: dataclasses.Field
    hint: Any
    default: Any  # MISSING: required
    help: str
    is_flag: bool = True  # False: a YAML key only

    @property
    def has_flag(self) -> bool:
        return self.is_flag and "help" in self.field.metadata

    @property
    def flag(self) -> str:
        """How the command line names it: ``--key`` (or the flag it gives), an argument's
        ``KEY``."""
        if self.field.metadata.get("argument"):
            return self.key.upper()
        return self.field.metadata.get("flag", "--" + self.key.replace("_", "-"))


def _default(f: dataclasses.Field):
    if f.default is not MISSING:
        return f.default
    return MISSING if f.default_factory is MISSING else f.default_factory()


def leaves(cls, *, _base=None) -> list[Leaf]:
    """Every setting of the config class ``cls``, sections unfolded, in declaration order."""
    hints = get_type_hints(cls)
    found = []
    for f in fields(cls):
        base = _default(f) if _base is None else getattr(_base, f.name)
        meta = f.metadata
        if "section" not in meta:
            found.append(Leaf(f.name, (f.name,), f, hints[f.name], base, meta.get("help", "")))
            continue
        for leaf in leaves(meta["section"], _base=base):
            name = leaf.path[0]
            if name in meta["hidden"]:
                continue
            key = meta["keys"].get(name, meta["prefix"] + leaf.key)
            said = meta["says"].get(name) if len(leaf.path) == 1 else None
            if said:
                leaf = dataclasses.replace(leaf, field=_saying(leaf.field, said),
                                           help=said.get("help", leaf.help))
            text = leaf.help
            if meta["help_prefix"] and text:
                text = meta["help_prefix"] + text[0].lower() + text[1:]
            found.append(dataclasses.replace(
                leaf, key=key, path=(f.name, *leaf.path), help=text,
                is_flag=leaf.is_flag and meta["flags"],
            ))
    return found


def _saying(f: dataclasses.Field, said: Mapping) -> dataclasses.Field:
    """A copy of the setting ``f`` whose metadata has ``said``'s keys instead."""
    copy = field(default=f.default, default_factory=f.default_factory,
                 metadata={**f.metadata, **said})
    copy.name, copy.type = f.name, f.type
    return copy


def _coerce(name: str, value, hint):
    """``value`` checked against a setting's annotation (YAML gives lists for tuples)."""
    args = get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if get_origin(hint) is tuple:
        item = get_args(hint)[0]
        if item is str and isinstance(value, str):  # one string for a list of them
            return (value,)
        if isinstance(value, list | tuple) and all(
            isinstance(v, item) and not isinstance(v, bool) for v in value
        ):
            return tuple(value)
        fail(name, value, f"a list of {'integers' if item is int else 'strings'}")
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint in (str, bool) and isinstance(value, hint):
        return value
    if hint is str and isinstance(value, PurePath):  # a path given from code
        return str(value)
    fail(name, value, f"of type {hint.__name__}")


def build(cls, values: Mapping[str, Any], source: str | Path | None = None):
    """``cls`` from flat keys (and section-grouped ones), each checked against its type.

    Settings not given keep their defaults. An unknown key or a missing required setting
    raises :class:`~.errors.UserError` naming it (and ``source``, the file the values came from).
    """
    by_key = {leaf.key: leaf for leaf in leaves(cls)}
    sections = {leaf.path[0] for leaf in by_key.values() if len(leaf.path) > 1}
    given: dict[tuple[str, ...], Any] = {}
    where = f" in {source}" if source is not None else ""
    for key, value in values.items():
        name = key.replace("-", "_")
        if name in sections and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                leaf = by_key.get(sub.replace("-", "_"))
                if leaf is None or leaf.path[0] != name:
                    known = ", ".join(k for k, other in by_key.items() if other.path[0] == name)
                    raise UserError(
                        f"Unknown key {sub!r} under {name!r}{where}; allowed: {known}."
                    )
                given[leaf.path] = _coerce(leaf.key, sub_value, leaf.hint)
            continue
        leaf = by_key.get(name)
        if leaf is None:
            raise UserError(
                f"Unknown key {key!r}{where}; allowed: {', '.join(sorted(by_key))}."
            )
        given[leaf.path] = _coerce(leaf.key, value, leaf.hint)
    for leaf in by_key.values():
        if leaf.default is MISSING and leaf.path not in given:
            raise UserError(f"{leaf.key} is required ({leaf.flag}).")
    return _assemble(cls, given, None)


def _assemble(cls, given: dict, base):
    """``cls`` (``base`` with ``given`` replaced, when there is a base) from the tree."""
    kwargs = {}
    for f in fields(cls):
        inner = {p[1:]: v for p, v in given.items() if p[0] == f.name and len(p) > 1}
        if inner:
            current = _default(f) if base is None else getattr(base, f.name)
            try:
                kwargs[f.name] = _assemble(f.metadata["section"], inner, current)
            except ValueError as exc:  # name the setting by the key this config gives it
                name, _, rest = str(exc).partition(" ")
                keys, prefix = f.metadata["keys"], f.metadata["prefix"]
                own = {g.name for g in fields(f.metadata["section"])}
                if name not in own or (name not in keys and not prefix):
                    raise
                raise UserError(f"{keys.get(name, prefix + name)} {rest}") from None
        elif (f.name,) in given:
            kwargs[f.name] = given[(f.name,)]
    return cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)


def flatten(config) -> dict[str, Any]:
    """``{key: value}`` of every setting of ``config``, in declaration order."""
    values = {}
    for leaf in leaves(type(config)):
        value = config
        for name in leaf.path:
            value = getattr(value, name)
        values[leaf.key] = value
    return values


class Settings:
    """What every command's config can do: load itself, flatten, change some keys."""

    @classmethod
    def file_values(cls, values: Mapping, source: str | Path | None) -> dict:
        """The settings a config file's mapping gives (a config reading another tool's
        file shape overrides this)."""
        return dict(values)

    @classmethod
    def from_sources(cls, yaml_path: str | Path | None = None, **overrides):
        """Defaults, then the YAML file's keys, then ``overrides`` that are not None."""
        values = {}
        if yaml_path is not None:
            values = cls.file_values(read_yaml_mapping(Path(yaml_path)), yaml_path)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return build(cls, values, yaml_path)

    def to_dict(self) -> dict[str, Any]:
        return flatten(self)

    def replace(self, **values):
        """A copy with the settings of these flat keys changed (their sections validated
        again)."""
        by_key = {leaf.key: leaf for leaf in leaves(type(self))}
        unknown = sorted(set(values) - set(by_key))
        if unknown:
            raise UserError(f"Unknown key(s) {', '.join(unknown)} of {type(self).__name__}.")
        given = {by_key[k].path: _coerce(k, v, by_key[k].hint) for k, v in values.items()}
        return _assemble(type(self), given, self)
