"""``python -m speculators_peagle_plugin.selftest``: the selftest alone, without the rest of
the command line (what a bare GPU machine runs, see tools/prepare_gpu.py)."""

from .command import selftest

if __name__ == "__main__":
    selftest()
