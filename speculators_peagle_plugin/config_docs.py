"""docs/config.md: every key of every command's config, section by section, with its flag,
default and meaning, read from the settings themselves (:mod:`.common.settings`).

``python -m speculators_peagle_plugin.config_docs > docs/config.md`` writes the page;
tests/test_config_docs.py fails while the page is not :func:`render`'s text. A section a
config gains is listed once the page is regenerated.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import MISSING, fields

from .cli import main
from .common.settings import Leaf, leaves
from .options import section_of
from .training.speculators_keys import SPECULATORS_KEYS
from .training.train_config import TrainConfig

REGENERATE = "python -m speculators_peagle_plugin.config_docs > docs/config.md"

INTRO = f"""\
# Every command's settings

Generated from the settings' sections (`{REGENERATE}`; a test fails while this page is
stale), so it lists exactly what each command reads. `--help` shows the same sections.

A config file (`--config FILE.yaml`; the demo's `--recipe`) gives any key below, flat
(`lr: 0.001`) or grouped under its section (`optimizer: {{lr: 0.001}}`), as speculators'
train YAML groups its keys; a key in the wrong section is refused, naming the section's
keys. Flags override the file. A key whose flag is "file only" has no flag. A default
"required" must be given by the file or the flag.
"""


def speculators_places() -> dict[str, str]:
    """``{our train key: speculators' name for it}`` (``group.key``, or a root key), for
    the keys of speculators' train YAML that set one of ours (docs/speculators_keys.md)."""
    return {answer.ours: name for name, answer in SPECULATORS_KEYS.items()
            if answer.ours is not None and not answer.ignored}


# a command's config -> {its key: the same key in another tool's YAML}
OTHER_NAMES = {TrainConfig: ("speculators", speculators_places)}


def _arg_docs(cls) -> dict[str, str]:
    """``{name: text}`` of the ``Args:`` list of ``cls``'s docstring, joined lines."""
    doc = inspect.getdoc(cls) or ""
    block = doc.split("\nArgs:\n", 1)[1] if "\nArgs:\n" in doc else ""
    found: dict[str, str] = {}
    for line in block.split("\n\n", 1)[0].splitlines():
        entry = re.match(r"^    (\w+): (.*)$", line)
        if entry:
            found[entry.group(1)] = entry.group(2)
        elif found and line.startswith("     "):
            last = next(reversed(found))
            found[last] += " " + line.strip()
    return found


def _owner(cls, leaf: Leaf):
    """The dataclass that declares ``leaf``'s field (the innermost section on its path)."""
    for name in leaf.path[:-1]:
        cls = next(f for f in fields(cls) if f.name == name).metadata["section"]
    return cls


def _meaning(cls, leaf: Leaf) -> str:
    text = leaf.help
    if not text:  # a key-only setting, described in its class's docstring
        text = _arg_docs(_owner(cls, leaf)).get(leaf.path[-1], "").replace("``", "`")
        text = text[:1].upper() + text[1:]
    return text.replace("|", "\\|")


def _value(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return "''" if value == "" else str(value)


def _default(leaf: Leaf) -> str:
    if leaf.default is MISSING:
        return "required"
    shown, f = leaf.field.metadata.get("show"), leaf.field
    own = f.default if f.default is not MISSING else f.default_factory()
    if shown is None or leaf.default != own:  # a default the holding config gives it
        shown = leaf.default
    return f"`{_value(shown)}`"


def _flag(leaf: Leaf) -> str:
    if not leaf.has_flag:
        return "file only"
    short = leaf.field.metadata.get("short")
    return ", ".join(f"`{f}`" for f in (short, leaf.flag) if f)


def _command_page(name: str, command) -> list[str]:
    cls = command.callback.config_class
    file_flag = next(p.opts[0] for p in command.params if p.name == "config_file")
    other, places = OTHER_NAMES.get(cls, (None, dict))
    places = places()
    summary = (command.help or "").split("\n\n", 1)[0].strip()
    lines = [f"## `{name}`", "", f"{summary} `speculators-peagle {name} {file_flag} FILE.yaml`.",
             ""]
    by_section: dict[str | None, list[Leaf]] = {None: []}
    for leaf in leaves(cls):
        by_section.setdefault(section_of(leaf), []).append(leaf)
    moved = []
    for section, group in by_section.items():
        if not group:
            continue
        title = "no section (root keys)" if section is None else f"`{section}`"
        lines += [f"### {title}", ""]
        columns = ["key", "flag", "default", "meaning"] + ([f"{other}' key"] if other else [])
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for leaf in group:
            row = [f"`{leaf.key}`", _flag(leaf), _default(leaf), _meaning(cls, leaf)]
            if other:
                theirs = places.get(leaf.key)
                ours = leaf.key if section is None else f"{section}.{leaf.key}"
                row.append("" if theirs is None else "same" if theirs == ours else f"`{theirs}`")
                if theirs not in (None, ours):
                    moved.append(f"`{ours}` (theirs: `{theirs}`)")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if moved:
        lines += [f"Where {other}' YAML puts a key elsewhere (a file may use either place): "
                  + ", ".join(moved) + ".", ""]
    return lines


def render() -> str:
    """The text of docs/config.md."""
    lines = [INTRO]
    for name, command in sorted(main.commands.items()):
        if hasattr(command.callback, "config_class"):
            lines += _command_page(name, command)
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["REGENERATE", "render", "speculators_places"]

if __name__ == "__main__":
    print(render(), end="")
