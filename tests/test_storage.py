"""Hidden-state storage: the disk estimate, the free-space refusal, the 8-bit format.

Oracles: float64 arithmetic of float8_e4m3fn's rounding bound, hand-computed sizes, and
files written by generate-data read back through the training reader.
"""

import logging
import shutil
from collections import namedtuple

import pytest
import torch
from click.testing import CliRunner
from helpers.chat_target import LAYER_IDS, MAX_NEW, gen_args
from hs_connectors.fp8_utils import SCALES_KEY
from safetensors.torch import load_file

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.common import paths as paths_mod
from speculators_peagle_plugin.data import open_training_data
from speculators_peagle_plugin.data.storage import (
    FLOAT8,
    StorageEstimate,
    bytes_per_token,
    stored_tensors,
    token_bound,
)

E4M3_MAX = 448.0
E4M3_RELATIVE = 2.0**-4  # 3 mantissa bits: round-to-nearest error <= half an ulp = 2^-4 |x|
E4M3_SUBNORMAL_STEP = 2.0**-9  # below 2^-6 values are multiples of 2^-9 (times the scale)


def float8_error_bound(states: torch.Tensor) -> torch.Tensor:
    """Per element, the most a float8 round trip may move it (float64): half a step."""
    x = states.double()
    scale = x.abs().amax(dim=(1, 2), keepdim=True) / E4M3_MAX
    return torch.maximum(x.abs() * E4M3_RELATIVE, scale * E4M3_SUBNORMAL_STEP / 2) * (1 + 1e-6)


def test_float8_round_trip_stays_within_half_a_float8_step():
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    torch.manual_seed(0)
    # Rows of very different magnitudes: the per-token scale must follow each.
    states = torch.randn(64, 4, 96) * torch.logspace(-3, 3, 64)[:, None, None]
    states[5] = 0.0  # an all-zero token (scale clamped) comes back as zeros
    tensors = stored_tensors(states, torch.arange(64), FLOAT8)
    assert tensors["hidden_states"].dtype == torch.float8_e4m3fn
    assert tensors[SCALES_KEY].shape == (64, 1, 1) and tensors[SCALES_KEY].dtype == torch.float32
    back = dequantize_fp8_tensor(tensors["hidden_states"], tensors[SCALES_KEY], torch.float32)
    error = (back.double() - states.double()).abs()
    assert bool((error <= float8_error_bound(states)).all()), error.max()
    assert torch.equal(back[5], torch.zeros_like(back[5]))
    # The bound is tight: the worst relative error of normal values is near 2^-4.
    big = states.abs() > states.abs().amax(dim=(1, 2), keepdim=True) / 8
    assert float((error / states.abs().double())[big].max()) > 0.5 * E4M3_RELATIVE


def test_bytes_per_token_and_token_bound_by_hand():
    # 3 aux layers + the final one of hidden 4096: 4 * 4096 values per token, + int64 id.
    assert bytes_per_token(4096, 3, "bfloat16") == 4 * 4096 * 2 + 8 == 32776
    assert bytes_per_token(4096, 3, "float32") == 4 * 4096 * 4 + 8
    assert bytes_per_token(4096, 3, FLOAT8) == 4 * 4096 * 1 + 4 + 8 == 16396
    # Two conversations: [10] and [12, 30] prompt tokens per user turn, 100 new tokens per
    # reply; the second turn's row also holds the first reply. 2 samples per prompt.
    assert token_bound([[10], [12, 30]], 100, 2) == 2 * ((10 + 100) + (12 + 100) + (30 + 200))
    estimate = StorageEstimate(bytes_per_token=100, tokens=50, existing_bytes=1200)
    assert (estimate.total_bytes, estimate.needed_bytes) == (5000, 3800)
    # float8 files of states recorded in bfloat16 while generating: the recordings set the peak
    staged = StorageEstimate(100, 50, 1200, staged_bytes_per_token=180)
    assert (staged.total_bytes, staged.needed_bytes) == (5000, 180 * 50 - 1200)
    assert "at the peak" in staged.summary() and "at the peak" not in estimate.summary()


@pytest.fixture(scope="module")
def prompts_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text('{"prompt": "hello world"}\n{"prompt": "the quick brown fox"}\n')
    return path


@pytest.fixture(scope="module")
def stored(tmp_path_factory, target_dir, prompts_path):
    """The same prompts written in the target's dtype and in float8."""
    root = tmp_path_factory.mktemp("stored")
    for name, extra in (("plain", []), ("float8", ["--hidden-states-dtype", "float8"])):
        result = CliRunner().invoke(main, gen_args(target_dir, prompts_path, root / name, *extra))
        assert result.exit_code == 0, result.output
    return root


def test_estimate_is_printed_and_bounds_the_written_files(stored, target_dir, prompts_path):
    for name, dtype in (("plain", "float32"), ("float8", FLOAT8)):
        per_token = bytes_per_token(64, len(LAYER_IDS), dtype)
        files = sorted((stored / name / "hidden_states").glob("hs_*.safetensors"))
        for path in files:
            seq = load_file(path)["token_ids"].shape[0]
            assert 0 <= path.stat().st_size - per_token * seq < 512  # the safetensors header
    from transformers import AutoTokenizer

    from speculators_peagle_plugin.data import load_prompts, render_conversation

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_prompts(str(prompts_path), None)
    bound = sum(len(render_conversation(tokenizer, p)) + MAX_NEW for p in prompts)
    assert bound >= sum(len(load_file(p)["token_ids"]) for p in files)


def test_float8_files_read_back_dequantized_within_the_bound(stored):
    plain = open_training_data(stored / "plain", num_aux_layers=len(LAYER_IDS))
    eight = open_training_data(stored / "float8", num_aux_layers=len(LAYER_IDS))
    raw = load_file(stored / "float8" / "hidden_states" / "hs_0.safetensors")
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn and SCALES_KEY in raw
    eight.validate(progress=False)
    for i in range(len(plain.dataset)):
        # The training reader's own transfer: what its samples are cut from.
        exact = plain.dataset.transfer.get_cached(i)["hidden_states"]
        back = eight.dataset.transfer.get_cached(i)["hidden_states"]
        assert eight.dataset[i]["hidden_states"].dtype == torch.float32
        assert back.dtype == exact.dtype == torch.float32
        error = (back.double() - exact.double()).abs()
        assert bool((error <= float8_error_bound(exact)).all())


def test_refuses_to_start_when_the_disk_cannot_hold_the_estimate(
    target_dir, prompts_path, tmp_path, monkeypatch
):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, gen_args(target_dir, prompts_path, out))
    assert result.exit_code != 0
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error") and "needs about" in last and "1000 B free" in last, last
    assert not out.exists()  # nothing written before the refusal
    assert paths_mod.shutil is shutil  # the module that asks the disk


def test_falls_back_to_transformers_with_one_log_line(
    target_dir, prompts_path, tmp_path, monkeypatch, caplog
):
    from speculators_peagle_plugin.datagen import build_data

    def cannot(*args):
        raise RuntimeError("vLLM could not run the job: NotImplementedError: no such backend")

    monkeypatch.setattr(build_data, "write_hidden_states_vllm", cannot)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        result = CliRunner().invoke(
            main, gen_args(target_dir, prompts_path, out, "--hidden-states-from", "vllm")
        )
    assert result.exit_code == 0, result.output
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    fallback = [m for m in warnings if "capturing them with transformers" in m]
    assert len(fallback) == 1 and "no such backend" in fallback[0], warnings
    assert len(list((out / "hidden_states").glob("hs_*.safetensors"))) == 2
