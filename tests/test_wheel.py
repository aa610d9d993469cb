"""The package as users install it: a wheel and an sdist built from the tracked files alone,
the wheel installed into a fresh virtual environment, and its commands run from there.

The fresh environment gets the wheel only; its dependencies (torch, speculators, vLLM, ...)
are read from this test's environment through a ``.pth`` line, so nothing is downloaded. A
path added by a ``.pth`` line is not itself scanned for ``.pth`` files, so the editable
install of this checkout is not active there: what runs is the wheel.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
PACKAGE = "speculators_peagle_plugin"
pytestmark = pytest.mark.slow


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [name for name in out.stdout.decode().split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The wheel and sdist of a copy of the tracked files (a clean checkout, no build debris)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in tracked_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    dist = tmp / "dist"
    for build in ("build_wheel", "build_sdist"):  # one process each: setuptools keeps state
        code = f"import sys; from setuptools import build_meta; build_meta.{build}(sys.argv[1])"
        subprocess.run([sys.executable, "-c", code, dist], cwd=src, capture_output=True,
                       check=True)
    (wheel,), (sdist,) = dist.glob("*.whl"), dist.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "tmp": tmp}


def test_the_wheel_holds_every_file_the_package_tracks(built):
    names = set(zipfile.ZipFile(built["wheel"]).namelist())
    package_files = {name for name in tracked_files() if name.startswith(PACKAGE + "/")}
    assert package_files <= names, sorted(package_files - names)
    assert any(name.startswith(PACKAGE + "/data/prompt_files/") and name.endswith(".jsonl")
               for name in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(built["wheel"]).read(entry_points).decode()
    for group in ("[console_scripts]", "[speculators.algorithms]", "[vllm.general_plugins]"):
        assert group in text


def test_the_sdist_holds_every_tracked_file_a_build_needs(built):
    with tarfile.open(built["sdist"]) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    needed = {name for name in tracked_files() if name.startswith(PACKAGE + "/")}
    needed |= {"pyproject.toml", "README.md"}
    assert needed <= names, sorted(needed - names)


@pytest.fixture(scope="module")
def fresh_env(built) -> Path:
    """A new virtual environment with the wheel installed and this one's dependencies."""
    env = built["tmp"] / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(built["wheel"])], check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return env


def run_in(env: Path, *args: str) -> str:
    """Run ``args`` (a script of ``env``, or its python) away from the checkout."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run([str(env / "bin" / args[0]), *args[1:]], cwd=env, env=clean,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_installed_wheel_is_what_runs(fresh_env):
    where = run_in(fresh_env, "python", "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)")
    assert Path(where.strip()).is_relative_to(fresh_env), where


def test_the_installed_commands_run(fresh_env):
    assert "Usage:" in run_in(fresh_env, "speculators-peagle", "--help")
    assert "peagle" in run_in(fresh_env, "speculators-peagle", "algorithms")


def test_the_installed_package_finds_its_data_files(fresh_env):
    code = (
        f"from {PACKAGE}.data.prompts import load_prompt_set\n"
        f"from {PACKAGE}.demo.demo_config import DemoConfig\n"
        "print(len(load_prompt_set('chat')), DemoConfig().train_config)"
    )
    count, yaml_path = run_in(fresh_env, "python", "-c", code).split()
    assert int(count) > 100
    assert Path(yaml_path).is_relative_to(fresh_env) and Path(yaml_path).is_file()
