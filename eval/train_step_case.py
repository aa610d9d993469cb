"""One case of ``eval.bench_train_step`` in this process: a draft, a batch, timed steps.

The setup both sides share (module constants): a SmolLM2-135M-shaped verifier (config only,
no weights), the draft ``speculators train --speculator-type peagle`` builds by default, and
random but valid vocabulary mappings and verifier weights, the same on both sides.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from eval.measure import peak_rss_gib

VERIFIER_CFG = dict(  # SmolLM2-135M shape
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu",
    max_position_embeddings=8192, rms_norm_eps=1e-5, initializer_range=0.02,
    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
DRAFT_VOCAB = 8192
NUM_LAYERS = 1
SLIDING_WINDOW = 2048  # speculators CLI default (all draft layers sliding)
TARGET_LAYER_IDS = [2, 15, 27]  # speculators default for a 30-layer verifier
MASK_TOKEN_ID = 0  # the config's mask token; both sides feed it at depth >= 1
K, R, R_MIN = 8, 0.7, 0.2
LR, WEIGHT_DECAY = 1e-3, 0.01
DRAFT_ATTN_IMPL = "sdpa"


def build_model(model_cls, verifier_dir: str):
    """The draft ``speculators train --speculator-type peagle`` builds by default, as ``model_cls``.

    speculators' own ``from_training_args`` builds the config and the model from a
    config-only verifier saved in ``verifier_dir``; random but valid vocabulary mappings
    and random verifier weights stand in for ``build_vocab_mappings_*`` and
    ``load_verifier_weights``. Returns ``(model, t2d)``, identical for both sides: the
    same generator seed gives the same mappings and weights.
    """
    from unittest import mock

    import torch
    from speculators.models.peagle.core import PEagleDraftModel as SpeculatorsPEagle
    from speculators.train.cli import create_transformer_layer_config
    from transformers import LlamaConfig

    vcfg = LlamaConfig(**VERIFIER_CFG)
    vcfg.architectures = ["LlamaForCausalLM"]
    vcfg.save_pretrained(verifier_dir)  # config.json only
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=verifier_dir,
        num_layers=NUM_LAYERS,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=SLIDING_WINDOW,
        full_attention_indices=[],
    )

    g = torch.Generator().manual_seed(1234)
    V, H = VERIFIER_CFG["vocab_size"], VERIFIER_CFG["hidden_size"]
    selected = torch.randperm(V, generator=g)[:DRAFT_VOCAB].sort().values
    d2t = selected - torch.arange(DRAFT_VOCAB)  # offsets, speculators' format
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    # The verifier has no weights to load; the random ones below stand in for them.
    with mock.patch.object(model_cls, "load_verifier_weights", lambda self: None):
        model = SpeculatorsPEagle.from_training_args.__func__(
            model_cls, verifier_config=layer_config, t2d=t2d, d2t=d2t,
            verifier_name_or_path=verifier_dir, target_layer_ids=TARGET_LAYER_IDS,
            draft_vocab_size=DRAFT_VOCAB, mask_token_id=MASK_TOKEN_ID, num_depths=K,
            draft_attn_impl=DRAFT_ATTN_IMPL,
        )

    std = VERIFIER_CFG["initializer_range"]
    with torch.no_grad():
        verifier_embed = torch.randn(V, H, generator=g) * std
        lm_rows = verifier_embed[t2d]  # tied embeddings, rows picked by t2d
        model.embed_tokens.weight.copy_(verifier_embed)
        model.lm_head.weight.copy_(lm_rows)
        model.verifier_lm_head.weight.copy_(lm_rows)
        model.verifier_norm.weight.fill_(1.0)
    model.embed_tokens.weight.requires_grad_(model.config.embed_requires_grad)  # True
    model.lm_head.weight.requires_grad_(False)
    model.verifier_lm_head.weight.requires_grad_(False)
    model.verifier_norm.weight.requires_grad_(False)
    return model, t2d


def make_batch(S: int, seed: int = 0) -> dict:
    """speculators' packed batch: one document, loss mask all ones but position 0."""
    import torch

    H = VERIFIER_CFG["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(1, S, 3 * H, generator=g, dtype=torch.float32)
    verifier_last = torch.randn(1, S, H, generator=g, dtype=torch.float32)
    input_ids = torch.randint(0, VERIFIER_CFG["vocab_size"], (1, S), generator=g)
    document_ids = torch.zeros(1, S, dtype=torch.long)  # one document
    loss_mask = torch.ones(1, S, dtype=torch.float32)
    loss_mask[0, 0] = 0.0
    return dict(
        hidden_states=hidden_states,
        input_ids=input_ids,
        document_ids=document_ids,
        loss_mask=loss_mask,
        verifier_last_hidden_states=verifier_last,
    )


def _install_cod_counter(module) -> list[int]:
    """Wrap ``module.generate_cod_sample_indices`` to record the flat COD length N."""
    counts: list[int] = []
    orig = module.generate_cod_sample_indices

    def wrapped(*a, **kw):
        anchor_pos, depth = orig(*a, **kw)
        counts.append(int(anchor_pos.shape[0]))
        return anchor_pos, depth

    module.generate_cod_sample_indices = wrapped
    return counts


def _speculators_step_fn(verifier_dir, batch):
    import speculators.models.peagle.core as core
    from speculators.losses import resolve_loss_config

    model, _ = build_model(core.PEagleDraftModel, verifier_dir)
    model.train()
    counts = _install_cod_counter(core)
    call_kw = dict(
        loss_config=resolve_loss_config("kl_div", "eager"),
        max_anchors=None,
        num_depths=K,
        down_sample_ratio=R,
        down_sample_ratio_min=R_MIN,
    )

    def fwd_bwd():
        _, loss, _ = model(**batch, **call_kw)
        loss.backward()
        return float(loss.detach())

    return model, fwd_bwd, counts


def _ours_step_fn(verifier_dir, batch, partitions: int):
    import torch

    import speculators_peagle_plugin.training.peagle_trainer as trainer_mod
    from speculators_peagle_plugin.model.peagle_draft import PEagleDraftModel

    draft, t2d = build_model(PEagleDraftModel, verifier_dir)
    module = trainer_mod.PEagleTrainerModule(
        draft,
        torch.nonzero(t2d).squeeze(1),  # sorted target ids of the draft vocabulary
        t2d,
        num_depths=K,
        mask_token_id=MASK_TOKEN_ID,
        down_sample_ratio=R,
        down_sample_ratio_min=R_MIN,
        sequence_partitions=partitions,
    )
    module.train()
    counts = _install_cod_counter(trainer_mod)

    def fwd_bwd():
        if partitions == 1:
            loss = module.forward_batch(batch).loss
            loss.backward()
            return float(loss.detach())
        plan = module.build_peagle_plan(batch["loss_mask"], document_ids=batch["document_ids"])
        total = 0.0
        for i in range(len(plan)):
            loss = module.forward_batch(batch, peagle_segment=(plan, i)).loss
            loss.backward()
            total += float(loss.detach())
        return total

    return module, fwd_bwd, counts


def worker(case: dict) -> dict:
    import resource
    import shutil
    import tempfile

    if case["mem_cap_gb"] > 0:  # fail with an exception instead of the OOM killer
        cap = int(case["mem_cap_gb"] * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    import torch

    torch.set_num_threads(case["threads"])
    torch.manual_seed(0)
    out = dict(case, threads=torch.get_num_threads())
    tmpdir = tempfile.mkdtemp(prefix="peagle_verifier_cfg_")
    try:
        t0 = time.perf_counter()
        batch = make_batch(case["S"])
        if case["side"] == "speculators":
            model, fwd_bwd, counts = _speculators_step_fn(tmpdir, batch)
        else:
            model, fwd_bwd, counts = _ours_step_fn(tmpdir, batch, case["P"])
        out["build_s"] = time.perf_counter() - t0
        params = [p for p in model.parameters() if p.requires_grad]
        out["n_trainable"] = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
        out["peak_rss_before_steps_gib"] = peak_rss_gib()
        times, cpu_times, losses = [], [], []
        for i in range(case["warmup"] + case["steps"]):
            torch.manual_seed(100 + i)  # COD sampling draws from the torch RNG
            t, cpu = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            loss = fwd_bwd()
            opt.step()
            dt = time.perf_counter() - t
            times.append(dt)
            cpu_times.append(time.process_time() - cpu)
            losses.append(loss)
            print(
                f"  [{case['side']} S={case['S']} P={case['P']}] step {i} {dt:.2f}s "
                f"N={counts[-1] if counts else '?'} loss={loss:.4f}",
                file=sys.stderr,
                flush=True,
            )
            if loss != loss or abs(loss) == float("inf"):
                raise FloatingPointError(f"non-finite loss at step {i}")
            if dt > case["step_limit_s"]:
                out["aborted"] = f"step {i} took {dt:.0f}s > step limit {case['step_limit_s']}s"
                break
        out["load_avg_1min"] = os.getloadavg()[0]  # other processes on the machine skew times
        timed = times[case["warmup"] :]
        out["warmup_s"] = times[: case["warmup"]]
        out["step_s"] = timed
        out["median_s"] = statistics.median(timed) if timed else None
        # CPU seconds of all threads: at 1 thread, the step time a contended machine hides
        out["median_cpu_s"] = statistics.median(cpu_times[case["warmup"] :]) if timed else None
        out["losses"] = losses
        out["cod_N"] = counts[-1] if counts else None
    except Exception as e:  # noqa: BLE001  (record it: it is a result)
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    out["peak_rss_gib"] = peak_rss_gib()
    return out
