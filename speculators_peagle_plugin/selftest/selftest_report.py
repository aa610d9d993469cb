"""What ``selftest`` reports: one line per check, the stack it ran on, a JSON record."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version

import torch

from ..common.files import atomic_write_text

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Check:
    """One check's verdict: ``status`` PASS, FAIL or SKIP, ``detail`` one line, ``data``
    the figures behind it (errors and their tolerances, timings)."""

    name: str
    status: str
    detail: str
    data: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail}"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|``, both in float64 on the CPU.

    Scaled by the reference's largest entry, not entry by entry: a near-zero entry of a
    gradient would otherwise turn harmless rounding into a large ratio.
    """
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    scale = float(want.abs().max()) if want.numel() else 0.0
    return float((got - want).abs().max()) / max(scale, 1e-30) if want.numel() else 0.0


def verdict(name: str, errors: dict[str, float], tolerance: float, what: str) -> Check:
    """PASS iff every error is within ``tolerance``; ``detail`` names the worst one."""
    errors = {k: float("inf") if e != e else e for k, e in errors.items()}  # NaN: the worst
    worst = max(errors, key=errors.get)
    ok = errors[worst] <= tolerance
    detail = f"{what}; worst {worst} {errors[worst]:.1e} (tolerance {tolerance:.0e})"
    return Check(name, PASS if ok else FAIL, detail, {"errors": errors, "tolerance": tolerance})


def dist_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def stack(device: torch.device) -> dict:
    """Versions and the device: what the verdicts hold for."""
    info = {
        "python": platform.python_version(),
        "speculators-peagle-plugin": dist_version("speculators-peagle-plugin"),
        "torch": torch.__version__,
        "transformers": dist_version("transformers"),
        "speculators": dist_version("speculators"),
        "triton": dist_version("triton"),
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "gpu_count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    return info


def stack_lines(info: dict) -> list[str]:
    names = ("python", "torch", "transformers", "speculators", "speculators-peagle-plugin")
    versions = ", ".join(f"{n} {info[n] or 'not installed'}" for n in names)
    where = info.get("gpu") or f"{info['cpu']}, {info['threads']} threads"
    count = f" x{info['gpu_count']}" if info.get("gpu_count", 1) > 1 else ""
    return [f"versions: {versions}", f"device: {info['device']} ({where}{count})"]


def write_record(path: str, record: dict) -> None:
    atomic_write_text(path, json.dumps(record, indent=1, default=str) + "\n")


def as_dicts(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
