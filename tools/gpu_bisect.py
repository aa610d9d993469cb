"""Which part of the CUDA step breaks it: our step at real sizes under each arm, on a GPU.

Usage (on the GPU machine, from the repository root, after the wheels of
``tools.prepare_gpu`` are installed; ``command.sh`` runs it before the selftest)::

    python3 -m tools.gpu_bisect [--shape llama8b] [--seq-lens 8192,32768] [--out DIR]

The arms switch the parts of the CUDA step that the CPU cannot run, each alone:

- ``region``: the draft's forward and loss as one compiled region
  (``training/draft_loss.py``), or off: eager layers around compiled flex attention;
- ``full``: the ``BlockMask`` index lists as wide as ``create_block_mask``'s (one column
  per key block), or as wide as the longest list (``kernels/cod_block_mask.py``'s CUDA
  default);
- ``contiguous``: flex attention takes contiguous ``q, k, v`` (``kernels/flex.py``'s
  ``flex_inputs``, as speculators passes its own), or the draft's transposed views, as the
  H200's failing runs did.

Each arm runs in a fresh process (a CUDA fault ends only that arm): ``selftest``'s step
(bfloat16 autocast, one partition per 4,096 tokens, AdamW) from one random draft on one
row, two steps at each length, shortest first. Every step's loss, gradient norm (a
forward fault shows in the loss, a backward one in the norm first) and time print when
the arm ends (an arm cut by its timeout keeps the steps it reached), then the last step's
tokens/s and the allocator's peak since the arm began. A
longer row runs only while every loss and norm so far is finite. One JSON line per arm
goes to ``DIR/bisect.jsonl`` (``$OUT`` by default, which the device tool sends back).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
import traceback

ARMS = {  # name: (region, full width, contiguous q/k/v)
    "as shipped": (True, False, True),
    "strided q/k/v": (True, False, False),
    "no region": (False, False, True),
    "full width": (True, True, True),
}
STEPS = 2
ARM_TIMEOUT_S = 120


def run_arm(name: str, shape_name: str, seq_lens: list[int], device: str = "cuda") -> dict:
    """One arm, here: the step at each length; stops at the first non-finite loss or error."""
    import torch

    from speculators_peagle_plugin.kernels import attention, cod_block_mask, flex
    from speculators_peagle_plugin.selftest.perf import _ours, _peak_gib, _sync, make_row
    from speculators_peagle_plugin.selftest.shapes import SHAPES
    from speculators_peagle_plugin.training import draft_loss

    region, full, contiguous = ARMS[name]
    if not region:
        draft_loss.REGION_DEVICES = ()
    if full:
        attention.cod_block_mask = functools.partial(cod_block_mask.cod_block_mask,
                                                     full_width=True)
    if not contiguous:
        flex.flex_inputs = lambda q, k, v: (q, k, v)
    device = torch.device(device)
    cuda = device.type == "cuda"
    shape = SHAPES[shape_name]
    step = _ours(shape, device, "bfloat16" if cuda else "none")
    out = {"arm": name, "region": region, "full_width": full, "contiguous": contiguous,
           "lengths": {}}
    for seq_len in seq_lens:
        record = {"losses": [], "grad_norms": [], "step_s": []}
        out["lengths"][seq_len] = record
        try:
            batch = make_row(shape, seq_len, device, torch.bfloat16 if cuda else torch.float32)
            for i in range(STEPS):
                _sync(device)
                began = time.perf_counter()
                loss = step(batch, i)
                _sync(device)
                record["step_s"].append(round(time.perf_counter() - began, 3))
                record["losses"].append(loss)
                record["grad_norms"].append(step.grad_norm)
                print(f"  {name}: {seq_len} tokens, step {i}: loss {loss:.4f}, gradient norm "
                      f"{step.grad_norm:.4g}, {record['step_s'][-1]} s", flush=True)
            record["tokens_per_s"] = round(seq_len / record["step_s"][-1])
            record["peak_gib"] = round(_peak_gib(device), 2)
        except Exception as err:  # noqa: BLE001 - the arm's record says what broke
            record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            record["traceback"] = traceback.format_exc()[-2000:]
            break
        if not all(math.isfinite(x) for x in record["losses"] + record["grad_norms"]):
            break
    failed = draft_loss.flex.compile_failures
    if failed:
        out["compile_failures"] = {" ".join(map(str, k)): v for k, v in failed.items()}
    return out


def arm_record(name: str, child: list[str], timeout_s: float) -> tuple[dict, str]:
    """Run one arm's process: its record (an error with the step lines it printed when it
    ran past ``timeout_s``; its exit code and stderr when it printed none) and its stdout."""
    try:
        done = subprocess.run(child, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:  # the steps it reached still count
        stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        return {"arm": name, "error": f"timed out after {timeout_s} s",
                "steps": [line.strip() for line in stdout.splitlines()
                          if line.startswith("  ")]}, stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("ARM ")]
    record = (json.loads(lines[-1][4:]) if lines else
              {"arm": name, "exit": done.returncode, "stderr": done.stderr[-2000:]})
    return record, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama8b")
    parser.add_argument("--seq-lens", default="8192,32768")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--device", default="cuda", help="cuda; cpu only checks the tool")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # a child runs one arm
    args = parser.parse_args()
    seq_lens = sorted(int(n) for n in args.seq_lens.split(","))
    if args.arm:
        print("ARM " + json.dumps(run_arm(args.arm, args.shape, seq_lens, args.device)), flush=True)
        return
    path = os.path.join(args.out, "bisect.jsonl")
    for name in ARMS:
        print(f"arm {name!r}", flush=True)
        child = [sys.executable, "-m", "tools.gpu_bisect", "--arm", name, "--shape", args.shape,
                 "--seq-lens", args.seq_lens, "--device", args.device]
        record, stdout = arm_record(name, child, ARM_TIMEOUT_S)
        print("\n".join(line for line in stdout.splitlines() if line.startswith("  ")),
              flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        summary = {n: {k: r.get(k) for k in ("tokens_per_s", "peak_gib", "error")} | {
            "losses": r.get("losses")} for n, r in record.get("lengths", {}).items()}
        print(f"  -> {summary or record}", flush=True)


if __name__ == "__main__":
    main()
