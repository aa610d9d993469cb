"""The prompts that continue a long run: a larger prompt spec's prompts after the run's own.

Usage (a larger cell of ``eval.scaling``: new prompts only, the run's replies kept)::

    .venv/bin/python -m tools.extend_prompts --run-dir runs/long \\
        --prompts "humaneval[0:120]+chat[0:100]+mbpp[:450]+sharegpt[:10887]" \\
        --out runs/long-ext/train_prompts.jsonl
    # then the generate-data command it prints (the run's data settings), and
    .venv/bin/python -m eval.scaling --run-dir runs/long --more-data runs/long-ext/data ...
    # a second extension continues the first: --after its prompts file
    .venv/bin/python -m tools.extend_prompts --run-dir runs/long --after \
        runs/long-ext/train_prompts.jsonl --prompts "...+sharegpt[:10887]+mt_mbpp[:7650]" \
        --out runs/long-ext2/train_prompts.jsonl

The spec's prompts are listed as the run's prompts stage lists them (the demo's
``write_prompts``: deduplicated, the run's eval sets held out, the run's prompt-length cap);
the run's training prompts must be the first of them (else the spec does not extend the
run: refused), and the ones after them are written, less any that is one of the run's
validation prompts. With ``--after``, earlier extensions' prompts files, the spec must
continue them too (in order), and only what comes after them is written.
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path

from eval.scaling_cells import run_inputs
from speculators_peagle_plugin.common.files import atomic_write_text
from speculators_peagle_plugin.data.prompts import first_prompt_key
from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig
from speculators_peagle_plugin.demo.artifacts import (
    RunLayout,
    prompt_length_cut,
    write_prompts,
)
from speculators_peagle_plugin.demo.stages import STATE_FILE
from speculators_peagle_plugin.options import config_argv


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().split("\n") if line]


def _key(line: str) -> str:
    return json.dumps(json.loads(line), sort_keys=True)


def _opening(line: str) -> str:
    """A prompts file row's first prompt (a validation conversation that shares it is not
    held out: :func:`first_prompt_key`)."""
    return first_prompt_key(json.loads(line)["messages"])


def extend_prompts(run_dir: Path, spec: str, out: Path, after: tuple[Path, ...] = ()) -> int:
    """Write the prompts of ``spec`` that come after ``run_dir``'s training prompts and the
    prompts files ``after`` (less the run's validation prompts) to ``out``; returns their
    count."""
    missing = [path for path in after if not path.is_file()]
    if missing:
        raise SystemExit(
            f"--after {missing[0]} is not a file; give the prompts files of earlier extensions."
        )
    inputs = run_inputs(run_dir)
    stages = json.loads((run_dir / STATE_FILE).read_text())
    listed = stages["prompts"]["inputs"]
    cut = prompt_length_cut(listed.get("max_prompt_tokens"), inputs["target"],
                            stages["data"]["inputs"]["max_new_tokens"])
    with tempfile.TemporaryDirectory() as tmp:
        every = Path(tmp) / "prompts.jsonl"
        try:
            write_prompts((spec,), tuple(listed["eval"]), every, cut)
        except ValueError as err:  # an eval prompt in the spec
            raise SystemExit(f"--prompts {spec!r}: {err}") from None
        lines = _lines(every)
    layout = RunLayout(run_dir)
    run = _lines(layout.prompts)
    if [_key(line) for line in lines[: len(run)]] != [_key(line) for line in run]:
        raise SystemExit(
            f"--prompts {spec!r} does not begin with the {len(run)} training prompts of "
            f"{run_dir}; give a spec that extends the run's ({', '.join(listed['specs'])})."
        )
    validation = layout.validation_prompts
    held = {_opening(line) for line in _lines(validation)} if validation.is_file() else set()
    rest = [line for line in lines[len(run) :] if _opening(line) not in held]
    earlier = [line for path in after for line in _lines(path)]
    if [_key(line) for line in rest[: len(earlier)]] != [_key(line) for line in earlier]:
        raise SystemExit(
            f"--prompts {spec!r} does not continue with the {len(earlier)} prompts of "
            f"{' + '.join(map(str, after))}; give a spec that extends theirs."
        )
    more = rest[len(earlier) :]
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(line + "\n" for line in more))
    print(f"{len(more)} prompts after the run's {len(run) + len(earlier)} -> {out} "
          f"({len(lines) - len(run) - len(rest)} left out: validation prompts)")
    data = stages["data"]["inputs"]
    command = ["speculators-peagle", "generate-data", *config_argv(DataGenConfig, {
        "target": inputs["target"], "prompts": str(out), "output": str(out.parent / "data"),
        "max_new_tokens": data["max_new_tokens"], "num_samples": data["num_samples"],
        "temperature": data["temperature"], "backend": data["backend"], "dtype": inputs["dtype"],
    })]
    print("next:", shlex.join(command))
    return len(more)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="runs/long", help="A long-recipe run directory.")
    parser.add_argument("--prompts", required=True,
                        help="A prompt spec whose first prompts are the run's.")
    parser.add_argument("--out", required=True, help="The prompts file to write (.jsonl).")
    parser.add_argument("--after", nargs="+", default=[], metavar="FILE",
                        help="Earlier extensions' prompts files, in order: the spec continues "
                        "them, and only its prompts after them are written.")
    args = parser.parse_args(argv)
    extend_prompts(Path(args.run_dir), args.prompts, Path(args.out),
                   tuple(Path(p) for p in args.after))


if __name__ == "__main__":
    main()
