"""``generate-data --data-parallel-size D``: ``D`` processes on this machine, each making its
part of the data (:mod:`.shard_plan`), then joined into ``--output`` (:mod:`.join`).

Replica ``r`` runs ``generate-data`` on part ``I*D + r`` of ``N*D`` (``I/N`` is ``--shard``,
``0/1`` without it) into ``OUTPUT/replicas/<I*D+r>-of-<N*D>``, which resumes on its own; its
settings (``<name>.yaml``) and its log (``<name>.log``) lie beside it. On CUDA a replica sees
``tensor_parallel_size`` GPUs of its own (``CUDA_VISIBLE_DEVICES``); on CPU it gets its share
of the cores (affinity, ``OMP_NUM_THREADS``, vLLM's ``VLLM_CPU_OMP_THREADS_BIND``) and a KV
cache of ``--kv-cache-gb`` GiB (``CPU_KV_CACHE_GB // D`` without it). When all are done,
their parts are joined into ``OUTPUT``, which then holds what one process makes, and the
replicas' directories go.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

from ..common.devices import cpu_shares, start_on_cores, usable_cores
from ..common.errors import UserError
from ..common.files import atomic_write_json
from ..common.reading import read_json
from ..data.dataset import TrainingData, open_training_data
from ..data.layout import (
    HIDDEN_STATES_DIR,
    REPLICAS_DIR,
    ROW_PROMPTS_FILE,
    SETTINGS_FILE,
    hs_path,
)
from ..engine.vllm_client import CPU_KV_CACHE_GB
from .datagen_config import DataGenConfig
from .join import join_parts
from .shard_plan import piece_size

logger = logging.getLogger(__name__)


def generate_with_replicas(
    config: DataGenConfig, output: Path, settings: dict, prompts
) -> TrainingData:
    """:func:`~.build_data.generate_data` with ``config.data_parallel_size`` replicas, in the
    output it has opened and checked (``settings``, ``prompts``: what it opened)."""
    replies = config.replies
    conversations = len(prompts) * replies.num_samples
    piece = piece_size(replies.batch_size, replies.num_samples)
    parts = [config.part.replica(r, config.data_parallel_size)
             for r in range(config.data_parallel_size)]
    # a replica whose span holds no piece has nothing to make
    parts = [p for p in parts if (s := p.span(conversations, piece))[0] < s[1]]
    environments = _environments(config, len(parts))
    if not (output / SETTINGS_FILE).exists():
        atomic_write_json(output / SETTINGS_FILE, settings)
    if not _complete(output):
        dirs = [output / REPLICAS_DIR / f"{p.index}-of-{p.count}" for p in parts]
        _run_replicas(config, parts, dirs, environments)
        join_parts(dirs, output, settings["shard"])
    shutil.rmtree(output / REPLICAS_DIR, ignore_errors=True)
    data = open_training_data(output, num_aux_layers=len(settings["target_layer_ids"]))
    data.vocab_mapping(config.draft_vocab_size)
    return data


def _complete(output: Path) -> bool:
    """Whether the replicas' parts were joined into ``output`` (and their directories went)."""
    if (output / REPLICAS_DIR).exists() or not (output / ROW_PROMPTS_FILE).exists():
        return False
    if not (output / "state.json").exists():
        return False
    rows = len(read_json(output / ROW_PROMPTS_FILE, list))
    return all(hs_path(output / HIDDEN_STATES_DIR, i).exists() for i in range(rows))


def _environments(config: DataGenConfig, replicas: int) -> list[tuple[dict, list[int] | None]]:
    """``(environment, cores or None)`` of each replica: its GPUs, or its share of the cores."""
    import torch

    tp = config.tensor_parallel_size
    base = dict(os.environ)
    uses_gpu = config.device.startswith("cuda") or "vllm" in (
        config.replies.backend, config.capture_backend
    )
    if torch.cuda.is_available() and uses_gpu:
        visible = base.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if replicas * tp > len(gpus):
            raise UserError(
                f"--data-parallel-size {replicas} with --tensor-parallel-size {tp} needs "
                f"{replicas * tp} GPUs and this machine has {len(gpus)}; use "
                f"--data-parallel-size {len(gpus) // tp} or less."
            )
        return [({**base, "CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tp : (r + 1) * tp])}, None)
                for r in range(replicas)]
    cores = usable_cores()
    if replicas * tp > len(cores):
        raise UserError(
            f"--data-parallel-size {replicas} with --tensor-parallel-size {tp} needs "
            f"{replicas * tp} CPU cores, one per rank, and this machine has {len(cores)}; use "
            f"--data-parallel-size {max(1, len(cores) // tp)} or less."
        )
    return [({**base, **variables}, mine) for variables, mine in cpu_shares(replicas, tp)]


def _replica_config(config: DataGenConfig, part, directory: Path, on_cpu: bool) -> dict:
    kv_cache_gb = config.engine.kv_cache_gb
    if kv_cache_gb is None and on_cpu:
        kv_cache_gb = max(1, CPU_KV_CACHE_GB // config.data_parallel_size)
    device = "cuda" if config.device.startswith("cuda") else config.device
    return config.replace(
        output=str(directory), shard=str(part), data_parallel_size=1, kv_cache_gb=kv_cache_gb,
        device=device,
    ).to_dict()


def _run_replicas(config: DataGenConfig, parts, dirs: list[Path], environments) -> None:
    """Run the replicas at once; wait for all; a failed one is one sentence naming it."""
    running = []
    try:
        for part, directory, (env, cores) in zip(parts, dirs, environments, strict=True):
            directory.parent.mkdir(parents=True, exist_ok=True)
            settings = directory.with_name(directory.name + ".yaml")
            atomic_write_json(settings, _replica_config(config, part, directory, cores is not None))
            log = directory.with_name(directory.name + ".log")
            command = [sys.executable, "-m", "speculators_peagle_plugin", "generate-data",
                       "--config", str(settings)]
            process = start_on_cores(command, env, cores, log)
            logger.info("Replica %s of %d: %s (log %s).", part, len(parts), directory, log)
            running.append((part, log, process))
        failed = [(part, log, process.wait()) for part, log, process in running]
    finally:
        for _, _, process in running:
            if process.poll() is None:
                process.terminate()
                process.wait()
    for part, log, code in failed:
        if code != 0:
            last = _last_error(log)
            raise UserError(
                f"Replica {part} of --data-parallel-size {config.data_parallel_size} failed "
                f"(exit {code}{': ' + last if last else ''}); its log is {log}; run the same "
                "command again to resume."
            )


def _last_error(log: Path) -> str:
    """The log's last ``Error:`` line (a replica's one-sentence refusal), else ''."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [line.strip() for line in lines if line.startswith("Error:")]
    return errors[-1].rstrip(".") if errors else ""
