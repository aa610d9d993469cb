"""COD sampler: invariants over many seeds, checked by a slow loop-based oracle."""

import pytest
import torch
from speculators.models.peagle.data import generate_cod_sample_indices as upstream_cod

from speculators_peagle_plugin import CODConfig, generate_cod_sample_indices

SEEDS = range(8)


def random_packed_row(gen, seq_length, n_docs, pad, p_supervised=0.7):
    """Ragged documents packed from 0, `pad` padding positions at the end."""
    used = seq_length - pad
    cuts = sorted(torch.randperm(used - 1, generator=gen)[: n_docs - 1].add(1).tolist())
    bounds = [0, *cuts, used]
    doc = torch.full((seq_length,), -1, dtype=torch.long)
    for i in range(n_docs):
        doc[bounds[i] : bounds[i + 1]] = i
    loss_mask = (torch.rand(seq_length, generator=gen) < p_supervised).long()
    # Padding is sometimes marked supervised on purpose: the sampler must ignore it.
    return loss_mask, doc


def check_cod(anchor, depth, seq_length, loss_mask, doc, cfg, n_valid=None, path=None):
    """Loop oracle: every invariant the sampler promises, one element at a time."""
    anchor, depth = anchor.tolist(), depth.tolist()
    loss_mask, doc = loss_mask.tolist(), doc.tolist()
    path = [True] * seq_length if path is None else path.tolist()
    supervised = [loss_mask[p] != 0 and doc[p] >= 0 for p in range(seq_length)]
    if n_valid is None:
        n_valid = sum(supervised)
    # depth-major, ascending within a depth; depth 0 is every position
    assert depth == sorted(depth)
    assert anchor[:seq_length] == list(range(seq_length))
    by_depth = {}
    for a, d in zip(anchor, depth, strict=True):
        by_depth.setdefault(d, []).append(a)
    for d, anchors in by_depth.items():
        assert anchors == sorted(anchors) and len(set(anchors)) == len(anchors), d
    members = set(zip(anchor, depth, strict=True))
    prev_refs = list(range(seq_length))
    for d in range(1, cfg.num_depths):
        size = cfg.depth_sample_size(n_valid, d)
        if size == 0:  # the sampler stops here: no deeper depth may appear
            assert max(depth) < d
            break
        refs = [a + d for a in by_depth.get(d, [])]
        # pool: successors of the previous depth's references, supervised, same document
        if d == 1:
            pool = [
                p
                for p in range(1, seq_length)
                if supervised[p] and doc[p - 1] == doc[p] and path[p - 1]
            ]
        else:
            pool = [
                p + 1
                for p in prev_refs
                if p + 1 < seq_length and supervised[p + 1] and doc[p + 1] == doc[p] and path[p]
            ]
        assert len(refs) == min(size, len(pool)), (d, len(refs), size, len(pool))
        assert set(refs) <= set(pool)
        for a in by_depth.get(d, []):
            assert a >= 0
            assert (a, d - 1) in members  # parent exists
            assert supervised[a + d]
            assert doc[a + d] == doc[a] >= 0  # no chain crosses a document boundary
            assert all(path[a : a + d])  # every step of the rollout allowed
        prev_refs = refs
    assert max(depth) < cfg.num_depths


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("seq_length,n_docs,pad", [(37, 1, 0), (233, 3, 17), (500, 7, 1)])
def test_invariants_packed_rows(seed, seq_length, n_docs, pad):
    gen = torch.Generator().manual_seed(seed)
    loss_mask, doc = random_packed_row(gen, seq_length, n_docs, pad)
    cfg = CODConfig(num_depths=int(torch.randint(1, 10, (1,), generator=gen)))
    anchor, depth = generate_cod_sample_indices(
        seq_length, loss_mask, cfg.num_depths, document_ids=doc, generator=gen
    )
    assert anchor.dtype == depth.dtype == torch.long
    check_cod(anchor, depth, seq_length, loss_mask, doc, cfg)


@pytest.mark.parametrize("seed", SEEDS)
def test_loss_mask_position_zero_never_gives_negative_anchor(seed):
    # speculators 0.9.0 emits anchor -1 here; this sampler must not.
    gen = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(1, 64, dtype=torch.long)
    anchor, depth = generate_cod_sample_indices(64, loss_mask, 4, 0.9, 0.5, generator=gen)
    assert int(anchor.min()) >= 0
    check_cod(
        anchor, depth, 64, loss_mask[0], torch.zeros(64, dtype=torch.long), CODConfig(4, 0.9, 0.5)
    )


@pytest.mark.parametrize("ratio,r_min", [(1.0, 0.0), (0.5, 0.0), (0.3, 1.0), (0.9, 0.2)])
def test_ratios_at_the_edges(ratio, r_min):
    gen = torch.Generator().manual_seed(3)
    loss_mask, doc = random_packed_row(gen, 300, 4, 9, p_supervised=0.9)
    cfg = CODConfig(8, ratio, r_min)
    anchor, depth = generate_cod_sample_indices(
        300, loss_mask, 8, ratio, r_min, document_ids=doc, generator=gen
    )
    check_cod(anchor, depth, 300, loss_mask, doc, cfg)


def test_expected_counts_all_valid():
    torch.manual_seed(0)
    anchor, depth = generate_cod_sample_indices(4096, torch.ones(4096), 8, 0.7, 0.2)
    counts = torch.bincount(depth).tolist()
    assert counts == [4096, 2866, 2006, 1403, 982, 818, 818, 817]


@pytest.mark.parametrize("seed", SEEDS)
def test_max_anchors_caps_the_chains(seed):
    gen = torch.Generator().manual_seed(seed)
    loss_mask, doc = random_packed_row(gen, 400, 3, 5, p_supervised=0.8)
    anchor, depth = generate_cod_sample_indices(
        400, loss_mask, 6, document_ids=doc, max_anchors=50, generator=gen
    )
    n_valid = min(int(((loss_mask != 0) & (doc >= 0)).sum()), 50)
    assert int((depth == 1).sum()) <= 50
    # Counts follow the formula with n_valid capped; chains stay legal.
    cfg = CODConfig(6, max_anchors=50)
    for d in range(1, int(depth.max()) + 1):
        assert int((depth == d).sum()) <= cfg.depth_sample_size(n_valid, d)
    assert int(anchor.min()) >= 0
    ref = anchor + depth
    assert bool(((loss_mask[ref] != 0) | (depth == 0)).all())
    assert bool(((doc[ref] == doc[anchor]) | (depth == 0)).all())


def test_generator_makes_it_reproducible():
    loss_mask = (torch.rand(1000, generator=torch.Generator().manual_seed(1)) < 0.6).long()
    runs = [
        generate_cod_sample_indices(1000, loss_mask, generator=torch.Generator().manual_seed(s))
        for s in (5, 5, 6)
    ]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[2][0])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("seq_length", [2, 61, 1024, 1537])
def test_equals_speculators_on_one_document(seed, seq_length):
    gen = torch.Generator().manual_seed(100 + seed)
    loss_mask = (torch.rand(1, seq_length, generator=gen) < 0.8).long()
    loss_mask[0, 0] = 0
    kwargs = dict(num_depths=8, down_sample_ratio=0.7, down_sample_ratio_min=0.2)
    torch.manual_seed(seed)
    theirs = upstream_cod(seq_length, loss_mask, **kwargs)
    torch.manual_seed(seed)
    ours = generate_cod_sample_indices(seq_length, loss_mask, **kwargs)
    assert torch.equal(ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(num_depths=0), "num_depths"),
        (dict(down_sample_ratio=0.0), "down_sample_ratio"),
        (dict(down_sample_ratio=1.5), "down_sample_ratio"),
        (dict(down_sample_ratio_min=-0.1), "down_sample_ratio_min"),
        (dict(down_sample_ratio_min=1.1), "down_sample_ratio_min"),
        (dict(max_anchors=0), "max_anchors"),
        (dict(loss_mask=torch.ones(9)), "loss_mask"),
        (dict(document_ids=torch.zeros(3, dtype=torch.long)), "document_ids"),
    ],
)
def test_bad_input_names_the_argument(kwargs, needle):
    args = dict(seq_length=10, loss_mask=torch.ones(10)) | kwargs
    with pytest.raises(ValueError, match=needle) as err:
        generate_cod_sample_indices(**args)
    assert "got" in str(err.value) and "must" in str(err.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_invariants_and_stays_on_device():
    gen = torch.Generator().manual_seed(0)
    loss_mask, doc = random_packed_row(gen, 2000, 5, 33)
    cuda_gen = torch.Generator(device="cuda").manual_seed(0)
    anchor, depth = generate_cod_sample_indices(
        2000, loss_mask.cuda(), document_ids=doc.cuda(), generator=cuda_gen
    )
    assert anchor.is_cuda and depth.is_cuda
    check_cod(anchor.cpu(), depth.cpu(), 2000, loss_mask, doc, CODConfig())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("seq_length,n_docs,pad", [(61, 1, 0), (233, 3, 17)])
def test_a_path_mask_keeps_rollouts_on_the_path_and_the_draw_sizes(seed, seq_length, n_docs, pad):
    gen = torch.Generator().manual_seed(seed)
    loss_mask, doc = random_packed_row(gen, seq_length, n_docs, pad, p_supervised=0.9)
    path = torch.rand(seq_length, generator=gen) < 0.8
    cfg = CODConfig(num_depths=5, down_sample_ratio=0.9, down_sample_ratio_min=0.3)
    state = gen.get_state()

    def sample(mask):
        return generate_cod_sample_indices(
            seq_length, loss_mask, 5, 0.9, 0.3, document_ids=doc, generator=gen, path_mask=mask
        )

    anchor, depth = sample(path)
    check_cod(anchor, depth, seq_length, loss_mask, doc, cfg, path=path)
    assert int((depth > 1).sum()) > 0
    # an all-True mask changes nothing
    everywhere = []
    for mask in (None, torch.ones(seq_length, dtype=torch.bool)):
        gen.set_state(state)
        everywhere.append(sample(mask))
    assert all(torch.equal(a, b) for a, b in zip(*everywhere, strict=True))
