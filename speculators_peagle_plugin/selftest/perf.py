"""One training step of ours and of speculators' built-in P-EAGLE: speed, memory, reach.

Shapes: ``L`` tokens per row, ``A * H`` aux features, ``H`` target hidden size.

Both sides start from ONE random draft of the shape (speculators' copy loads our
weights) and take the same row: one document of ``L`` tokens, every position supervised
but the first, the same COD settings (ours' defaults, no anchor cap). A step is forward,
backward, gradient clipping at 1.0 and an AdamW step:

- ours: :func:`~speculators_peagle_plugin.training.step.train_step`, the step of
  ``speculators-peagle train``, with one segment per ``SEGMENT_TOKENS`` of the row;
- theirs: speculators' ``PEagleDraftModel.forward`` as its ``Trainer`` calls it. On CUDA
  that is its own GPU path (flex attention, its forward compiled, its default fused
  loss); on CPU, where flex attention has no backward, SDPA over a dense mask and the
  eager loss, as ``eval/side_by_side.py`` runs it.

On CUDA forwards run under bfloat16 autocast with bfloat16 hidden states, as
speculators' ``Trainer`` runs them; on CPU in float32. Peak memory is the CUDA
allocator's peak on CUDA, and the process's peak RSS on CPU, where each side runs in a
fresh subprocess (``python -m speculators_peagle_plugin.selftest.perf``) so its peak is
its own. The longest row each side fits is searched on CUDA only: an out-of-memory there
is an exception to catch, on a CPU the kernel kills the process.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import resource
import statistics
import sys
import time

import torch

from ..core.peagle_config import CODConfig
from ..kernels import flex
from ..model.build import DEFAULT_SLIDING_WINDOW
from .shapes import SHAPES, build_draft, speculators_twin, trainer_for

SEGMENT_TOKENS = 4096  # ours: one sequence partition per this many tokens of the row
SEARCH_CAP = 1 << 20  # the longest-row search stops here (tokens)
SIDES = ("ours", "speculators")


def segments_for(seq_len: int) -> int:
    return max(1, math.ceil(seq_len / SEGMENT_TOKENS))


def make_row(shape, seq_len: int, device: torch.device, dtype: torch.dtype) -> dict:
    """speculators' packed batch of one document of ``seq_len`` random tokens and states."""
    gen = torch.Generator(device).manual_seed(seq_len)
    aux = len(shape.aux_layer_ids) * shape.hidden_size
    loss_mask = torch.ones(1, seq_len, device=device)
    loss_mask[0, 0] = 0
    return {
        "input_ids": torch.randint(0, shape.vocab_size - 1, (1, seq_len), generator=gen,
                                   device=device),
        "hidden_states": torch.randn(1, seq_len, aux, generator=gen, device=device, dtype=dtype),
        "verifier_last_hidden_states": torch.randn(1, seq_len, shape.hidden_size, generator=gen,
                                                   device=device, dtype=dtype),
        "document_ids": torch.zeros(1, seq_len, dtype=torch.long, device=device),
        "loss_mask": loss_mask,
    }


def _ours(shape, device: torch.device, autocast: str, window: int = DEFAULT_SLIDING_WINDOW):
    """Our step: ``step(batch, index) -> loss`` (the module re-planned per row length)."""
    from ..training.distributed import StepModule, World, wrap
    from ..training.step import gradient_norm, train_step
    from ..training.train_config import TrainConfig

    draft = build_draft(shape, device, seed=0, window=window)
    module = trainer_for(draft)
    world = World(0, 1, device)
    params = [p for p in draft.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)

    def step(batch: dict, index: int) -> float:
        seq_len = batch["input_ids"].shape[1]
        segments = segments_for(seq_len)
        module.peagle = dataclasses.replace(module.peagle, sequence_partitions=segments)
        # the step reads no path: these only satisfy the config's checks
        config = TrainConfig.from_sources(
            verifier_name_or_path="selftest", data_path="selftest", save_path="selftest",
            sequence_partitions=segments, autocast=autocast, device=str(device),
        )
        wrapped = wrap(StepModule(module, every_parameter=False), config, world)
        optimizer.zero_grad(set_to_none=True)
        stats = train_step(wrapped, module, batch, config, world, index)
        step.grad_norm = gradient_norm(params, 1.0)  # before clipping: a fault shows here first
        optimizer.step()
        return float(stats["loss_sum"] / stats["total_den"].clamp(min=1))

    return step


def _theirs(shape, device: torch.device, autocast: str, loss_impl: str | None = None):
    """speculators' step as its ``Trainer`` takes it: ``step(batch, index) -> loss``.

    ``loss_impl``: its loss implementation [default: its own default on CUDA, its eager
    loss on CPU, where its fused loss has no kernel]."""
    from speculators.losses import resolve_loss_config
    from speculators.train.config.schema import LossArgs

    cuda = device.type == "cuda"
    ours = build_draft(shape, device, seed=0, window=DEFAULT_SLIDING_WINDOW)
    model = speculators_twin(ours, shape, DEFAULT_SLIDING_WINDOW,
                             "simple_flex_attention" if cuda else "sdpa")
    del ours
    model.train()
    impl = loss_impl or (LossArgs.model_fields["loss_implementation"].default if cuda else "eager")
    cod = CODConfig()
    kwargs = dict(loss_config=resolve_loss_config("kl_div", impl), max_anchors=cod.max_anchors,
                  num_depths=cod.num_depths, down_sample_ratio=cod.down_sample_ratio,
                  down_sample_ratio_min=cod.down_sample_ratio_min)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)

    def run(batch: dict, index: int) -> float:
        torch.manual_seed(index)  # its COD sampler draws from the global generator
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast != "none"):
            _, loss, _ = model(**batch, **kwargs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return float(loss.detach())

    def step(batch: dict, index: int) -> float:
        """Its default loss; where that fails on this stack (not for memory), its eager
        loss from then on, said in ``step.note``: the step is still speculators' own."""
        try:
            return run(batch, index)
        except Exception as err:  # noqa: BLE001 - a broken default is the finding
            if impl == "eager" or out_of_memory(err) or step.note:
                raise
            why = (str(err).strip().splitlines() or [""])[0][:200]
            step.note = (f"its {impl} loss failed here ({type(err).__name__}: {why}); "
                         "measured with its eager loss")
            kwargs["loss_config"] = resolve_loss_config("kl_div", "eager")
            return run(batch, index)

    step.note = None
    return step


def profile_step(step, batch: dict, device: torch.device, path: str) -> str:
    """One more step under ``torch.profiler``; its 20 costliest kernels (by their own CUDA
    time; on CPU, by their own CPU time) as a table in ``path``. Returns ``path``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step(batch, 0)
        _sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=20)
    with open(path, "w") as f:
        f.write(table + "\n")
    return path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is the allocator running out (compiled code may re-raise it as a
    plain RuntimeError with the allocator's message)."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _fits(step, shape, seq_len, device, dtype) -> bool:
    """One step at ``seq_len``: True if it ran, False on an out-of-memory."""
    try:
        step(make_row(shape, seq_len, device, dtype), 0)
        return True
    except RuntimeError as err:
        if out_of_memory(err):
            return False
        raise
    finally:
        _free(device)


def longest_row(step, shape, start: int, device, dtype, budget_s: float) -> dict:
    """The longest row (multiple of 1024 tokens) one step fits: doubling from ``start``,
    then bisecting to an eighth; ``complete`` False when the time budget or the search
    cap stopped it first."""
    lo, hi, began = start, None, time.perf_counter()
    while time.perf_counter() - began < budget_s:
        if hi is None:
            if lo * 2 > SEARCH_CAP:
                break
            trial = lo * 2
        elif hi - lo <= max(1024, lo // 8):
            break
        else:
            trial = (lo + hi) // 2 // 1024 * 1024
            if trial <= lo:  # no multiple of 1024 left between them
                break
        if _fits(step, shape, trial, device, dtype):
            lo = trial
        else:
            hi = trial
    complete = hi is not None and hi - lo <= max(1024, lo // 8)
    return {"tokens": lo, "first_failing": hi, "complete": complete,
            "search_s": round(time.perf_counter() - began, 1)}


def measure_side(spec: dict) -> dict:
    """One side's step at each row length (ascending), and its longest row when asked.

    ``spec``: ``side``, ``shape``, ``device``, ``seq_lens``, ``warmup``, ``steps``,
    ``search_s`` (0: no search), optionally ``window`` (ours' draft; default speculators').
    Each length: ``tokens_per_s`` (the row's tokens over the median step), ``peak_gib``,
    ``loss``, and ``segments`` for ours; or ``error``.
    """
    device = torch.device(spec["device"])
    shape = SHAPES[spec["shape"]]
    cuda = device.type == "cuda"
    autocast, dtype = ("bfloat16", torch.bfloat16) if cuda else ("none", torch.float32)
    if spec["side"] == "ours":
        step = _ours(shape, device, autocast, spec.get("window", DEFAULT_SLIDING_WINDOW))
    else:
        step = _theirs(shape, device, autocast)
    failed_before = dict(flex.compile_failures)
    out = {"side": spec["side"], "lengths": {}}
    fitted = 0
    for seq_len in sorted(spec["seq_lens"]):
        record = {"segments": segments_for(seq_len)} if spec["side"] == "ours" else {}
        batch = None
        try:
            batch = make_row(shape, seq_len, device, dtype)
            times = []
            for i in range(spec["warmup"] + spec["steps"]):
                if cuda and i == spec["warmup"]:
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                began = time.perf_counter()
                loss = step(batch, i)
                _sync(device)
                times.append(time.perf_counter() - began)
            median = statistics.median(times[spec["warmup"] :])
            record |= {"tokens_per_s": seq_len / median, "step_s": median, "loss": loss,
                       "peak_gib": _peak_gib(device)}
            if spec.get("profile") and seq_len == min(spec["seq_lens"]):
                record["profile"] = profile_step(step, batch, device, spec["profile"])
            if not math.isfinite(loss):
                record["error"] = f"non-finite loss {loss}"
            else:
                fitted = seq_len
        except RuntimeError as err:
            if not out_of_memory(err):
                raise
            record["error"] = "out of memory"
        del batch
        _free(device)
        out["lengths"][str(seq_len)] = record
    if spec["search_s"] and fitted:
        out["longest_row"] = longest_row(step, shape, fitted, device, dtype, spec["search_s"])
    notes = [getattr(step, "note", None)]
    failed = flex.failures_since(failed_before)
    if spec["side"] == "ours" and failed:
        notes.append(f"did not compile ({failed}); the exact fallback ran")
    if any(notes):
        out["note"] = "; ".join(n for n in notes if n)
    return out


if __name__ == "__main__":  # one side, in its own process: `python -m ...perf SPEC_JSON`
    print("RESULT " + json.dumps(measure_side(json.loads(sys.argv[1]))), flush=True)
