"""Trainer module: speculators' loss, float64 dense reference, exact partitioning."""

import pytest
import torch
from speculators.losses.eager import kl_div_loss
from speculators.models.peagle.core import PEagleDraftModel as SpeculatorsPEagle
from tiny import DRAFT_VOCAB, MASK_TOKEN, TARGET_VOCAB, tiny_config, tiny_draft
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from speculators_peagle_plugin import dense_peagle_mask, generate_cod_sample_indices
from speculators_peagle_plugin.core.peagle_attention import lengths_from_document_ids
from speculators_peagle_plugin.selftest import rows
from speculators_peagle_plugin.selftest.oracles import dense_reference_loss as dense_loss
from speculators_peagle_plugin.selftest.oracles import rms_norm
from speculators_peagle_plugin.training.peagle_trainer import PEagleTrainerModule, _kl_div_loss

K = 4


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    """transformers' RMSNorm computes in float32 whatever the input; the float64
    oracles here need it in the input's dtype (same formula)."""

    def forward(self, x):
        return self.weight * (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )

    for cls in (LlamaRMSNorm, Qwen3RMSNorm):
        monkeypatch.setattr(cls, "forward", forward)


def packed_batch(seed, batch=2, seq_len=61, n_docs=3, pad=7, dtype=torch.float64):
    """Ragged packed rows with padding (document ids -1), random supervision."""
    return rows.packed_batch(seed, vocab=TARGET_VOCAB, aux_width=192, hidden=64, batch=batch,
                             seq_len=seq_len, n_docs=n_docs, pad=pad, dtype=dtype)


def trainer(draft, ids, t2d, partitions=1, seed=0, **kw):
    return PEagleTrainerModule(
        draft, ids, t2d, K, MASK_TOKEN, 0.8, 0.3, partitions,
        generator=torch.Generator().manual_seed(seed), **kw,
    )


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------- speculators' loss


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_layers", [1, 2])
def test_flat_loss_equals_speculators_peagle(seed, num_layers):
    ours, ids, t2d = tiny_draft(seed, num_layers=num_layers, num_depths=K)
    theirs = SpeculatorsPEagle(tiny_config(num_layers=num_layers, num_depths=K))
    theirs.load_state_dict(ours.state_dict())
    batch = packed_batch(seed, batch=1, seq_len=57 + seed, n_docs=1, pad=0, dtype=torch.float32)
    batch["loss_mask"][0, 0] = 0  # the case where speculators' COD sample is legal
    batch["document_ids"].zero_()
    module = PEagleTrainerModule(ours, ids, t2d, K, MASK_TOKEN, 0.8, 0.3)
    torch.manual_seed(seed)
    mine = module.forward_batch(batch)
    torch.manual_seed(seed)
    with torch.no_grad():  # flex attention has no backward on CPU
        _, their_loss, their_metrics = theirs(
            hidden_states=batch["hidden_states"],
            input_ids=batch["input_ids"],
            document_ids=batch["document_ids"],
            loss_mask=batch["loss_mask"],
            verifier_last_hidden_states=batch["verifier_last_hidden_states"],
            loss_config={"kl_div": (kl_div_loss, 1.0)},
            num_depths=K,
            down_sample_ratio=0.8,
            down_sample_ratio_min=0.3,
        )
    # speculators divides by (count + 1e-5); that is the only difference allowed.
    count = float(mine.total_den)
    torch.testing.assert_close(mine.loss * count / (count + 1e-5), their_loss, rtol=1e-5, atol=0)
    for d in range(K):
        assert float(their_metrics[f"position_{d}_acc_total"]) == float(mine.valid[d])
        assert float(their_metrics[f"position_{d}_acc_sum"]) == float(mine.correct[d])


def test_kl_matches_speculators_eager_kl():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 33, generator=gen), torch.randn(2, 5, 33, generator=gen)
    torch.testing.assert_close(_kl_div_loss(a, b), kl_div_loss(a, b))


# ------------------------------------------------------------ dense float64 reference


def dense_reference_loss(module, batch):
    """Same COD sample, attention by plain float64 softmax over the dense mask."""
    samples = []
    for b in range(batch["input_ids"].shape[0]):
        doc = batch["document_ids"][b]
        anchor, depth = generate_cod_sample_indices(
            doc.shape[0], batch["loss_mask"][b], K, 0.8, 0.3,
            document_ids=doc, generator=module.generator,
        )
        lengths = lengths_from_document_ids(doc)
        samples.append((anchor, depth, dense_peagle_mask(anchor, depth, lengths, doc.shape[0])))
    return dense_loss(module.draft, batch, samples, MASK_TOKEN)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_layers", [1, 2])
def test_chunked_cpu_path_matches_dense_float64(seed, num_layers):
    draft, ids, t2d = tiny_draft(seed, dtype=torch.float64, num_layers=num_layers)
    batch = packed_batch(seed, seq_len=523)  # spans two 512-anchor attention chunks
    got = trainer(draft, ids, t2d, seed=seed).forward_batch(batch).loss
    got.backward()
    mine = grads(draft)
    draft.zero_grad()
    want = dense_reference_loss(trainer(draft, ids, t2d, seed=seed), batch)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    for name, g in grads(draft).items():
        torch.testing.assert_close(mine[name], g, rtol=1e-9, atol=1e-12, msg=name)


# ------------------------------------------------------------- exact partitioning


def run_partitioned(draft, ids, t2d, batch, partitions, seed, **kw):
    module = trainer(draft, ids, t2d, partitions, seed, **kw)
    plan = module.segments(batch)[0][0]  # the loop's path: greedy steps, then the plan
    total = None
    for i in range(len(plan)):
        m = module.forward_batch(batch, peagle_segment=(plan, i))
        m.loss.backward()
        total = m if total is None else total + m
    return plan, total


def assert_partitioned_equals_flat(draft, ids, t2d, batch, partitions, seed, **kw):
    """Segment losses and gradients sum to the flat ones (float64, relative 1e-9)."""
    flat = trainer(draft, ids, t2d, 1, seed, **kw).forward_batch(batch)
    flat.loss.backward()
    want = grads(draft)
    draft.zero_grad()
    plan, got = run_partitioned(draft, ids, t2d, batch, partitions, seed, **kw)
    torch.testing.assert_close(got.loss, flat.loss, rtol=1e-9, atol=0)
    assert torch.equal(got.valid, flat.valid) and torch.equal(got.correct, flat.correct)
    have = grads(draft)
    assert have.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=1e-9, atol=1e-13, msg=name)
    return plan


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("partitions", [2, 3, 4, 7, 100])
def test_segments_sum_to_the_flat_loss_and_gradient(num_layers, checkpointing, partitions):
    seed = partitions + 10 * num_layers
    draft, ids, t2d = tiny_draft(seed, dtype=torch.float64, num_layers=num_layers)
    if checkpointing:
        draft.gradient_checkpointing_enable({"use_reentrant": False})
    draft.train()
    plan = assert_partitioned_equals_flat(draft, ids, t2d, packed_batch(seed), partitions, seed)
    # every supervised element is charged exactly once, empty segments skipped
    assert all(bool(u.loss_positions.any()) for u in plan.units)
    charged = sorted(
        (u.b, a, d)
        for u in plan.units
        for a, d in zip(
            u.anchor[u.loss_positions].tolist(), u.depth[u.loss_positions].tolist(), strict=True
        )
    )
    assert len(charged) == len(set(charged)) == int(plan.total_den)
    assert len(plan) <= 2 * partitions


@pytest.mark.parametrize("num_layers,window,partitions", [(1, 5, 3), (2, 7, 4), (2, 3, 9)])
def test_windowed_segments_trim_context_and_stay_exact(num_layers, window, partitions):
    seed = 40 + partitions
    draft, ids, t2d = tiny_draft(
        seed, dtype=torch.float64, num_layers=num_layers, sliding_window=window
    )
    batch = packed_batch(seed, seq_len=97, n_docs=2)
    plan = assert_partitioned_equals_flat(draft, ids, t2d, batch, partitions, seed)
    # the trim is real: some segment starts its context after position 0 of its document
    reach = num_layers * (window - 1)
    assert any(int(u.anchor[u.depth == 0].min()) > 0 for u in plan.units if partitions * reach < 97)


def test_gradient_checkpointing_gives_identical_loss_and_gradients():
    runs = []
    for on in (False, True):
        draft, ids, t2d = tiny_draft(3, dtype=torch.float64, num_layers=2)
        if on:
            draft.gradient_checkpointing_enable({"use_reentrant": False})
        draft.train()
        m = trainer(draft, ids, t2d, seed=3).forward_batch(packed_batch(3))
        m.loss.backward()
        runs.append((m.loss.detach(), grads(draft)))
    assert torch.equal(runs[0][0], runs[1][0])
    for name, g in runs[0][1].items():
        assert torch.equal(g, runs[1][1][name]), name


def test_mask_hidden_gets_gradient_and_target_logits_path_agrees():
    draft, ids, t2d = tiny_draft(4, dtype=torch.float64)
    batch = packed_batch(4)
    m = trainer(draft, ids, t2d, seed=4).forward_batch(batch)
    m.loss.backward()
    assert draft.mask_hidden.grad is not None and draft.mask_hidden.grad.abs().sum() > 0
    # Full-vocabulary target logits give the same loss as the verifier-hidden path.
    with torch.no_grad():
        head = torch.zeros(TARGET_VOCAB, 64, dtype=torch.float64)
        head[ids] = draft.verifier_lm_head.weight
        full = draft.verifier_norm(batch["verifier_last_hidden_states"]) @ head.T
    module = trainer(draft, ids, t2d, seed=4)
    again = module(
        batch["input_ids"], None, batch["loss_mask"], batch["hidden_states"], full,
        document_ids=batch["document_ids"],
    )
    torch.testing.assert_close(again.loss, m.loss, rtol=1e-12, atol=0)


# ------------------------------------------------------------- greedy-path rollouts


def greedy_batch(seed, draft, ids, follow_rate):
    """packed_batch whose next token is the verifier's draft-vocabulary argmax at about
    ``follow_rate`` of the slots (elsewhere random)."""
    batch = packed_batch(seed)
    with torch.no_grad():
        logits = draft.verifier_lm_head(draft.verifier_norm(batch["verifier_last_hidden_states"]))
    follow = (
        torch.rand(logits.shape[:2], generator=torch.Generator().manual_seed(seed)) < follow_rate
    )
    nxt = torch.where(follow, ids[logits.argmax(-1)], batch["input_ids"])
    batch["input_ids"][:, 1:] = nxt[:, :-1]
    return batch


def greedy_steps_loop(batch, draft, ids):
    """Oracle: slot by slot, float64 logits over the draft columns, argmax, compare."""
    input_ids, states = batch["input_ids"], batch["verifier_last_hidden_states"]
    weight = draft.verifier_lm_head.weight.double()
    steps = torch.zeros_like(input_ids, dtype=torch.bool)
    for b in range(input_ids.shape[0]):
        for s in range(input_ids.shape[1] - 1):
            h = rms_norm(draft.verifier_norm, states[b, s].double())
            best = max(range(len(ids)), key=lambda v: float(weight[v] @ h))
            steps[b, s] = int(ids[best]) == int(input_ids[b, s + 1])
    return steps


@pytest.mark.parametrize("seed", range(3))
def test_greedy_chains_keep_only_rollouts_on_the_targets_greedy_path(seed):
    draft, ids, t2d = tiny_draft(50 + seed, dtype=torch.float64)
    batch = greedy_batch(seed, draft, ids, follow_rate=0.6)
    module = trainer(draft, ids, t2d, 3, seed, greedy_chains=True)
    steps = module.greedy_steps(
        batch["input_ids"], verifier_last_hidden_states=batch["verifier_last_hidden_states"]
    )
    want = greedy_steps_loop(batch, draft, ids)
    assert torch.equal(steps, want) and 0.3 < float(want.float().mean()) < 0.9
    # full-vocabulary target logits find the same steps
    with torch.no_grad():
        head = torch.zeros(TARGET_VOCAB, 64, dtype=torch.float64)
        head[ids] = draft.verifier_lm_head.weight
        full = draft.verifier_norm(batch["verifier_last_hidden_states"]) @ head.T
    assert torch.equal(module.greedy_steps(batch["input_ids"], full), want)
    # the plan's charged elements: the sampler's draws with those steps as its path mask,
    # every rollout on the greedy path (loop check), rollouts deeper than 1 among them
    plan = module.segments(batch)[0][0]
    gen = torch.Generator().manual_seed(seed)
    for b in range(2):
        anchor, depth = generate_cod_sample_indices(
            batch["loss_mask"].shape[1], batch["loss_mask"][b], K, 0.8, 0.3,
            document_ids=batch["document_ids"][b], generator=gen, path_mask=want[b],
        )
        drawn = set(zip(anchor.tolist(), depth.tolist(), strict=True))
        got = set()
        for u in (u for u in plan.units if u.b == b):
            charged = u.anchor[u.loss_positions], u.depth[u.loss_positions]
            got |= set(zip(*(t.tolist() for t in charged), strict=True))
        assert got <= drawn and all(all(want[b, a : a + d]) for a, d in got)
        assert any(d > 1 for _, d in got)


@pytest.mark.parametrize("seed", range(2))
def test_greedy_chains_stay_exact_under_partitioning_and_drop_nothing_from_greedy_replies(seed):
    draft, ids, t2d = tiny_draft(60 + seed, dtype=torch.float64)
    draft.train()
    sampled = greedy_batch(seed, draft, ids, follow_rate=0.5)
    assert_partitioned_equals_flat(draft, ids, t2d, sampled, 4, seed, greedy_chains=True)
    draft.zero_grad()
    on = trainer(draft, ids, t2d, seed=seed, greedy_chains=True).forward_batch(sampled)
    off = trainer(draft, ids, t2d, seed=seed).forward_batch(sampled)
    assert torch.equal(on.valid[0], off.valid[0]) and bool((on.valid[1:] <= off.valid[1:]).all())
    assert on.valid.sum() < off.valid.sum()
    greedy = greedy_batch(seed, draft, ids, follow_rate=1.0)  # every reply token greedy
    on = trainer(draft, ids, t2d, seed=seed, greedy_chains=True).forward_batch(greedy)
    off = trainer(draft, ids, t2d, seed=seed).forward_batch(greedy)
    assert torch.equal(on.loss, off.loss) and torch.equal(on.valid, off.valid)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("window", [None, 5, 2])  # 2 < K: deep queries see no context
def test_llama_qwen3_and_sliding_window_match_dense_mask(model_type, window):
    draft, ids, t2d = tiny_draft(
        5, dtype=torch.float64, model_type=model_type, sliding_window=window
    )
    draft.attention_impl = "chunked"
    batch = packed_batch(5, batch=1)
    doc = batch["document_ids"][0]
    anchor, depth = generate_cod_sample_indices(61, batch["loss_mask"][0], K, document_ids=doc)
    masks = draft.build_peagle_block_mask(anchor, depth, lengths_from_document_ids(doc), 61)
    assert masks[0].sliding_window == window
    gen = torch.Generator().manual_seed(0)
    n = anchor.shape[0]
    q = torch.randn(1, 4, n, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    from speculators_peagle_plugin.kernels.attention import peagle_attention

    got = peagle_attention(q, k, v, masks[0], 0.25)
    allowed = dense_peagle_mask(
        anchor, depth, lengths_from_document_ids(doc), 61, sliding_window=window
    )
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25
    want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num()
    torch.testing.assert_close(got, want @ v.repeat_interleave(2, 1))
    # and the whole forward runs for this layer type
    trainer(draft, ids, t2d).forward_batch(packed_batch(5)).loss.backward()


# ------------------------------------------------------------------- bad input


def test_bad_input_is_a_value_error():
    draft, ids, t2d = tiny_draft(0)
    with pytest.raises(ValueError, match="mask_token_id"):
        PEagleTrainerModule(draft, ids, t2d, K, TARGET_VOCAB)
    with pytest.raises(ValueError, match="num_depths"):
        PEagleTrainerModule(draft, ids, t2d, 0, MASK_TOKEN)
    with pytest.raises(ValueError, match="sequence_partitions"):
        PEagleTrainerModule(draft, ids, t2d, K, MASK_TOKEN, sequence_partitions=0)
    with pytest.raises(ValueError, match="selected_token_ids"):
        PEagleTrainerModule(draft, ids[:-1], t2d, K, MASK_TOKEN)
    del draft.mask_hidden
    with pytest.raises(ValueError, match="mask_hidden"):
        PEagleTrainerModule(draft, ids, t2d, K, MASK_TOKEN)
    draft, ids, t2d = tiny_draft(0)
    module = PEagleTrainerModule(draft, ids, t2d, K, MASK_TOKEN)
    batch = packed_batch(0, dtype=torch.float32)
    batch["hidden_states"] = batch["hidden_states"][:, :-1]
    with pytest.raises(ValueError, match="aux_hidden_states must start with"):
        module.forward_batch(batch)
    batch = packed_batch(0, dtype=torch.float32)
    batch["hidden_states"] = batch["hidden_states"][..., :100]
    with pytest.raises(ValueError, match="192 features"):
        module.forward_batch(batch)
    assert DRAFT_VOCAB == ids.shape[0]


def test_sections_whole_and_the_seeds_arguments_build_the_same_module():
    from speculators_peagle_plugin.core.peagle_config import CODConfig, PEagleConfig
    from speculators_peagle_plugin.kernels.fused_kl import LossConfig

    draft, ids, t2d = tiny_draft(0)
    loose = PEagleTrainerModule(draft, ids, t2d, K, MASK_TOKEN, 0.8, 0.3, 2, max_anchors=9,
                                tv_weight=0.5)
    peagle = PEagleConfig(CODConfig(K, 0.8, 0.3, 9), 2)
    whole = PEagleTrainerModule.from_sections(draft, ids, t2d, MASK_TOKEN, peagle,
                                              LossConfig(tv_weight=0.5))
    assert (whole.peagle, whole.loss_config) == (loose.peagle, loose.loss_config)
    assert whole.num_depths == loose.num_depths == K  # K is the module's
    batch = packed_batch(0, dtype=torch.float32)
    for module in (loose, whole):
        module.generator = torch.Generator().manual_seed(0)
    assert torch.equal(loose.forward_batch(batch).loss, whole.forward_batch(batch).loss)
