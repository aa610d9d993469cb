"""``speculators-peagle selftest``: run the checks, print a line each, exit 1 on any FAIL."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from datetime import UTC, datetime
from pathlib import Path

import click
import torch

from ..options import SectionedCommand, config_command
from .selftest_config import Options, SelftestConfig
from .selftest_report import FAIL, PASS, SKIP, Check, as_dicts, stack, stack_lines, write_record
from .shapes import SHAPES

SEARCH_S = 60  # per side: the longest-row search's time on CUDA (not with --quick)


def speculators_problem() -> str | None:
    """None if speculators' P-EAGLE imports here, else why not, in one sentence."""
    try:
        import speculators.models.peagle.core  # noqa: F401
    except ImportError as err:
        return (
            f"speculators is not usable here ({type(err).__name__}: {err}); our draft is "
            "built on its EAGLE-3 classes, so only the attention kernels were checked "
            "(pip install speculators)."
        )
    return None


def _measure(side: str, options: Options) -> dict:
    """One side's speed record; on CPU in a fresh process (its own peak RSS)."""
    from .perf import measure_side

    lens = options.seq_lens + (options.ours_seq_lens if side == "ours" else ())
    spec = {
        "side": side, "shape": options.shape, "device": str(options.device),
        "seq_lens": list(lens), "warmup": 1, "steps": 1 if options.quick else 3,
        "search_s": 0 if options.quick or options.device.type != "cuda" else SEARCH_S,
    }
    if options.profile:
        spec["profile"] = str(Path(options.json_path).with_name(
            f"profile-{side}-{options.seq_lens[0]}.txt"))
    if options.device.type == "cuda":
        return measure_side(spec)
    cmd = [sys.executable, "-m", "speculators_peagle_plugin.selftest.perf", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    why = "killed (out of memory?)" if done.returncode < 0 else f"exited {done.returncode}"
    return {"side": side, "error": f"its process {why}: {tail}"}


def _speed_checks(results: dict[str, dict]) -> list[Check]:
    """A line per side and row length, the ratios, and each side's longest row.

    Ours not running, or not fitting a row asked for, FAILs: the row lengths are the
    user's. speculators' side not fitting is a finding about it (SKIP).
    """
    checks = []
    for side, result in results.items():
        if "error" in result:
            checks.append(Check(f"step {side}", FAIL, result["error"]))
            continue
        for n, rec in result["lengths"].items():
            name = f"step {side} {int(n):,} tokens"
            if "error" in rec:
                status = SKIP if side != "ours" and rec["error"] == "out of memory" else FAIL
                checks.append(Check(name, status, rec["error"], rec))
                continue
            n_seg = rec.get("segments")
            parts = f" ({n_seg} segment{'s' * (n_seg > 1)})" if n_seg else ""
            detail = f"{rec['tokens_per_s']:,.0f} tokens/s, peak {rec['peak_gib']:.2f} GiB{parts}"
            if result.get("note"):
                detail += f" ({result['note']})"
            checks.append(Check(name, PASS, detail, rec))
        if "longest_row" in result:
            row = result["longest_row"]
            how = "" if row["complete"] else " or more (search stopped)"
            checks.append(Check(f"longest row {side}", PASS, f"{row['tokens']:,} tokens{how}", row))
    return checks


def ratio_lines(results: dict[str, dict]) -> list[str]:
    """``ours / speculators`` tokens/s and peak memory at each length both ran."""
    ours, theirs = results.get("ours", {}), results.get("speculators", {})
    lines = []
    for n, a in ours.get("lengths", {}).items():
        b = theirs.get("lengths", {}).get(n, {})
        if "tokens_per_s" in a and "tokens_per_s" in b:
            lines.append(
                f"ratio {int(n):,} tokens: ours {a['tokens_per_s'] / b['tokens_per_s']:.2f}x "
                f"speculators' tokens/s at {a['peak_gib'] / b['peak_gib']:.2f}x its peak memory"
            )
    return lines


def run_selftest(options: Options, echo=click.echo) -> dict:
    """Every check on ``options.device``; returns the record (``passed``: no FAIL)."""
    from .checks import attention_checks, flex_compile_check, step_checks
    from .distributed_checks import distributed_checks

    info = stack(options.device)
    for line in stack_lines(info):
        echo(line)
    mode = "quick" if options.quick else "full"
    lens = ", ".join(f"{n:,}" for n in options.seq_lens)
    echo(f"shape: {options.shape} ({mode}), speed rows: {lens} tokens")
    shape = SHAPES[options.shape]
    checks: list[Check] = []
    results: dict[str, dict] = {}
    record = {
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": sys.argv, "stack": info, "shape": options.shape, "quick": options.quick,
        "seq_lens": list(options.seq_lens), "checks": [], "speed": results,
    }

    def report(name: str, run) -> list[Check]:
        """``run()``'s checks; an exception in it is a FAIL of ``name``, and the rest goes on."""
        if options.device.type == "cuda":
            # Each section starts with no compiled variants, as a training process does:
            # the sections' many dtypes and windows together pass dynamo's recompile limit.
            torch._dynamo.reset()
        try:
            new = run()
        except Exception as err:  # noqa: BLE001 - whatever broke is the finding
            why = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
            new = [Check(name, FAIL, why, {"traceback": traceback.format_exc()})]
        for check in new:
            echo(check.line())
        checks.extend(new)
        record["checks"] = as_dicts(checks)
        record["passed"] = not any(c.status == FAIL for c in checks)
        if options.json_path:  # after every section: a run cut short still leaves its record
            write_record(options.json_path, record)
        return new

    length = 60 if options.quick else 120
    device, seeds = options.device, options.seeds
    report("attention", lambda: attention_checks(shape, device, seeds, length))
    problem = speculators_problem()
    if problem:
        report("speculators", lambda: [Check("draft, step and speed checks", SKIP, problem)])
    else:
        report("training step", lambda: step_checks(shape, device, seeds, length + 1))
        for side in ("ours", "speculators"):

            def measure(side=side):
                results[side] = _measure(side, options)
                return _speed_checks({side: results[side]})

            report(f"step {side}", measure)
        if device.type == "cuda":
            report("flex_attention compiled", lambda: [flex_compile_check()])
        record["ratios"] = ratio_lines(results)
        for line in record["ratios"]:
            echo(line)
        warmup, steps = 1, 1 if options.quick else 3
        report("torchrun", lambda: distributed_checks(shape, device, options.seq_lens[0], warmup,
                                                      steps, options.quick))
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, FAIL, SKIP)}
    echo(f"selftest: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped")
    if options.json_path:
        echo(f"record: {options.json_path}")
    return record


@click.command(cls=SectionedCommand)
@config_command(SelftestConfig)
def selftest(config: SelftestConfig) -> None:
    """Check the kernels and the training step on this machine; exit 1 on any FAIL."""
    if not run_selftest(config.options())["passed"]:
        raise SystemExit(1)
