"""Every command's flags, as users type them, against the golden ``--help`` of each.

``tests/golden/cli_help.txt`` is ``--help`` of every command as it was before the
configs became sections, plus the flags added since (rewrite it with ``python
tests/test_cli_help.py``, or add a new flag's line by hand, only when a flag is meant to
change): each option keeps its names, choices, the default its help
shows and its required mark (a metavar such as ``INT`` or ``INTEGER`` may change). A
command may gain ``--config`` (a YAML of its settings) and the group may gain commands;
nothing else may appear or go.
"""

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from speculators_peagle_plugin.cli import main

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


def options(text: str) -> dict[tuple[str, ...], tuple[str | None, bool, str | None]]:
    """``{option names: (default shown, required, choices)}`` of one ``--help`` text."""
    section = text.split("\nOptions:\n", 1)[1].split("\nCommands:\n", 1)[0]
    entries: list[list[str]] = []
    for line in section.splitlines():
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


def test_no_command_goes():
    assert commands(golden()[""]) <= commands(render(""))


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(
        "".join(f"=== speculators-peagle {c}{' ' if c else ''}--help ===\n{render(c)}"
                for c in COMMANDS)
    )
    sys.exit(0)
