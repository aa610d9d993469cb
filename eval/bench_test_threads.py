"""Two pytest workers computing at once: torch's default threads against a share each.

    .venv/bin/python -m eval.bench_test_threads [--procs 2] [--steps 100] [--repeats 3]

Starts ``--procs`` processes together, each running the same small-model work: forward and
backward passes of a tiny random llama, the size of the tests' targets. One arm leaves torch
its default threads (one per core, in every process); the other sets ``OMP_NUM_THREADS`` to
the cores over ``--procs``, as tests/conftest.py does for each pytest worker. The arms
alternate ``--repeats`` times; the table has each arm's slowest process, per round. The
machine must be otherwise idle: a process beside it is a third party to the contention.
"""

import argparse
import json
import os
import subprocess
import sys
import time


def work(steps: int) -> float:
    """Seconds for ``steps`` forward and backward passes of a tiny llama on 4 x 24 tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=4, vocab_size=96,
    ))
    ids = torch.randint(0, 96, (4, 24))
    model(ids, labels=ids).loss.backward()  # warm-up, outside the timing
    start = time.perf_counter()
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
    return time.perf_counter() - start


def arm(threads: int | None, procs: int, steps: int) -> float:
    """The slowest of ``procs`` processes started together, with ``threads`` OpenMP threads
    each (None: torch's default)."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "eval.bench_test_threads", "--worker", "--steps", str(steps)]
    children = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
                for _ in range(procs)]
    return max(json.loads(child.communicate()[0])["seconds"] for child in children)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, default=2, help="Processes at once [2].")
    parser.add_argument("--steps", type=int, default=100, help="Passes per process [100].")
    parser.add_argument("--repeats", type=int, default=3, help="Rounds of both arms [3].")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps({"seconds": work(args.steps)}))
        return
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // args.procs)
    print(f"{args.procs} processes at once on {cores} cores, {args.steps} passes each\n")
    print(f"| round | default threads (s) | {share} thread(s) each (s) | ratio |")
    print("|---|---|---|---|")
    for round_ in range(1, args.repeats + 1):
        default = arm(None, args.procs, args.steps)
        shared = arm(share, args.procs, args.steps)
        print(f"| {round_} | {default:.2f} | {shared:.2f} | {default / shared:.1f}x |")


if __name__ == "__main__":
    main()
