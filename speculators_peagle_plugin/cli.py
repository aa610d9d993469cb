"""The ``speculators-peagle`` command line (click)."""

from __future__ import annotations

from importlib.metadata import entry_points, version

import click

ENTRY_POINT_GROUP = "speculators.algorithms"


@click.group()
@click.version_option(version("speculators-peagle-plugin"), prog_name="speculators-peagle")
def main() -> None:
    """Train P-EAGLE speculative-decoding drafts and prove them in vLLM."""


@main.command()
def algorithms() -> None:
    """List the drafting algorithms installed under the speculators.algorithms entry point."""
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        algo = ep.load()
        click.echo(f"{ep.name}\t{getattr(algo, 'summary', '')}\t({ep.value})")
