"""Which distributions a command's Python processes import: a ``sitecustomize`` hook loaded
into every process of the run (through PYTHONPATH) writes, at exit, the distributions its
modules came from and whether vLLM was imported."""

import json
import textwrap
from pathlib import Path

RECORD_IMPORTS = """
import atexit, json, os, sys

def _record():
    from importlib.metadata import packages_distributions
    owners = packages_distributions()
    tops = {m.split(".")[0] for m in list(sys.modules)}
    dists = sorted({d for t in tops for d in owners.get(t, [])})
    path = os.path.join(os.environ["IMPORTS_DIR"], f"{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"argv": sys.argv, "dists": dists, "vllm": "vllm" in sys.modules}, f)

atexit.register(_record)
"""


def recording_hook(root: Path) -> tuple[Path, Path]:
    """The hook's directory (to put first on PYTHONPATH, with ``IMPORTS_DIR`` set to the
    second path) and the directory the processes write their records to."""
    hook, imports = root / "hook", root / "imports"
    hook.mkdir()
    imports.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(RECORD_IMPORTS))
    return hook, imports


def recorded(imports: Path) -> list[dict]:
    """Every process's record: ``{"argv", "dists", "vllm"}``."""
    return [json.loads(p.read_text()) for p in imports.glob("*.json")]
