"""Every command's flags, as users type them, against the golden ``--help`` of each.

``tests/golden/cli_help.txt`` is ``--help`` of every command as it was before the
configs became sections, plus the flags added since (rewrite it with ``python
tests/test_cli_help.py``, or add a new flag's line by hand, only when a flag is meant to
change): each option keeps its names, choices, the default its help
shows and its required mark (a metavar such as ``INT`` or ``INTEGER`` may change). A
command may gain ``--config`` (a YAML of its settings) and the group may gain commands;
nothing else may appear or go. Where they are listed may change: under ``Options``, or
under the heading of the config section that holds them (``optimizer options``).
"""

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.common.settings import leaves
from speculators_peagle_plugin.options import section_heading, section_of

GOLDEN = Path(__file__).parent / "golden" / "cli_help.txt"
COMMANDS = [
    "", "algorithms", "generate-data", "join-data", "train", "check", "export", "eval", "demo",
    "selftest",
]
# Wide enough that click never wraps a help text (it still moves a long option's text to
# the next line); the golden file was rendered the same way.
WIDTH = 10_000
ADDED_OPTIONS = {("--config",)}
HEADER = re.compile(r"^=== speculators-peagle (.*)--help ===$", re.M)


def render(command: str) -> str:
    args = [*command.split(), "--help"]
    result = CliRunner().invoke(
        main, args, prog_name="speculators-peagle", terminal_width=WIDTH, max_content_width=WIDTH
    )
    assert result.exit_code == 0, result.output
    return result.output


def golden() -> dict[str, str]:
    parts = HEADER.split(GOLDEN.read_text())[1:]
    return {name.strip(): text for name, text in zip(parts[::2], parts[1::2], strict=True)}


def headings(text: str) -> list[tuple[str, list[str]]]:
    """``[(heading, its lines)]`` of one ``--help`` text: ``Options``, a config section's
    (``optimizer options``), ``Commands``."""
    found: list[tuple[str, list[str]]] = []
    for line in text.split("\n\n", 1)[1].splitlines():  # after the usage line
        if re.match(r"^\S.*:$", line):
            found.append((line[:-1], []))
        elif found and line.strip():
            found[-1][1].append(line)
    return found


def options(text: str) -> dict[tuple[str, ...], tuple[str | None, bool, str | None]]:
    """``{option names: (default shown, required, choices)}`` of one ``--help`` text, every
    heading's options together."""
    entries: list[list[str]] = []
    for heading, lines in headings(text):
        if not heading.endswith("ptions"):
            continue
        for line in lines:
            if re.match(r"^  -", line):
                decl, _, help_text = line.strip().partition("  ")
                entries.append([decl, help_text])
            elif entries:
                entries[-1][1] += " " + line.strip()
    found = {}
    for decl, help_text in entries:
        defaults = re.findall(r"\[default: ([^\]]*)\]", help_text)
        names = tuple(re.findall(r"(?:^|[ ,/])(--?[\w-]+)", decl))
        choices = re.search(r"\[([^\]]*\|[^\]]*)\]", decl)
        found[names] = (
            defaults[-1] if defaults else None,
            "[required]" in help_text,
            choices and choices.group(1),
        )
    return found


def commands(text: str) -> set[str]:
    listed = text.split("\nCommands:\n", 1)[1]
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_golden_file_covers_every_command():
    assert set(golden()) == set(COMMANDS)
    assert commands(golden()[""]) - {"vllm"} == {c for c in COMMANDS if c}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c or "group")
def test_options_keep_their_names_and_defaults(command):
    before, now = options(golden()[command]), options(render(command))
    assert {k: v for k, v in now.items() if k not in before and k not in ADDED_OPTIONS} == {}
    assert {k: v for k, v in before.items() if now.get(k) != v} == {}


CONFIGS = {name: cmd.callback.config_class for name, cmd in main.commands.items()
           if hasattr(cmd.callback, "config_class")}


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_each_option_sits_under_its_sections_heading(command):
    """Options first (the config's own settings, --config, --help), then a heading per
    section of the config in its order: the YAML group that may hold those keys."""
    settings = [leaf for leaf in leaves(CONFIGS[command]) if leaf.has_flag]
    found = {}
    for heading, lines in headings(render(command)):
        for line in lines:
            found.update({name: heading for name in re.findall(r"^  (?:-\w, )?(--[\w-]+)", line)})
    flags = [leaf for leaf in settings if leaf.flag.startswith("--")]
    assert {leaf.flag: found.get(leaf.flag) for leaf in flags} == {
        leaf.flag: section_heading(section_of(leaf)) for leaf in flags}
    order = [heading for heading, _ in headings(render(command)) if heading != "Commands"]
    sections = dict.fromkeys([None, *(section_of(leaf) for leaf in settings)])
    assert order == list(map(section_heading, sections))


def test_no_command_goes():
    assert commands(golden()[""]) <= commands(render(""))


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(
        "".join(f"=== speculators-peagle {c}{' ' if c else ''}--help ===\n{render(c)}"
                for c in COMMANDS)
    )
    sys.exit(0)
