"""eval.processes: a benchmark stopped by SIGTERM leaves nothing behind."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BENCHMARK = """
import os, sys, tempfile, time
from pathlib import Path
from eval.processes import exit_on_sigterm, started
if sys.argv[2] == "1":
    exit_on_sigterm()
with tempfile.TemporaryDirectory(dir=sys.argv[1]) as tmp:
    with started(["sleep", "600"], dict(os.environ), Path(tmp) / "server.log") as server:
        print(tmp, server.pid, flush=True)
        time.sleep(600)
"""


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("handled", [True, False], ids=["exit_on_sigterm", "python's default"])
def test_a_benchmark_stopped_by_sigterm_deletes_its_temporary_directory_and_stops_its_server(
    tmp_path, handled
):
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCHMARK, str(tmp_path), str(int(handled))],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
    )
    tmp, server = bench.stdout.readline().split()
    server = int(server)
    try:
        assert Path(tmp).is_dir() and not _gone(server)
        bench.send_signal(signal.SIGTERM)
        code = bench.wait(60)
        if handled:
            assert code == 128 + signal.SIGTERM
            assert not Path(tmp).exists() and _gone(server)
        else:  # the oracle: without the handler both are left behind
            assert code == -signal.SIGTERM
            assert Path(tmp).is_dir() and not _gone(server)
    finally:
        if not _gone(server):
            os.killpg(server, signal.SIGKILL)
