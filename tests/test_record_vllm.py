"""Hidden states recorded by the replies' vLLM engine (``--hidden-states-from generation``)
on the tiny vLLM target: every token but the reply's last has the transformers capture's
state, the last has zeros and no loss, no second pass runs, and the data trains.

Oracle: :func:`capture_hidden_states` (transformers, aux ``hidden_states[L]`` + the final
norm's input) on each written row, in float32. One generate-data run per module: 3 samples
of each prompt with two requests in flight (requests finish while others still decode, and
a prompt's third sample finds its first blocks in vLLM's prefix cache: prompts longer than
a 128-token block), and one conversation of two user turns (its second prompt holds the
first turn).
"""

import json
import logging

import pytest
import torch
from click.testing import CliRunner
from datasets import load_from_disk
from safetensors.torch import load_file
from test_capture_vllm import no_transformers_capture
from test_capture_vllm import test_vllm_written_data_trains as trains
from tiny_vllm import PROMPTS
from transformers import AutoModelForCausalLM

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.common.files import atomic_write
from speculators_peagle_plugin.datagen import build_data, capture_vllm
from speculators_peagle_plugin.datagen.capture import capture_hidden_states, pending_rows
from speculators_peagle_plugin.datagen.capture_vllm import RECORDED_DIR
from speculators_peagle_plugin.datagen.generation import Target
from speculators_peagle_plugin.datagen.vllm_recorder import (
    FIRST_COMPUTED_KEY,
    RECORDER,
    HiddenStatesRecorder,
    _Recording,
    recording_extension,
)
from speculators_peagle_plugin.engine.vllm_client import VllmJob
from speculators_peagle_plugin.engine.vllm_worker import _start_extension

pytestmark = pytest.mark.slow

LAYER_IDS = (0, 2, 3)  # 0: the embeddings, the first layer's input; N = 4: the final state


def nothing_left(config, output, layer_ids, settings):
    """The vLLM capture pass's stand-in: every row must have its states already."""
    shape_tail = (len(layer_ids) + 1, settings["target_hidden_size"])
    left = pending_rows(output, shape_tail)[2]
    assert not left, f"the replies' engine recorded no states for rows {left}"
    return 0


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("recorded")
    prompts = root / "prompts.jsonl"
    two_turns = {
        "messages": [
            {"role": "user", "content": PROMPTS[5]},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": PROMPTS[6]},
        ]
    }
    # byte tokens: 2 prompts longer than one 128-token KV block, so that samples share blocks
    long = [" ".join(PROMPTS[:6]), " ".join(PROMPTS[2:8])]
    rows = [*({"prompt": p} for p in [PROMPTS[0], *long]), two_turns]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = [
        "generate-data", "--target", str(target), "--prompts", str(prompts), "--output",
        str(root / "data"), "--backend", "vllm", "--hidden-states-from", "generation",
        "--max-new-tokens", "16", "--batch-size", "2", "--temperature", "0.8",
        "--num-samples", "3", "--target-layer-ids", ",".join(map(str, LAYER_IDS)),
        "--draft-vocab-size", "64", "--kv-cache-gb", "1",
    ]
    # a worker that comes back to this module builds the fixture again: note this run only
    FIRST_COMPUTED.clear()
    RECORDINGS_LEFT.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_data, "write_hidden_states", no_transformers_capture)
        patch.setattr(build_data, "write_hidden_states_vllm", nothing_left)
        patch.setattr(
            build_data, "place_recorded", noting_cached_prefixes(build_data.place_recorded)
        )
        patch.setattr(capture_vllm, "atomic_write", noting_recordings_left(root / "data"))
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return root / "data"


FIRST_COMPUTED: list[int] = []  # per recording: where its computed states start


def noting_cached_prefixes(place):
    def noting(config, output, shape_tail):
        for path in (output / "hidden_states" / RECORDED_DIR).glob("*.safetensors"):
            FIRST_COMPUTED.append(int(load_file(path)[FIRST_COMPUTED_KEY][0]))
        return place(config, output, shape_tail)

    return noting


RECORDINGS_LEFT: list[int] = []  # per row's file written: the recordings still on disk


def noting_recordings_left(output):
    def noting(path, write):
        recordings = (output / "hidden_states" / RECORDED_DIR).glob("*.safetensors")
        RECORDINGS_LEFT.append(len(list(recordings)))
        return atomic_write(path, write)

    return noting


@pytest.fixture(scope="module")
def reference(target):
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def test_recorded_states_equal_the_transformers_capture(recorded, reference):
    assert not (recorded / "hidden_states" / RECORDED_DIR).exists()
    dataset = load_from_disk(str(recorded))
    assert len(dataset) == 15  # 3 prompts x 3 samples + 1 conversation x 3 samples x 2 turns
    # some samples found their prompt's first block cached and borrowed its states
    assert len(FIRST_COMPUTED) == 15 and sorted(set(FIRST_COMPUTED))[:2] == [0, 128]
    # the disk holds each row about once: a recording goes as soon as its rows' files are
    # written (identical samples share one recording's states; their twins go unread)
    twins = len(dataset) - len({tuple(ids[:-1]) for ids in dataset.with_format(None)["input_ids"]})
    assert RECORDINGS_LEFT == sorted(RECORDINGS_LEFT, reverse=True)
    assert RECORDINGS_LEFT[0] == 15 and RECORDINGS_LEFT[-1] <= 1 + twins
    longest_prompt = 0
    for i in range(len(dataset)):
        ids = torch.as_tensor(dataset[i]["input_ids"])
        mask = torch.as_tensor(dataset[i]["loss_mask"]).tolist()
        written = load_file(recorded / "hidden_states" / f"hs_{i}.safetensors")
        assert torch.equal(written["token_ids"], ids)
        expected = capture_hidden_states(reference, ids, LAYER_IDS)
        assert written["hidden_states"].shape == expected.shape == (len(ids), 4, 128)
        # the reply's last token was sampled, never fed back: zeros, and no loss on it
        torch.testing.assert_close(
            written["hidden_states"][:-1], expected[:-1], atol=1e-4, rtol=1e-4
        )
        assert not written["hidden_states"][-1].any()
        reply = mask.index(1)
        assert mask == [0] * reply + [1] * (len(ids) - reply - 1) + [0]
        longest_prompt = max(longest_prompt, reply)
    assert longest_prompt > 128


def test_recorded_data_trains(recorded, target, tmp_path):
    trains(recorded, target, tmp_path)


def test_generation_needs_the_vllm_backend(target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    result = CliRunner().invoke(
        main,
        [
            "generate-data", "--target", str(target), "--prompts", str(prompts), "--output",
            str(tmp_path / "out"), "--hidden-states-from", "generation",
        ],
    )
    assert result.exit_code != 0
    assert "needs backend vllm" in result.output
    assert not (tmp_path / "out").exists()


class FakeLLM:
    def __init__(self, reasons):
        self.reasons, self.calls = reasons, []

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        return self.reasons if method == "start_recording" else [{"written": 0}]


def test_an_engine_that_cannot_record_says_why_and_generates():
    llm = FakeLLM([None, "the engine caches prefixes"])
    recording = recording_extension({"dir": "d", "layer_ids": [1]})
    assert _start_extension(llm, recording) == {"error": "the engine caches prefixes"}
    assert llm.calls == ["start_recording", "stop_recording"]
    llm = FakeLLM([None, None])
    assert _start_extension(llm, recording) is None
    assert _start_extension(llm, None) is None and llm.calls == ["start_recording"]


def test_a_job_carries_its_worker_extension_through_the_protocol():
    recording = recording_extension({"dir": "d", "layer_ids": [1, 4]})
    assert recording.cls == RECORDER and hasattr(HiddenStatesRecorder, recording.start)
    assert hasattr(HiddenStatesRecorder, recording.stop)
    job = VllmJob(target="t", prompts=[[1]], max_tokens=1, batch_size=1, extension=recording)
    assert VllmJob.from_json(json.loads(json.dumps(job.to_json()))) == job
    plain = VllmJob(target="t", prompts=[[1]], max_tokens=1, batch_size=1)
    assert VllmJob.from_json(json.loads(json.dumps(plain.to_json()))) == plain


def test_target_generates_on_and_logs_once_when_vllm_cannot_record(target, tmp_path, caplog):
    class FakeWorker:
        def __init__(self):
            self.jobs = []

        def run(self, job, on_event=None):
            self.jobs.append(job)
            for j in range(len(job.prompts)):
                on_event({"event": "progress", "index": j, "token_ids": [5, 2]})
            error = {"error": "no layers to hook"} if job.extension else None
            return {"extension": error, "prefix_cache": {"queries": 0, "hits": 0}}

    from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    config = DataGenConfig.from_sources(
        target=str(target), prompts=str(prompts), output=str(tmp_path / "out"),
        backend="vllm", hidden_states_from="generation",
    )
    model = Target(config)
    model.vllm = FakeWorker()
    record = {"dir": str(tmp_path / "rec"), "layer_ids": [1, 4]}
    with caplog.at_level(logging.WARNING):
        replies = []
        for _ in range(2):
            model.generate([[1, 2, 3]], [9], lambda j, r: replies.append((j, r)), None, record)
    assert replies == [(0, [5, 2])] * 2
    first, second = model.vllm.jobs
    assert first.extension == recording_extension(record) and first.prefix_caching
    assert first.seeds is None  # greedy: no request needs a seed (nor whole prefills on CPU)
    assert second.extension is None  # asked once only
    assert sum("could not record" in r.message for r in caplog.records) == 1


def recording_of(chunks: dict, tmp_path, prefixes=None) -> _Recording:
    recording = object.__new__(_Recording)  # no runner: only the buffers and the write
    recording.out_dir, recording.chunks = tmp_path, chunks
    recording.prefixes = prefixes or {r: torch.zeros(0, dtype=torch.long) for r in chunks}
    recording.written = recording.incomplete = 0
    return recording


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_request_computed_again_keeps_its_latest_states(tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    length = int(torch.randint(3, 12, (1,), generator=gen))
    ids = torch.randint(0, 100, (length,), generator=gen)
    old = torch.randn(length, 2, 4, generator=gen)
    new = torch.randn(length, 2, 4, generator=gen)
    cut = int(torch.randint(1, length, (1,), generator=gen))

    def chunk(a, b, states):
        return torch.arange(a, b), ids[a:b], states[a:b]

    # prefill and decode steps, a preemption, then the whole request computed again in
    # chunks (chunked prefill) and decoded on
    chunks = [chunk(0, cut, old), chunk(cut, length, old), chunk(0, 1, new)]
    chunks += [chunk(1, cut, new)] if cut > 1 else []  # an engine step never has 0 tokens
    chunks += [chunk(p, p + 1, new) for p in range(cut, length)]
    recording = recording_of({"req-1": chunks}, tmp_path)
    recording.finish("req-1")
    written = load_file(tmp_path / "req-1.safetensors")
    assert torch.equal(written["hidden_states"], new)
    assert torch.equal(written["token_ids"], ids)
    assert written[FIRST_COMPUTED_KEY].tolist() == [0]
    assert recording.written == 1 and recording.chunks == {} and recording.prefixes == {}


def test_a_cached_prefix_is_written_as_zeros_with_its_token_ids(tmp_path):
    states, ids = torch.randn(7, 2, 4), torch.arange(10, 17)
    chunks = [(torch.arange(4, 6), ids[4:6], states[4:6]), (torch.tensor([6]), ids[6:], states[6:])]
    recording = recording_of({"r": chunks}, tmp_path, prefixes={"r": ids[:4]})
    recording.finish("r")
    written = load_file(tmp_path / "r.safetensors")
    assert written[FIRST_COMPUTED_KEY].tolist() == [4]
    assert torch.equal(written["token_ids"], ids)
    assert not written["hidden_states"][:4].any()
    assert torch.equal(written["hidden_states"][4:], states[4:])


def test_a_request_with_uncomputed_positions_is_left_to_the_capture_pass(tmp_path):
    states = torch.randn(6, 2, 4)
    ids = torch.arange(6)
    chunks = [(torch.arange(3, 6), ids[3:], states[3:])]  # 0..2: neither computed nor cached
    recording = recording_of({"a/b": chunks}, tmp_path, prefixes={"a/b": ids[:2]})
    recording.finish("a/b")
    recording.finish("never-seen")
    assert recording.incomplete == 1 and recording.written == 0
    assert list(tmp_path.iterdir()) == []
