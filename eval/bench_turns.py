"""Replies to conversations of several user turns: each conversation's next turn sent as
soon as its reply is in (generate-data's way), against turn by turn in lockstep (every
conversation's turn t answered before any turn t + 1 is asked).

    .venv/bin/python -m eval.bench_turns [--demo-dir runs/demo]
        [--prompts "sharegpt_turns[:256]"] [--kv-cache-gb 1] [--repeats 2]

Both arms run ``generate-data`` in this process on the demo's target and reply settings
(its data's ``generation_settings.json``: new tokens, temperature, dtype, batch), into a
fresh directory each, with the same prompts and seeds, so they draw the same replies (up to
the rounding of batched arithmetic). The lockstep arm answers each turn's follow-ups as the
next batch of the job, as the transformers backend does. Per arm: the replies stage's wall
time (``generate_responses``, its engine's start included) and the prompt tokens vLLM found
in its prefix cache. The arms alternate ``--repeats`` times; the machine must be otherwise
idle.

The default cache is smaller than the demo's: a whole job's rounds (thousands of
conversations) are larger than any cache, and ``--kv-cache-gb 1`` holds less than one round
of the 256 conversations, as in such a job.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from eval.demo_run import demo_inputs
from eval.processes import exit_on_sigterm
from speculators_peagle_plugin.cli import main as cli
from speculators_peagle_plugin.datagen import build_data, generation


def lockstep(generate):
    """``Target.generate`` answering the follow-ups of a batch as the next batch, once every
    reply of this one is in: the turns of a job in lockstep."""

    def rounds(self, prompts, seeds, on_reply, on_event=None, record=None, follow_ups=False):
        first = 0
        while prompts:
            added = []

            def collect(j, reply, first=first, added=added):
                added.extend(on_reply(first + j, reply) or [])

            generate(self, prompts, seeds, collect, on_event, record)
            first += len(prompts)
            prompts, seeds = [p for p, _ in added], [s for _, s in added]

    return rounds


def arm(args: list[str], in_lockstep: bool) -> dict:
    """One generate-data run: the replies stage's seconds, reply tokens, prefix-cache hits."""
    measured = {}
    replies = build_data.generate_responses

    def timed(target, *rest):
        began = time.perf_counter()
        made = replies(target, *rest)
        measured["s"] = time.perf_counter() - began
        measured["tokens"] = sum(sum(row["loss_mask"]) for _, row in made)
        measured.update(target.prefix_cache)
        return made

    real = generation.Target.generate
    build_data.generate_responses = timed
    if in_lockstep:
        generation.Target.generate = lockstep(real)
    try:
        cli(args, standalone_mode=False)
    finally:
        build_data.generate_responses, generation.Target.generate = replies, real
    return measured


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo-dir", default="runs/demo")
    parser.add_argument("--prompts", default="sharegpt_turns[:256]")
    parser.add_argument("--kv-cache-gb", type=int, default=1, help="vLLM's KV cache, GiB [1].")
    parser.add_argument("--repeats", type=int, default=2, help="Rounds of both arms [2].")
    args = parser.parse_args()
    demo = demo_inputs(Path(args.demo_dir))
    settings = json.loads((Path(demo["data"]) / "generation_settings.json").read_text())
    print(f"{args.prompts} on {demo['target']}: {settings['max_new_tokens']} new tokens, "
          f"temperature {settings['temperature']}, {demo['dtype']}, batch "
          f"{demo['gen_batch_size']}, KV cache {args.kv_cache_gb} GiB\n")
    print("| round | arm | replies stage (s) | reply tokens/s | prompt tokens cached / looked up |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="bench-turns-") as tmp:
        for round_ in range(1, args.repeats + 1):
            for name in ("lockstep", "pipelined"):
                out = Path(tmp) / f"{name}-{round_}"
                got = arm([
                    "generate-data", "--target", demo["target"], "--prompts", args.prompts,
                    "--output", str(out), "--max-new-tokens", str(settings["max_new_tokens"]),
                    "--temperature", str(settings["temperature"]), "--num-samples", "1",
                    "--backend", "vllm", "--kv-cache-gb", str(args.kv_cache_gb),
                    "--dtype", demo["dtype"], "--batch-size", str(demo["gen_batch_size"]),
                ], in_lockstep=name == "lockstep")
                cached = got["hits"] / max(got["queries"], 1)
                print(f"| {round_} | {name} | {got['s']:.0f} | {got['tokens'] / got['s']:.1f} | "
                      f"{cached:.1%} of {got['queries']:,} |", flush=True)


if __name__ == "__main__":
    main()
