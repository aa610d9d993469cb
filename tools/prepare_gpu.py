"""Prepare a bare GPU machine (torch, no stack of ours) for ``selftest --device cuda``.

Usage (here, with network)::

    .venv/bin/python -m tools.prepare_gpu [--out runs/gpu-wheels]

It lists the distributions the selftest imports (:data:`SELFTEST_MODULES`, imported
here in a fresh process), drops those the GPU machine's image holds (:data:`GPU_IMAGE`),
downloads the rest as wheels for that machine's Python (``pip
download --no-deps --only-binary=:all:``, each at the version installed here, the one the
tests ran with), builds our own wheel from the tree, checks that the wheels and the
working tree fit the machine's 64 MiB per call, and writes ``OUT/command.sh``: the ONE
command to run there, from the repository root (docs/selftest.md).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OWN = "speculators-peagle-plugin"
# Every distribution the lent GPU machine's image holds (its listing of 2026-11-17: Python
# 3.12, torch 2.11 for CUDA 13, transformers 5.17, triton 3.6). A name, not the closure of
# a few names' requirements by THIS machine's metadata: newer versions here require what
# the image lacks (huggingface-hub here needs pydantic; the image has no pydantic).
GPU_IMAGE = frozenset(
    """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
    attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama
    contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x
    cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
    fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-
    cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader
    lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-
    cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-
    cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-
    hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
    pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
    safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
    sentence-transformers setuptools shellingham simplejson six sortedcontainers
    statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
    threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq
    torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
    typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
    xarray xxhash yarl zipp
    """.split()
)
PYTHON_VERSION = "3.12"
# pip matches each manylinux tag exactly: every tag the machine's glibc runs is named.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
BUDGET_MIB = 64  # files per call to the GPU machine: the working tree and the wheels
# Everything the selftest imports, its lazy imports included; tests/test_selftest.py
# checks this against what a selftest run really imports.
SELFTEST_MODULES = (
    "speculators_peagle_plugin.selftest.__main__",
    "speculators_peagle_plugin.selftest.checks",
    "speculators_peagle_plugin.selftest.perf",
    "speculators_peagle_plugin.selftest.distributed_checks",
    "speculators_peagle_plugin.model.peagle_draft",
    "speculators_peagle_plugin.training.train_config",
    "speculators_peagle_plugin.training.distributed",
    "speculators_peagle_plugin.training.peagle_trainer",
    "speculators_peagle_plugin.training.step",
    "speculators.models.peagle.core",
    "speculators.losses",
    "speculators.train.config.schema",
    "torch.distributed.run",
    "transformers.models.qwen3.modeling_qwen3",
)
# Both sides at 8K and 32K tokens, ours also at 64K and 128K in partitions, the longest row
# per side, and a profiler table per side at 8K; its time budget is in docs/selftest.md.
RUN_ARGS = ("--device cuda --shape llama8b --seq-lens 8192,32768 --ours-seq-lens 65536,131072 "
            "--profile")
RECORD = '"${OUT:-.}/selftest-cuda.json"'  # $OUT: what the device tool sends back
# One call's shares of a lent machine's 10 minutes a command (its 15 minutes a session,
# starts included, leave room for one call): the selftest's record is rewritten after
# every section, so a cut-off run keeps what it measured.
BISECT_S, SELFTEST_S = 300, 270

_LIST_DISTRIBUTIONS = """
import importlib, json, sys
from importlib.metadata import packages_distributions
for name in sys.argv[1:]:
    importlib.import_module(name)
owners = packages_distributions()
tops = {m.split(".")[0] for m in list(sys.modules)}
print(json.dumps(sorted({d for t in tops for d in owners.get(t, [])})))
"""


def normalize(name: str) -> str:
    """A distribution's canonical name (PEP 503): lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_distributions(modules=SELFTEST_MODULES) -> set[str]:
    """The distributions whose modules are loaded after importing ``modules`` (fresh process)."""
    done = subprocess.run(
        [sys.executable, "-c", _LIST_DISTRIBUTIONS, *modules],
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    return {normalize(d) for d in json.loads(done.stdout.splitlines()[-1])}


def wheels_to_ship() -> dict[str, str]:
    """``{distribution: version here}`` the selftest imports and the GPU machine lacks."""
    missing = imported_distributions() - GPU_IMAGE - {OWN}
    return {name: distribution(name).version for name in sorted(missing)}


def tree_bytes() -> int:
    """The working tree the device tool copies: tracked and untracked, not ignored."""
    done = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    files = (REPO / f for f in done.stdout.splitlines())
    return sum(f.stat().st_size for f in files if f.is_file())


def download(pins: dict[str, str], out: Path) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", PYTHON_VERSION, *platforms, "--implementation", "cp",
           "-d", str(out), *(f"{n}=={v}" for n, v in pins.items())]
    subprocess.run(cmd, check=True)


def build_own_wheel(out: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
           "-w", str(out), str(REPO)]
    subprocess.run(cmd, check=True, capture_output=True)


def gpu_command(wheel_dir: str) -> str:
    """The one command to run on the GPU machine from the repository root: the bisect of
    the step's CUDA parts (tools/gpu_bisect.py), then the selftest, each within its share
    of one call (BISECT_S, SELFTEST_S); both records land in ``$OUT``."""
    install = f"python3 -m pip install -q --no-deps --no-index {shlex.quote(wheel_dir)}/*.whl"
    bisect = f'timeout {BISECT_S} python3 -m tools.gpu_bisect --out "${{OUT:-.}}"'
    run = (f"timeout {SELFTEST_S} python3 -m speculators_peagle_plugin.selftest {RUN_ARGS} "
           f"--json {RECORD}")
    return f"{install} && {{ {bisect}; {run}; }}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default="runs/gpu-wheels",
        help="Wheels and command.sh go here: inside the repository, ignored by git (the "
        "device tool carries it) [default: runs/gpu-wheels].",
    )
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    if not out.is_relative_to(REPO):
        sys.exit(f"--out {args.out}: it must lie inside the repository ({REPO}), "
                 "so the device tool can carry it.")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    pins = wheels_to_ship()
    print("wheels the GPU machine lacks:", ", ".join(f"{n}=={v}" for n, v in pins.items()))
    download(pins, out)
    build_own_wheel(out)
    wheels = sorted(out.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels) + tree_bytes()
    rel = out.relative_to(REPO)
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    print(f"wheels + working tree: {total / 2**20:.1f} MiB of {BUDGET_MIB} MiB")
    if total > BUDGET_MIB * 2**20:
        sys.exit(f"{total / 2**20:.1f} MiB does not fit the GPU machine's {BUDGET_MIB} MiB per "
                 "call; ship fewer wheels.")
    command = gpu_command(str(rel))
    (out / "command.sh").write_text(f"#!/bin/sh\n# from the repository root\n{command}\n")
    print(f"\nOn the GPU machine, from the repository root (carry {rel}):\n\n  {command}\n")


if __name__ == "__main__":
    main()
