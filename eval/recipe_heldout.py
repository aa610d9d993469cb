"""Training-recipe probe: train a variant of the demo config, then score it teacher-forced.

Usage (after ``make demo`` has written ``runs/demo/data``)::

    .venv/bin/python -m eval.recipe_heldout --name epochs8 --set epochs=8

Trains ``configs/demo_smollm2.yaml`` with the ``--set`` overrides on the demo's data into
``OUT/NAME`` (reused if already trained), then measures per-depth accuracy on the target's
own greedy replies to the held-out HumanEval[120:164] prompts (generated once into
``OUT/heldout-data``, 128 new tokens): every position at every depth (no COD
subsampling), argmax over the draft vocabulary vs the target's. ``AL_est`` =
``1 + sum_k prod_{j<=k} acc_j`` treats the depths as independent. It is a fast proxy
for the acceptance length vLLM measures (``speculators-peagle eval``), not a substitute.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def heldout_data(out: Path, target: Path, spec: str) -> Path:
    """The target's greedy replies to the held-out prompts, in speculators' format."""
    from speculators_peagle_plugin.evaluate import load_prompt_set

    data = out / "heldout-data"
    if not (data / "state.json").is_file():
        prompts = out / "heldout.jsonl"
        load_prompt_set(spec).write_jsonl(prompts)
        subprocess.run([sys.executable, "-m", "speculators_peagle_plugin", "generate-data",
                        "--target", str(target), "--prompts", str(prompts), "--output", str(data),
                        "--max-new-tokens", "128", "--batch-size", "22"], check=True)  # fmt: skip
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="KEY=VALUE (YAML value) over the demo config")  # fmt: skip
    parser.add_argument("--data", default="runs/demo/data")
    parser.add_argument("--heldout", default="humaneval[120:164]")
    parser.add_argument("--out", default="runs/recipe")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from speculators_peagle_plugin.config import CODConfig, TrainConfig
    from speculators_peagle_plugin.data import PackedBatches, open_training_data
    from speculators_peagle_plugin.loop import build_training, checkpoint_dirs, train
    from speculators_peagle_plugin.models import materialise_smollm2

    overrides = {}
    for item in args.overrides:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    out = Path(args.out)
    target = materialise_smollm2()
    config = TrainConfig.from_sources(
        str(REPO / "configs" / "demo_smollm2.yaml"), verifier_name_or_path=str(target),
        data_path=args.data, save_path=str(out / args.name), **overrides,
    )  # fmt: skip
    began = time.perf_counter()
    done = checkpoint_dirs(Path(config.save_path)) if Path(config.save_path).is_dir() else []
    checkpoint = done[-1] if done else train(config, progress=False)
    train_s = time.perf_counter() - began

    setup = build_training(config)  # the same vocabulary mapping; then the trained weights
    weights = load_file(str(Path(checkpoint) / "model.safetensors"))
    _, unexpected = setup.draft.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    module = setup.module.eval()
    module.cod = CODConfig(config.num_depths, 1.0, 1.0, None)  # every depth at every position
    module.sequence_partitions = 1
    held = open_training_data(str(heldout_data(out, target, args.heldout)))
    rows = PackedBatches(held, config.total_seq_len, seed=0)
    correct = valid = 0
    with torch.no_grad():
        for i in range(len(rows)):
            stats = module.forward_batch(rows.batch(0, i))
            correct, valid = correct + stats.correct.double(), valid + stats.valid.double()
    acc = correct / valid
    metrics = [json.loads(line) for line in open(Path(config.save_path) / "metrics.jsonl")]
    result = {
        "name": args.name, "overrides": overrides, "steps": metrics[-1]["step"],
        "train_s": round(train_s), "accuracy_per_depth": [round(a, 3) for a in acc.tolist()],
        "AL_est": round(1 + float(torch.cumprod(acc, 0).sum()), 3),
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
