"""Benchmark: one P-EAGLE training step, speculators 0.9.0's draft vs this plugin's, on CPU.

    .venv/bin/python -m eval.bench_train_step [--seq-lens 1024 2048 4096 8192] [--steps 3]
        [--warmup 2] [--partition-curve-seq-len 8192 --partitions 1 2 4 8]
        [--long-seq-len 16384 --long-partitions 8] [--skip-speculators] [--json OUT]

One step is ``opt.zero_grad(set_to_none=True)`` -> forward -> backward ->
``torch.optim.AdamW(lr=1e-3, weight_decay=0.01).step()``, float32, 2 threads
(``OMP_WAIT_POLICY=PASSIVE`` unless set: see ``run_case``):

- speculators: ``speculators.models.peagle.core.PEagleDraftModel`` called directly,
  as in ``baseline_speculators_peagle.py`` (its Trainer is GPU-only): eager KL loss,
  draft attention ``sdpa``, no ``max_anchors``.
- ours: ``speculators_peagle_plugin.draft.PEagleDraftModel`` built from the same
  ``PEagleSpeculatorConfig``, trained through ``PEagleTrainerModule.forward_batch``;
  with ``P > 1`` sequence partitions, one backward per plan segment.

Both drafts: 1 llama layer, sliding window 2048, target layers [2, 15, 27], trainable
embeddings, draft vocab 8192 with random valid t2d/d2t, K = 8, r = 0.7, r_min = 0.2,
a SmolLM2-135M-shaped verifier (config only, in a temporary directory, no download).
Both see the same packed batch (one document, loss mask all ones but position 0) and
the same torch seed per step, so both COD samplers draw the same elements.

Each (side, S, P) case runs in a fresh subprocess, so its peak RSS (``ru_maxrss``) is
its own. Reported: median step seconds over the timed steps, peak RSS, the flat
COD element count N of the last step, and the 1-min load average after each case
(the machine may be shared: other processes skew step times, not peak memory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import version

VERIFIER_CFG = dict(  # SmolLM2-135M shape
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
DRAFT_VOCAB = 8192
NUM_LAYERS = 1
SLIDING_WINDOW = 2048  # speculators CLI default (all draft layers sliding)
TARGET_LAYER_IDS = [2, 15, 27]  # speculators default for a 30-layer verifier
MASK_TOKEN_ID = 0  # the config's mask token; both sides feed it at depth >= 1
K, R, R_MIN = 8, 0.7, 0.2
LR, WEIGHT_DECAY = 1e-3, 0.01
DRAFT_ATTN_IMPL = "sdpa"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- #
# worker: one case in this process
# --------------------------------------------------------------------------- #
def _peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def build_config(tmpdir: str):
    """The draft config ``speculators train --speculator-type peagle`` builds by default."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.cli import create_transformer_layer_config
    from transformers import LlamaConfig

    vcfg = LlamaConfig(**VERIFIER_CFG)
    vcfg.architectures = ["LlamaForCausalLM"]
    vcfg.save_pretrained(tmpdir)  # config.json only

    tl_config = create_transformer_layer_config(
        verifier_name_or_path=tmpdir,
        num_layers=NUM_LAYERS,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=SLIDING_WINDOW,
        full_attention_indices=[],
    )
    tl_config._attn_implementation = DRAFT_ATTN_IMPL  # what from_training_args does
    return PEagleSpeculatorConfig(
        transformer_layer_config=tl_config,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=False,
        norm_before_fc=False,
        fc_norm=False,
        norm_output=False,
        eagle_aux_hidden_state_layer_ids=TARGET_LAYER_IDS,
        mask_token_id=MASK_TOKEN_ID,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(tmpdir),
        ),
    )


def build_model(model_cls, config):
    """Build a draft, load random valid vocab mappings and random verifier weights.

    Returns ``(model, t2d)``. Identical for both sides: the same generator seed gives
    the same mappings and weights.
    """
    import torch

    model = model_cls(config)

    # random-but-valid vocab mappings (same format as build_vocab_mappings_*)
    g = torch.Generator().manual_seed(1234)
    V = VERIFIER_CFG["vocab_size"]
    selected = torch.randperm(V, generator=g)[:DRAFT_VOCAB].sort().values
    d2t = selected - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    model.load_vocab_mappings(t2d, d2t)

    # stand-in for load_verifier_weights(): random verifier embed/lm_head/norm
    H = VERIFIER_CFG["hidden_size"]
    std = VERIFIER_CFG["initializer_range"]
    with torch.no_grad():
        verifier_embed = torch.randn(V, H, generator=g) * std
        lm_rows = verifier_embed[t2d]  # tied embeddings, rows picked by t2d
        model.embed_tokens.weight.copy_(verifier_embed)
        model.lm_head.weight.copy_(lm_rows)
        model.verifier_lm_head.weight.copy_(lm_rows)
        model.verifier_norm.weight.fill_(1.0)
    model.embed_tokens.weight.requires_grad_(config.embed_requires_grad)  # True
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


def _speculators_step_fn(config, batch):
    import speculators.models.peagle.core as core
    from speculators.losses import resolve_loss_config

    model, _ = build_model(core.PEagleDraftModel, config)
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


def _ours_step_fn(config, batch, partitions: int):
    import torch

    import speculators_peagle_plugin.training.peagle_trainer as trainer_mod
    from speculators_peagle_plugin.model.peagle_draft import PEagleDraftModel

    draft, t2d = build_model(PEagleDraftModel, config)
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
        config = build_config(tmpdir)
        batch = make_batch(case["S"])
        if case["side"] == "speculators":
            model, fwd_bwd, counts = _speculators_step_fn(config, batch)
        else:
            model, fwd_bwd, counts = _ours_step_fn(config, batch, case["P"])
        out["build_s"] = time.perf_counter() - t0
        params = [p for p in model.parameters() if p.requires_grad]
        out["n_trainable"] = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
        out["peak_rss_before_steps_gib"] = _peak_rss_gib()
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
    out["peak_rss_gib"] = _peak_rss_gib()
    return out


# --------------------------------------------------------------------------- #
# driver: one subprocess per case, markdown tables
# --------------------------------------------------------------------------- #
def run_case(case: dict, timeout: float) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(case["threads"]))
    env.setdefault("MKL_NUM_THREADS", str(case["threads"]))
    # On a shared machine, OpenMP's default spin-waiting lets an idle worker thread hold
    # the core its busy sibling needs, and a case with many parallel regions then loses
    # most of its time to it. Waiting passively makes each side's step time follow the
    # CPU it actually gets. Same setting for both sides.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("PYTHONWARNINGS", "ignore")
    cmd = [sys.executable, "-m", "eval.bench_train_step", "--worker", json.dumps(case)]
    print(f"== {case['side']} S={case['S']} P={case['P']}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    try:
        p = subprocess.run(
            cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return dict(case, error=f"timeout after {timeout:.0f}s", wall_s=time.perf_counter() - t)
    wall = time.perf_counter() - t
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        why = "killed (SIGKILL: OOM killer?)" if p.returncode == -9 else f"rc={p.returncode}"
        return dict(case, error=f"worker died: {why}", wall_s=wall)
    res = json.loads(lines[-1][len("RESULT ") :])
    res["wall_s"] = wall
    return res


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _s(r: dict) -> str:
    if r.get("error"):
        return f"error: {r['error']}"
    x = r.get("median_s")
    if x is None:
        return f"— ({r.get('aborted', 'no timed step')})"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _gib(r: dict) -> str:
    x = r.get("peak_rss_gib")
    return "—" if x is None else f"{x:.2f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "—"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--partition-curve-seq-len", type=int, default=8192)
    parser.add_argument("--partitions", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--long-seq-len", type=int, default=16384, help="0 = skip")
    parser.add_argument("--long-partitions", type=int, default=8)
    parser.add_argument("--skip-speculators", action="store_true", help="run only our side")
    parser.add_argument("--json", type=str, default=None, help="also write all results here")
    parser.add_argument(
        "--step-limit-s", type=float, default=600.0, help="stop a case after a slower step"
    )
    parser.add_argument("--case-timeout-s", type=float, default=3600.0)
    parser.add_argument(
        "--mem-cap-gb", type=float, default=22.0, help="RLIMIT_AS per worker (0 = none)"
    )
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    common = dict(
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        step_limit_s=args.step_limit_s,
        mem_cap_gb=args.mem_cap_gb,
    )
    cache: dict[tuple, dict] = {}

    def case(side: str, S: int, P: int) -> dict:
        if (side, S, P) not in cache:  # e.g. ours S=8192 P=1 serves two tables
            cache[side, S, P] = run_case(dict(common, side=side, S=S, P=P), args.case_timeout_s)
        return cache[side, S, P]

    t_all = time.perf_counter()
    main_rows = []
    for S in args.seq_lens:
        theirs = None if args.skip_speculators else case("speculators", S, 1)
        main_rows.append((S, theirs, case("ours", S, 1)))
    curve_S = args.partition_curve_seq_len
    curve_rows = [(P, case("ours", curve_S, P)) for P in args.partitions] if curve_S else []
    long_row = case("ours", args.long_seq_len, args.long_partitions) if args.long_seq_len else None

    print(
        f"torch {version('torch')}, transformers {version('transformers')}, "
        f"speculators {version('speculators')}, python {platform.python_version()}, "
        f"{_cpu_model()}, {args.threads} threads, "
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}"
    )
    print(
        f"float32, K={K} r={R} r_min={R_MIN}, draft vocab {DRAFT_VOCAB}, {NUM_LAYERS} layer, "
        f"sliding window {SLIDING_WINDOW}, AdamW lr={LR} wd={WEIGHT_DECAY}, "
        f"{args.warmup} warm-up + {args.steps} timed steps (median), "
        f"total wall {time.perf_counter() - t_all:.0f}s"
    )
    print()
    print(
        "| S | speculators step (s) | ours step (s) | speedup | "
        "speculators peak (GiB) | ours peak (GiB) | memory ratio | COD N |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for S, theirs, ours in main_rows:
        theirs = theirs or {}
        n = ours.get("cod_N") or theirs.get("cod_N") or "—"
        if theirs.get("cod_N") and ours.get("cod_N") and theirs["cod_N"] != ours["cod_N"]:
            n = f"{theirs['cod_N']} / {ours['cod_N']}"
        print(
            f"| {S} | {_s(theirs) if theirs else 'skipped'} | {_s(ours)} | "
            f"{_ratio(theirs.get('median_s'), ours.get('median_s'))} | "
            f"{_gib(theirs) if theirs else 'skipped'} | {_gib(ours)} | "
            f"{_ratio(theirs.get('peak_rss_gib'), ours.get('peak_rss_gib'))} | {n} |"
        )
    print()
    print("Process CPU seconds per step, all threads (median; robust to other load at 1 thread)")
    print()
    print("| S | speculators CPU (s) | ours CPU (s) | ratio |")
    print("|---:|---:|---:|---:|")
    for S, theirs, ours in main_rows:
        theirs_cpu, ours_cpu = (theirs or {}).get("median_cpu_s"), ours.get("median_cpu_s")
        print(
            f"| {S} | {'—' if theirs_cpu is None else f'{theirs_cpu:.2f}'} | "
            f"{'—' if ours_cpu is None else f'{ours_cpu:.2f}'} | {_ratio(theirs_cpu, ours_cpu)} |"
        )
    if curve_rows:
        print()
        print(f"Ours, S={curve_S}: step time and memory vs sequence partitions")
        print()
        print("| partitions | ours step (s) | ours peak (GiB) |")
        print("|---:|---:|---:|")
        for P, r in curve_rows:
            print(f"| {P} | {_s(r)} | {_gib(r)} |")
    if long_row:
        print()
        print("Ours, long context")
        print()
        print("| S | partitions | ours step (s) | ours peak (GiB) |")
        print("|---:|---:|---:|---:|")
        print(
            f"| {args.long_seq_len} | {args.long_partitions} | {_s(long_row)} | {_gib(long_row)} |"
        )
    loads = [
        f"{r['side']} S={r['S']} P={r['P']}: {r['load_avg_1min']:.1f}"
        for r in cache.values()
        if r.get("load_avg_1min") is not None
    ]
    print()
    print(f"1-min load average after each case ({os.cpu_count()} CPUs): " + "; ".join(loads))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    main=[dict(S=S, speculators=t, ours=o) for S, t, o in main_rows],
                    partitions=[dict(P=P, ours=r) for P, r in curve_rows],
                    long=long_row,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
