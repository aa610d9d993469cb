"""Hidden states recorded while vLLM generates the replies: no second pass over the rows.

A vLLM worker extension (:func:`recording_extension`: the engine builds its ``LLM`` with
``worker_extension_cls=RECORDER`` and calls its start and stop around a job's requests),
loaded by vLLM inside its worker. While recording, hooks on the target's decoder
layers keep the residual stream of every token the engine computes (each prompt's prefill
and each decode step's fed-back token) as vLLM's own aux capture takes it: id ``L`` is the
sum ``hidden_states + residual`` after ``L`` decoder layers (transformers'
``hidden_states[L]``), and id ``N``, the layer count, is the final residual stream before the
norm. So ``(*layer_ids, N)`` gives the ``[seq, n_aux+1, H]`` of :mod:`.capture`.

When a request finishes, its states go to ``<dir>/<request id>.safetensors`` as
``{"hidden_states": [seq, n, H], "token_ids": [seq], "first_computed": [1]}`` in the engine's
dtype, written under a temporary name and renamed. ``seq`` is every token but the reply's
last: the engine samples that one and the request ends, so it is never fed back and has no
state. A prompt prefix that vLLM found in its prefix cache is not computed again either: its
slots hold zeros, ``first_computed`` says where the computed ones start, and
:func:`~.capture_vllm.place_recorded` copies them from the request that computed the prefix
(the same tokens at the same positions have the same states).

Needs eager execution (hooks do not run inside a compiled graph) and one pipeline stage.
Under tensor parallelism the residual stream is whole on every rank; only rank 0 records.

Legend: ``T`` = tokens of one engine step (all requests), ``n`` = recorded layers.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from ..common.files import atomic_write
from ..engine.vllm_client import WorkerExtension
from .capture import save_safetensors

logger = logging.getLogger(__name__)

RECORDER = f"{__name__}.HiddenStatesRecorder"
FIRST_COMPUTED_KEY = "first_computed"  # [1]: the first position whose states were computed


class _Recording:
    """The hooks and per-request buffers of one recording on one model runner."""

    def __init__(self, runner, out_dir: Path, layer_ids: list[int]):
        self.runner, self.out_dir = runner, out_dir
        layers = runner.model.model.layers
        self.layer_ids = layer_ids
        self.step: dict[int, torch.Tensor] = {}  # layer id -> [T, H] of the running forward
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # input_ids, positions
        # request id -> chunks of (positions [t], token ids [t], states [t, n, H])
        self.chunks: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.prefixes: dict[str, torch.Tensor] = {}  # request id -> token ids it found cached
        self.written = self.incomplete = 0
        self.handles = [
            runner.model.register_forward_pre_hook(self._before, with_kwargs=True),
            runner.model.register_forward_hook(self._after),
        ]
        for layer_id in set(layer_ids):
            if layer_id == 0:  # the embeddings: the first layer's input
                hook = layers[0].register_forward_pre_hook(self._keeper_of_input(layer_id))
            else:
                hook = layers[layer_id - 1].register_forward_hook(self._keeper(layer_id))
            self.handles.append(hook)
        self.execute_model = runner.execute_model
        runner.execute_model = self._execute_model

    def _keeper(self, layer_id: int):
        def keep(module, args, output) -> None:
            hidden_states, residual = output
            self.step[layer_id] = hidden_states + residual

        return keep

    def _keeper_of_input(self, layer_id: int):
        def keep(module, args) -> None:
            self.step[layer_id] = args[1]  # (positions, hidden_states, residual=None)

        return keep

    def _before(self, module, args, kwargs) -> None:
        names = ("input_ids", "positions")
        values = [kwargs[k] if k in kwargs else args[i] for i, k in enumerate(names)]
        self.inputs = (values[0], values[1])
        self.step = {}

    def _after(self, module, args, output) -> None:
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        starts = self.runner.query_start_loc.np[: num_reqs + 1].tolist()
        num_tokens = starts[-1]  # the forward may run on a padded batch
        # copies: the runner reuses its input buffers every step
        input_ids, positions = (
            t[:num_tokens].to("cpu", torch.long, copy=True) for t in self.inputs
        )
        # [T, n, H]
        states = torch.stack([self.step[i][:num_tokens] for i in self.layer_ids], dim=1).cpu()
        for r, req_id in enumerate(batch.req_ids[:num_reqs]):
            a, b = starts[r], starts[r + 1]
            if req_id not in self.chunks:  # its first step starts after its cached prefix
                prompt = self.runner.requests[req_id].prompt_token_ids
                self.prefixes[req_id] = torch.tensor(prompt[: int(positions[a])], dtype=torch.long)
                self.chunks[req_id] = []
            # views: a step's states live while a request it served still decodes
            self.chunks[req_id].append((positions[a:b], input_ids[a:b], states[a:b]))
        self.inputs, self.step = None, {}

    def _execute_model(self, scheduler_output, *args, **kwargs):
        for req_id in scheduler_output.finished_req_ids:
            self.finish(req_id)
        return self.execute_model(scheduler_output, *args, **kwargs)

    def finish(self, req_id: str) -> None:
        """Write ``req_id``'s states if every position after its cached prefix was computed."""
        chunks = self.chunks.pop(req_id, None)
        prefix = self.prefixes.pop(req_id, None)
        if not chunks:
            return
        positions, ids, values = (torch.cat(parts) for parts in zip(*chunks, strict=True))
        length = 1 + int(positions.max())
        # Each position's latest computation: a request computed again after a preemption
        # keeps its latest states. latest[p] = index into the chunks' rows, -1 if none.
        latest = torch.full((length,), -1, dtype=torch.long)
        latest.scatter_reduce_(0, positions, torch.arange(len(positions)), reduce="amax")
        computed = latest >= 0
        states = values.new_zeros((length, *values.shape[1:]))
        states[computed] = values[latest[computed]]
        token_ids = torch.zeros(length, dtype=torch.long)
        token_ids[: len(prefix)] = prefix
        token_ids[computed] = ids[latest[computed]]
        first = int(computed.int().argmax())
        if first > len(prefix) or not bool(computed[first:].all()):
            self.incomplete += 1  # tokens neither computed nor cached: left to a capture pass
            return
        path = self.out_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', req_id)}.safetensors"
        tensors = {
            "hidden_states": states.contiguous(),
            "token_ids": token_ids,
            FIRST_COMPUTED_KEY: torch.tensor([first]),
        }
        atomic_write(path, lambda tmp: save_safetensors(tensors, tmp))
        self.written += 1

    def close(self) -> dict:
        for req_id in list(self.chunks):
            self.finish(req_id)
        for handle in self.handles:
            handle.remove()
        del self.runner.execute_model  # the class's method again
        return {"written": self.written, "incomplete": self.incomplete}


class HiddenStatesRecorder:
    """Worker extension: ``collective_rpc("start_recording", args=(spec,))`` before a job's
    requests, ``collective_rpc("stop_recording")`` after them (which writes the requests not
    yet written and returns ``{"written", "incomplete"}`` per rank).

    ``spec``: ``{"dir": directory for the files, "layer_ids": [ids, each in [0, N]]}``.
    ``start_recording`` returns None, or one sentence saying why this engine cannot record
    (then nothing is hooked and the job runs as usual).
    """

    def start_recording(self, spec: dict) -> str | None:
        from vllm.config import CompilationMode
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        config = self.model_runner.vllm_config
        if config.compilation_config.mode != CompilationMode.NONE:
            return "the engine runs a compiled model (hooks need enforce_eager=True)"
        if get_pp_group().world_size > 1:
            return "the engine runs pipeline parallel (a rank holds only some layers)"
        model = self.model_runner.model
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            return f"{type(model).__name__} has no model.layers list to hook"
        layer_ids = [int(i) for i in spec["layer_ids"]]
        if not all(0 <= i <= len(layers) for i in layer_ids):
            return f"layer ids {layer_ids} are not all in [0, {len(layers)}]"
        if get_tensor_model_parallel_rank() == 0:  # the other ranks hold the same states
            out_dir = Path(spec["dir"])
            out_dir.mkdir(parents=True, exist_ok=True)
            self._recording = _Recording(self.model_runner, out_dir, layer_ids)
        return None

    def stop_recording(self) -> dict:
        recording, self._recording = getattr(self, "_recording", None), None
        return {"written": 0, "incomplete": 0} if recording is None else recording.close()


def recording_extension(spec: dict) -> WorkerExtension:
    """The engine's :class:`~..engine.vllm_client.WorkerExtension` that records ``spec``
    (:class:`HiddenStatesRecorder`'s) during a job."""
    start, stop = HiddenStatesRecorder.start_recording, HiddenStatesRecorder.stop_recording
    return WorkerExtension(cls=RECORDER, start=start.__name__, stop=stop.__name__, spec=spec)
