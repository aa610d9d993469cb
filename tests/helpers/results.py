"""What a command made, less what differs between two runs of it (the clock, the machine,
the output's own path): what a fault test compares with an uninterrupted run's."""

from __future__ import annotations

import json
from pathlib import Path

from speculators_peagle_plugin.training import progress
from speculators_peagle_plugin.training.checkpoint import checkpoint_dirs


def checkpoint_bytes(save):
    """Every kept checkpoint's weights and config (bytes), and the steps the log records."""
    files = ("model.safetensors", "config.json")
    kept = {c.name: [(c / f).read_bytes() for f in files] for c in checkpoint_dirs(save)}
    lines = (save / progress.METRICS_FILE).read_text().splitlines()
    return kept, [json.loads(line)["step"] for line in lines]


def data_rows(output):
    """The dataset's rows and the bytes of every other file generate-data writes, by name."""
    from datasets import load_from_disk

    rows = load_from_disk(str(output)).to_dict()
    files = {p.relative_to(output).as_posix(): p.read_bytes() for p in sorted(output.rglob("*"))
             if p.is_file() and p.suffix in (".safetensors", ".npy", ".pt")}
    return rows, files


# what differs between two runs of the same eval: the clock, the machine, where it ran
TIMING = ("wall_s", "tokens_per_s", "tpot_s", "speedup", "resumed")


def eval_table(out):
    """record.json less its timing (and what follows from it: the recommendation), its
    provenance and its output directory."""
    record = json.loads((out / "record.json").read_text())
    for name in ("provenance", "resumed_cells", "recommendation"):
        record.pop(name)
    record["config"].pop("output_dir")
    for run in record["runs"]:
        for name in TIMING:
            run.pop(name)
    return record


def save_tiny_draft(target: str, path: Path) -> Path:
    """A random tiny draft of ``target`` (K up to 3), saved to ``path``."""
    from tiny_vllm import tiny_vllm_draft

    tiny_vllm_draft(target).save_pretrained(path)
    return path


def eval_args(target, draft, out):
    """eval of no draft and K=2 at concurrency 1, 2 on 2 prompts, on the reference backend."""
    return ["eval", "--target", target, "--draft", draft, "-k", "2", "--prompts", "chat[:2]",
            "--concurrency", "1,2", "--max-new-tokens", "8", "--backend", "reference",
            "--out", out]
