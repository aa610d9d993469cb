"""The demo on a tiny target, every stage's command run in the demo's own process: cheap
enough to kill at many points (``helpers.kills``).

:func:`install` puts the stand-ins in place: the target stage gives ``target`` instead of
SmolLM2, and each ``speculators-peagle`` command runs in this process (eval on the reference
backend). :func:`recipe` writes the recipe and training YAML that size every stage down.
"""

from __future__ import annotations

from pathlib import Path

import yaml

TRAIN = {"algorithm": "peagle", "num_layers": 1, "draft_arch": "llama", "draft_vocab_size": 40,
         "num_depths": 2, "total_seq_len": 96, "lr": 0.01, "epochs": 1, "seed": 3,
         "checkpoint_freq": 1.0, "dtype": "float32", "autocast": "none", "device": "cpu"}
RECIPE = {"train_prompts": ["chat[0:2]"], "eval_prompts": ["chat[100:102]"],
          "max_new_tokens": 8, "num_samples": 1, "gen_backend": "transformers",
          "gen_batch_size": 2, "temperature": 1.0, "max_steps": 2, "num_speculative_tokens": 2,
          "eval_ks": [2], "eval_concurrency": [1, 2], "eval_prompts_per_slot": 1,
          "eval_max_new_tokens": 8, "eval_enforce_eager": True, "target_dtype": "float32"}
# what the demo's commands need besides the demo's flags on this target (4 layers)
EXTRA = {"generate-data": ("--target-layer-ids", "1,2,3"), "eval": ("--backend", "reference")}


def recipe(directory: Path, **train) -> Path:
    """``directory/recipe.yaml`` (with its ``train.yaml`` beside it: ``TRAIN``, with the keys
    of ``train`` set, or left out where None)."""
    keys = {k: v for k, v in {**TRAIN, **train}.items() if v is not None}
    (directory / "train.yaml").write_text(yaml.safe_dump(keys))
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, "train_config": "train.yaml"}))
    return path


def install(target: str, monkeypatch=None) -> None:
    """The stand-ins, in place for good, or until the test ends with pytest's
    ``monkeypatch``."""
    from speculators_peagle_plugin.cli import main
    from speculators_peagle_plugin.demo import pipeline

    def command(args: list[str], echo, stage: str) -> None:
        args = [*args, *EXTRA.get(args[0], ())]
        try:
            main.main(args=args, prog_name="speculators-peagle", standalone_mode=False)
        except SystemExit as exc:
            if exc.code:
                raise pipeline.DemoError(f"stage '{stage}' failed ({exc.code}).") from None

    put = setattr if monkeypatch is None else monkeypatch.setattr
    put(pipeline, "materialise_smollm2", lambda: Path(target))
    put(pipeline, "_command", command)
