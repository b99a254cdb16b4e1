import io
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from PIL import Image

from conftest import new_experiment, step_images
from pairsim import compat
import pairsim.eval.metrics as metrics_module
from pairsim.eval.metrics import blocked_retrieval_metrics, retrieval_metrics
from pairsim.eval.inference import in_daemon_thread
from pairsim.eval.report import grid_heatmap, log_pictures, retrieval_gallery
from pairsim.eval.suite import SplitEmbeddings, evaluate_split, grid_items, modality_grid, unimodal_metrics
from pairsim.models.fusion import NormalizedSumFusion
from pairsim.tracking import RunLogger


def reference_metrics(sim, positives, ks, excluded=None):
    """Every metric straight from its definition, one query at a time, in float64 Python;
    ``excluded[q]``: a key left out of query q's ranking (−1: none)."""
    ranks_of_first, aps, rps, hits_at = [], [], [], {k: 0 for k in ks}
    without = 0
    for q, (scores, pos) in enumerate(zip(sim.tolist(), positives.tolist())):
        left_out = -1 if excluded is None else excluded[q]
        order = sorted((j for j in range(len(scores)) if j != left_out), key=lambda j: (-scores[j], j))
        rel = [pos[j] for j in order]
        r = sum(rel)
        if r == 0:
            without += 1
            continue
        first = rel.index(True) + 1
        ranks_of_first.append(first)
        for k in ks:
            hits_at[k] += first <= k
        aps.append(sum(sum(rel[:i]) / i for i in range(1, r + 1) if rel[i - 1]) / r)
        rps.append(sum(rel[:r]) / r)
    n = len(ranks_of_first)
    out = {f"R@{k}": 100 * hits_at[k] / n for k in ks}
    ranks = sorted(ranks_of_first)
    out |= {"mAP@R": 100 * sum(aps) / n, "R-P": 100 * sum(rps) / n,
            "median_rank": (ranks[(n - 1) // 2] + ranks[n // 2]) / 2, "n_queries_without_positive": without}
    return out


def test_metrics_on_a_hand_computed_matrix():
    # query 0: positive ranked 2nd. Query 1: positives 0 and 3 ranked 1st and 3rd (R = 2: one in
    # the top 2, AP = (1/2)(1/1)). Query 2: positive ranked last. Query 3: no positive.
    sim = torch.tensor([[0.9, 0.1, 0.5, 0.2],
                        [0.8, 0.7, 0.1, 0.3],
                        [0.4, 0.0, 0.3, 0.2],
                        [0.1, 0.2, 0.3, 0.4]])
    pos = torch.tensor([[0, 0, 1, 0], [1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert retrieval_metrics(sim, pos, ks=(1, 2, 4)) == pytest.approx({
        "R@1": 100 / 3, "R@2": 200 / 3, "R@4": 100.0, "mAP@R": 50 / 3, "R-P": 50 / 3, "median_rank": 2.0,
        "n_queries_without_positive": 1.0})


def test_ties_break_towards_the_lower_key_index():
    sim = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    # rank order 0, 1, 2, 3: positives at ranks 2 and 4; R = 2, one in the top 2
    metrics = retrieval_metrics(sim, torch.tensor([[False, True, False, True]]), ks=(1, 2))
    assert metrics == pytest.approx({"R@1": 0.0, "R@2": 100.0, "mAP@R": 25.0, "R-P": 50.0, "median_rank": 2.0,
                                     "n_queries_without_positive": 0.0})
    assert retrieval_metrics(sim, torch.tensor([[True, False, False, False]]), ks=(1,))["R@1"] == 100.0


def test_no_query_with_a_positive_is_an_error():
    with pytest.raises(ValueError, match="no query has a positive"):
        retrieval_metrics(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no query has a positive"):  # one item, its own key left out: none to rank
        blocked_retrieval_metrics(torch.ones(1, 3), torch.ones(1, 3), [0], [0], self_keys=[0])


def tied_problem(seed, n_queries, n_keys, n_labels, dim=4):
    """Embeddings on a coarse grid (many exactly tied scores) with labels, some unknown (−1)."""
    g = torch.Generator().manual_seed(seed)
    queries = torch.randint(-2, 3, (n_queries, dim), generator=g).float() / 2
    keys = torch.randint(-2, 3, (n_keys, dim), generator=g).float() / 2
    query_labels = torch.randint(-1, n_labels, (n_queries,), generator=g)
    key_labels = torch.randint(-1, n_labels, (n_keys,), generator=g)
    return queries, keys, query_labels, key_labels


@pytest.mark.parametrize("seed", range(4))
def test_dense_metrics_match_the_reference(seed):
    queries, keys, ql, kl = tied_problem(seed, 40, 30, 6)
    sim = queries @ keys.T
    positives = (ql[:, None] == kl[None, :]) & (ql[:, None] >= 0)
    assert retrieval_metrics(sim, positives, ks=(1, 5, 10)) == pytest.approx(
        reference_metrics(sim.double(), positives, (1, 5, 10)), abs=1e-9)


@pytest.mark.parametrize("seed,ks,blocks", [(0, (1, 5, 10), (7, 64)), (1, (1,), (3, 1)), (2, (1, 5), (64, 1000)),
                                            (3, (2,), (1, 128))])
def test_blocked_equals_dense_with_ties_and_self_exclusion(seed, ks, blocks):
    """Key blocks of 64 (1 is rounded up to 64) force merges of running top-Ds over five blocks,
    the last padded; few labels make R large; ks=(1,) keeps the top list short so most first
    positives come from the exact rank passes."""
    queries, keys, ql, kl = tied_problem(seed, 37, 300, 4)
    sim = queries @ keys.T
    positives = (ql[:, None] == kl[None, :]) & (ql[:, None] >= 0)
    assert blocked_retrieval_metrics(queries, keys, ql, kl, ks, query_block=blocks[0], key_block=blocks[1]) == \
        pytest.approx(retrieval_metrics(sim, positives, ks), abs=1e-9)
    # the query's own key (query i is key i) left out: −inf and not a positive in the dense form
    eye = torch.eye(37, 300, dtype=torch.bool)
    dense = retrieval_metrics(sim.masked_fill(eye, -math.inf), positives & ~eye, ks)
    assert blocked_retrieval_metrics(queries, keys, ql, kl, ks, self_keys=torch.arange(37),
                                     query_block=blocks[0], key_block=blocks[1]) == pytest.approx(dense, abs=1e-9)


def test_rank_keys_order_pairs_as_the_ranking_does_and_give_them_back():
    """One int64 per (score, key index): a larger key is a higher score, or the same score at a
    lower index — −0.0 tying +0.0, subnormals, ±inf and the lowest float included — and the
    score (−0.0 as +0.0) and index read back unchanged."""
    tiny = torch.finfo(torch.float32).tiny
    special = torch.tensor([0.0, -0.0, tiny / 4, -tiny / 4, tiny, -tiny, 1.0, -1.0, torch.finfo(torch.float32).max,
                            torch.finfo(torch.float32).min, math.inf, -math.inf])
    g = torch.Generator().manual_seed(0)
    scores = torch.cat([special, special, torch.randn(200, generator=g), torch.randint(-3, 4, (200,), generator=g) / 2])
    indices = torch.randperm(len(scores), generator=g) * 9_000_000  # up to 2³² − 1
    keys = metrics_module._rank_keys(scores, indices)
    expected = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), int(indices[i])))
    assert torch.argsort(keys, descending=True).tolist() == expected
    assert torch.equal(metrics_module._key_scores(keys), scores + 0.0)  # + 0.0: −0.0 becomes +0.0
    assert torch.equal(metrics_module._key_indices(keys), indices)
    assert metrics_module._NO_KEY < int(metrics_module._rank_keys(torch.tensor([-math.inf]),
                                                                  torch.tensor([2**32 - 1])))


def test_blocked_takes_string_free_numpy_labels_and_is_deterministic():
    queries, keys, ql, kl = tied_problem(5, 50, 80, 10)
    first = blocked_retrieval_metrics(queries, keys, ql.numpy(), kl.numpy(), query_block=16, key_block=16)
    assert first == blocked_retrieval_metrics(queries, keys, np.asarray(ql), np.asarray(kl), query_block=8,
                                              key_block=32)


def class_problem(seed, n_items, n_classes=3, dim=4):
    """Items on a coarse grid (many tied scores), each query one of the keys: ``n_classes`` class
    labels (R ≈ n_items / (n_classes + 1)) and some −1 (matching nothing); every seventh query
    without its own key (−1), the others with it (``self_keys``)."""
    g = torch.Generator().manual_seed(seed)
    items = torch.randint(-2, 3, (n_items, dim), generator=g).float() / 2
    labels = torch.randint(-1, n_classes, (n_items,), generator=g)
    self_keys = torch.where(torch.arange(n_items) % 7 == 3, -1, torch.arange(n_items))
    return items, labels, self_keys


@pytest.mark.parametrize("seed,ks,blocks", [(0, (1, 5, 10), (7, 5)), (1, (1,), (2, 3)), (2, (1, 5), (16, 50)),
                                            (3, (1, 5), (64, 1000)), (4, (100,), (33, 17))])
def test_blocked_with_class_labels_matches_the_reference(seed, ks, blocks):
    """R near 60 (more than every key block but the last, and than some ks) with 3 classes over
    240 items, each query's own key left out."""
    items, labels, self_keys = class_problem(seed, 240)
    sim = items.double() @ items.double().T
    positives = (labels[:, None] == labels[None, :]) & (labels[:, None] >= 0)
    reference = reference_metrics(sim, positives, ks, excluded=self_keys.tolist())
    assert blocked_retrieval_metrics(items, items, labels, labels, ks, self_keys=self_keys, query_block=blocks[0],
                                     key_block=blocks[1]) == pytest.approx(reference, abs=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_exact_first_ranks_of_queries_without_a_positive_in_their_top_d(seed):
    """First ranks past the top D must be the ranks the float64 reference gives (score, then
    lowest index, the query's own key left out): with class labels (D = R, key blocks of 11:
    positives in more blocks than are kept), and with 5 positives each and D = 5 on a tied grid
    and on untrained, structureless data, where most first ranks are counted past the top D —
    each query's rank checked alone too."""
    items, labels, self_keys = class_problem(seed, 240)
    sim = items.double() @ items.double().T
    positives = (labels[:, None] == labels[None, :]) & (labels[:, None] >= 0)
    reference = reference_metrics(sim, positives, (1,), excluded=self_keys.tolist())
    assert blocked_retrieval_metrics(items, items, labels, labels, (1,), self_keys=self_keys, query_block=32,
                                     key_block=11) == pytest.approx(reference, abs=1e-9)
    g = torch.Generator().manual_seed(seed)  # 5 positives each, few in the top 5: tied and untrained
    grid = (torch.randint(-2, 3, (50, 3), generator=g).float(), torch.randint(-2, 3, (250, 3), generator=g).float())
    for queries, keys in (grid, (torch.randn(50, 16, generator=g), torch.randn(250, 16, generator=g))):
        ql, kl = torch.arange(50), torch.arange(50).repeat_interleave(5)
        sim = queries.double() @ keys.double().T
        reference = reference_metrics(sim, ql[:, None] == kl[None, :], (1, 5))
        assert blocked_retrieval_metrics(queries, keys, ql, kl, (1, 5), query_block=16, key_block=64) == \
            pytest.approx(reference, abs=1e-9)
        for q in range(50):  # one query at a time: its median rank is its exact first-positive rank
            alone = reference_metrics(sim[q:q + 1], (ql[q:q + 1, None] == kl[None, :]), (1,))
            assert blocked_retrieval_metrics(queries[q:q + 1], keys, ql[q:q + 1], kl, (1,), key_block=64)[
                "median_rank"] == alone["median_rank"], q


@pytest.mark.parametrize("seed", range(2))
def test_first_ranks_counted_without_a_top_are_the_references(seed):
    """The median's exact ranks (no running top): on a tied grid with each query's own key left
    out, with 5 positives in one key block (counted in one pass) and with class labels over key
    blocks of 11 (positives outside the kept blocks: the two-pass fallback), each query's rank
    is the float64 reference's."""
    items, labels, self_keys = class_problem(seed, 120)
    grid = torch.randint(-2, 3, (120, 4), generator=torch.Generator().manual_seed(seed)).float()
    for queries, keys, ql, kl, key_block in ((grid[:24], grid, torch.arange(24), torch.arange(120) // 5, 16),
                                             (items, items, labels, labels, 11)):
        sorted_labels, keys_by_label = torch.sort(kl, stable=True)
        own = self_keys[:len(queries)]
        n_positive = ((ql[:, None] == kl[None, :]) & (ql[:, None] >= 0)).sum(1) - (
            (own >= 0) & (kl[own.clamp(min=0)] == ql) & (ql >= 0)).long()
        rows = (n_positive > 0).nonzero().squeeze(1)
        own = own[rows]
        found = metrics_module._exact_first_ranks(queries[rows], keys, ql[rows], kl, keys_by_label, sorted_labels,
                                                  n_positive[rows], own, key_block)
        sim = queries[rows].double() @ keys.double().T
        expected = [reference_metrics(sim[i:i + 1], ql[rows][i:i + 1, None] == kl[None, :], (1,),
                                      excluded=[int(own[i])])["median_rank"] for i in range(len(rows))]
        assert found.tolist() == expected


@pytest.mark.parametrize("seed", range(2))
def test_narrowed_block_tops_keep_every_tie_at_the_cut(seed, monkeypatch):
    """Six key blocks of 2048 and D = 6 take the narrowed path (groups of TOP_GROUP columns
    whose maximum reaches the floor and the D-th group maximum); scores on a coarse grid tie by
    the hundred, at the cut and across groups, so only the lower-index rule picks the top D.
    Most queries' positives lie in few blocks (one-pass first ranks); ten queries have one
    positive in each of the six blocks, more than the kept blocks (two-pass first ranks); ten
    have none. The float64 reference agrees."""
    g = torch.Generator().manual_seed(seed)
    n_keys, key_block = 12288, 2048
    queries = torch.randint(-2, 3, (60, 4), generator=g).float() / 2
    keys = torch.randint(-2, 3, (n_keys, 4), generator=g).float() / 2
    key_labels = torch.randint(0, 50_000, (n_keys,), generator=g)
    spread = 50_000 + torch.arange(10)
    for block in range(n_keys // key_block):
        key_labels[block * key_block + 7 * torch.arange(10)] = spread
    query_labels = torch.cat([key_labels[torch.arange(0, 12_000, 300)], spread, torch.full((10,), -1)])
    sim = queries.double() @ keys.double().T
    positives = (query_labels[:, None] == key_labels[None, :]) & (query_labels[:, None] >= 0)
    assert 4 * max(5, int(positives.sum(1).max())) * metrics_module.TOP_GROUP <= key_block
    called, two_pass = [], metrics_module._first_positive_ranks
    monkeypatch.setattr(metrics_module, "_first_positive_ranks", lambda *a: called.append(len(a[0])) or two_pass(*a))
    assert blocked_retrieval_metrics(queries, keys, query_labels, key_labels, (1, 5), query_block=32,
                                     key_block=key_block) == pytest.approx(
        reference_metrics(sim, positives, (1, 5)), abs=1e-9)
    assert called


def test_keys_above_the_best_positive_are_counted_in_the_rows_that_can_have_one():
    """A block's count reads only the rows with a group maximum above their threshold while
    they are under half (a trained query block: most best positives rank first), every row
    otherwise (an untrained block, below); both on a tied grid, with first ranks past D = 5,
    give the float64 reference's metrics."""
    g = torch.Generator().manual_seed(0)
    queries = torch.randint(-2, 3, (128, 8), generator=g).float() / 2
    near = queries[:64].repeat_interleave(5, 0) + torch.randint(-1, 2, (320, 8), generator=g).float() / 2
    keys = torch.cat([near, torch.randint(-2, 3, (4096 - 320, 8), generator=g).float() / 2])
    ql = torch.arange(128)
    kl = torch.cat([torch.arange(64).repeat_interleave(5), torch.full((320,), -1), torch.arange(64, 128).repeat(5),
                    torch.full((4096 - 960,), -1)])
    sim = queries.double() @ keys.double().T
    positives = ql[:, None] == kl[None, :]
    trained, untrained = (reference_metrics(sim[half], positives[half], (1, 5)) for half in (slice(0, 64),
                                                                                             slice(64, 128)))
    assert trained["R@1"] > 50 and trained["R@5"] < 100 and untrained["median_rank"] > 100
    assert blocked_retrieval_metrics(queries, keys, ql, kl, (1, 5), query_block=64, key_block=2048) == \
        pytest.approx(reference_metrics(sim, positives, (1, 5)), abs=1e-9)


SCREENED = pytest.mark.skipif(not compat.torch.native_bf16_products(torch.device("cpu")),
                              reason="this CPU has no native bfloat16 products: nothing is screened")


def near_tied_problem(seed, n_images=120, dim=64, untrained=0.0):
    """Unnormalised embeddings whose scores bfloat16 cannot tell apart: every image's caption
    centre is one of 12 prototypes plus 10⁻³ of noise (so ~50 captions score within 10⁻³ of
    each other), scaled by 0.1–10, 5 captions each; images are their centre plus noise, or (a
    fraction ``untrained``) unrelated random vectors."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(12, dim, generator=g)
    centres = prototypes[torch.randint(0, 12, (n_images,), generator=g)] + 1e-3 * torch.randn(n_images, dim, generator=g)
    captions = centres.repeat_interleave(5, 0) + 1e-3 * torch.randn(5 * n_images, dim, generator=g)
    captions *= 10 ** (2 * torch.rand(5 * n_images, 1, generator=g) - 1)
    images = centres + 0.3 * torch.randn(n_images, dim, generator=g)
    random = torch.rand(n_images, generator=g) < untrained
    images[random] = torch.randn(int(random.sum()), dim, generator=g)
    return images, captions, torch.arange(n_images), torch.arange(n_images).repeat_interleave(5)


def structureless_problem(seed, n_images=100, dim=256):
    """Random embeddings, 5 captions per image: every score near 0 against norms of 16, where a
    bfloat16 product's error (its inputs' rounding) is about the gap between neighbouring ranks."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_images, dim, generator=g), torch.randn(5 * n_images, dim, generator=g) * 4,
            torch.arange(n_images), torch.arange(n_images).repeat_interleave(5))


@SCREENED
@pytest.mark.parametrize("problem", [lambda: near_tied_problem(0), lambda: near_tied_problem(1, untrained=0.3),
                                     lambda: near_tied_problem(2, untrained=1.0), lambda: structureless_problem(3)],
                         ids=["trained", "partly untrained", "untrained", "structureless"])
def test_screened_metrics_are_exact_where_bfloat16_cannot_tell_keys_apart(problem, monkeypatch):
    """With one query block, every query is screened (bfloat16 products, top D rescored,
    first ranks past D as ranges): the metrics are the float64 reference's and the unscreened
    path's — and with the median rank past D its ranges were resolved by exact passes."""
    queries, keys, ql, kl = problem()
    reference = reference_metrics(queries.double() @ keys.double().T, ql[:, None] == kl[None, :], (1, 5, 10))
    screened, resolved = [], []
    for name, calls in (("_Screen", screened), ("_exact_first_ranks", resolved)):
        original = getattr(metrics_module, name)
        monkeypatch.setattr(metrics_module, name, lambda *a, original=original, calls=calls: calls.append(len(a[0]))
                            or original(*a))
    found = blocked_retrieval_metrics(queries, keys, ql, kl, query_block=len(queries), key_block=128)
    assert found == pytest.approx(reference, abs=1e-9)
    assert screened == [len(queries)] and (reference["median_rank"] > 10) == bool(resolved)
    assert blocked_retrieval_metrics(queries, keys, ql, kl, query_block=len(queries), key_block=128,
                                     screen=False) == found


@SCREENED
@pytest.mark.parametrize("seed", range(8))
def test_screened_top_d_holds_the_key_ranked_d_th_exactly(seed):
    """20 keys score 0.001·‖q‖ to 0.02·‖q‖, 0.001·‖q‖ apart (far apart in float32), while their
    components across the query, of norm about 45, make bfloat16 products misorder them; 500
    others score far below. The one positive, exactly 10th, is in the screened top 10 at rank 10."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(128, generator=g)
    unit = query / query.norm()
    spread = torch.randn(20, 128, generator=g)
    close = 4 * (spread - (spread @ unit)[:, None] * unit) + 1e-3 * torch.arange(20, 0, -1)[:, None] * unit
    far = torch.randn(500, 128, generator=g) - 3 * unit
    keys = torch.cat([far[:250], close, far[250:]])[torch.randperm(520, generator=g)]
    labels = torch.full((520,), -1)
    labels[torch.sort(keys.double() @ query.double(), descending=True).indices[9]] = 0
    found = blocked_retrieval_metrics(query[None], keys, [0], labels, key_block=128)
    assert (found["R@10"], found["R@5"], found["median_rank"]) == (100.0, 0.0, 10.0)


@SCREENED
def test_screened_queries_that_drop_a_possible_top_key_are_scored_exactly(monkeypatch):
    """With no spare room in the running lists (D keys each) near-tied keys are dropped that
    may still belong to a top D: those queries are scored exactly, and the metrics stay the
    reference's."""
    queries, keys, ql, kl = near_tied_problem(3, untrained=0.2)
    replaced, with_exact = [], metrics_module._with_exact
    monkeypatch.setattr(metrics_module, "SCREEN_SPARE", 0)
    monkeypatch.setattr(metrics_module, "_with_exact", lambda *a: replaced.append(int(a[2].sum())) or with_exact(*a))
    assert blocked_retrieval_metrics(queries, keys, ql, kl, query_block=64, key_block=128) == pytest.approx(
        reference_metrics(queries.double() @ keys.double().T, ql[:, None] == kl[None, :], (1, 5, 10)), abs=1e-9)
    assert sum(replaced) > 0


@SCREENED
def test_screened_query_blocks_share_one_pass_over_the_keys(monkeypatch):
    """Query blocks are screened SCREENED_TOGETHER at a time, in one pass over the keys each; a
    block among them with more positive pairs than the budget (its queries share a label of 30
    keys) takes the float32 path instead, in its place (untrained queries: the median's exact
    passes would otherwise rank other queries); the metrics are the reference's."""
    queries, keys, ql, kl = near_tied_problem(4, n_images=120, untrained=1.0)
    kl[:30], ql[16:32] = 999, 999  # block 1 (queries 16–31): 16 × 30 pairs; the others at most 16 × 5
    screened, keys_passes = [], metrics_module._screen_keys
    monkeypatch.setattr(metrics_module, "SCREENED_TOGETHER", 3)
    monkeypatch.setattr(metrics_module, "POSITIVE_PAIR_BUDGET", 200)
    monkeypatch.setattr(metrics_module, "_screen_keys", lambda screens, *a: screened.append(
        [len(screen.queries) for screen in screens]) or keys_passes(screens, *a))
    found = blocked_retrieval_metrics(queries, keys, ql, kl, query_block=16, key_block=128)
    assert found == pytest.approx(reference_metrics(queries.double() @ keys.double().T, ql[:, None] == kl[None, :],
                                                    (1, 5, 10)), abs=1e-9)
    assert screened == [[16, 16], [16, 16, 16], [16, 8]]


def test_screen_error_bounds_bfloat16_products_against_exact_scores():
    """Every bfloat16 product o lies within ε + u/(1 − u)·|o| of the exact score (float64 of
    the float32 embeddings), ε from :func:`_screen_error`, u the product's rounding — for
    embeddings of norms from about 10 to 10⁵, and of about 10⁻¹⁹ (products near float32's
    subnormals)."""
    g = torch.Generator().manual_seed(0)
    u = compat.torch.BF16_PRODUCT_ROUNDING
    for scale in (1.0, 1e3, 1e-20):
        queries = torch.randn(64, 96, generator=g) * scale * 10 ** torch.rand(64, 1, generator=g)
        keys = torch.randn(500, 96, generator=g) * scale * 10 ** torch.rand(500, 1, generator=g)
        rounded = queries.bfloat16()
        error = metrics_module._screen_error(queries, rounded.float(), metrics_module._key_norms(keys, 128))
        screened = compat.torch.bf16_inner_products(rounded, keys.bfloat16(), torch.empty(64, 500)).double()
        exact = queries.double() @ keys.double().T
        assert ((exact - screened).abs() <= error[:, None] + u / (1 - u) * screened.abs()).all()
        if scale >= 1:  # and tight (subnormal products are bounded absolutely)
            assert float(error.max()) < 0.01 * float(queries.norm(dim=1).max() * keys.norm(dim=1).max())


@pytest.mark.parametrize("seed", range(20))
def test_median_of_ranges_is_resolved_exactly(seed):
    """Ranks known as ranges [lowest, highest]: those made exact give the true median, whatever
    value in its range each other rank has, and ranges that cannot move it stay ranges."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=g))
    true = torch.randint(1, 200, (n,), generator=g)
    lowest = (true - torch.randint(0, 40, (n,), generator=g)).clamp(min=1)
    highest = true + torch.randint(0, 40, (n,), generator=g)
    exact_ones = torch.rand(n, generator=g) < 0.3
    lowest[exact_ones], highest[exact_ones] = true[exact_ones], true[exact_ones]
    asked = []
    resolved = metrics_module._median_resolved(lowest, highest, lambda at: asked.append(at) or true[at])
    assert float(np.median(resolved.numpy())) == float(np.median(true.numpy()))
    assert all(not exact_ones[at].any() for at in asked)


def test_first_ranks_take_two_passes_past_the_positive_pair_budget(monkeypatch):
    """With no positive pairs allowed (as with class labels in the thousands) no query block
    keeps a score block, and each query without a positive in its top D (structureless data, 5
    positives of 250 keys, D = 5: most queries) gets its exact rank from the two-pass fallback;
    the metrics stay the reference's."""
    g = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(50, 16, generator=g), torch.randn(250, 16, generator=g)
    ql, kl = torch.arange(50), torch.arange(50).repeat_interleave(5)
    reference = reference_metrics(queries.double() @ keys.double().T, ql[:, None] == kl[None, :], (1, 5))
    called, two_pass = [], metrics_module._first_positive_ranks
    monkeypatch.setattr(metrics_module, "_first_positive_ranks", lambda *a: called.append(len(a[0])) or two_pass(*a))
    monkeypatch.setattr(metrics_module, "POSITIVE_PAIR_BUDGET", 0)
    assert blocked_retrieval_metrics(queries, keys, ql, kl, (1, 5), query_block=16, key_block=64) == \
        pytest.approx(reference, abs=1e-9)
    assert sum(called) > 25


def test_blocked_summarises_each_query_block_within_the_top_depth_budget(monkeypatch):
    """The ranked hits exist one query block at a time, of at most ⌊TOP_DEPTH_BUDGET / D⌋ queries
    when D is large, never [Q, D]; the metrics stay the reference's."""
    items, labels, self_keys = class_problem(5, 200, n_classes=2)
    sim = items.double() @ items.double().T
    positives = (labels[:, None] == labels[None, :]) & (labels[:, None] >= 0)
    depth = max(5, int((positives & ~torch.diag(self_keys >= 0)).sum(1).max()))  # D = max(max(ks), largest R)
    shapes, query_values = [], metrics_module.query_values

    def recording(hits, n_positive, first_rank):
        shapes.append(tuple(hits.shape))
        return query_values(hits, n_positive, first_rank)

    monkeypatch.setattr(metrics_module, "query_values", recording)
    monkeypatch.setattr(metrics_module, "TOP_DEPTH_BUDGET", 10 * depth)
    found = blocked_retrieval_metrics(items, items, labels, labels, (1, 5), self_keys=self_keys, query_block=64,
                                      key_block=32)
    assert found == pytest.approx(reference_metrics(sim, positives, (1, 5), excluded=self_keys.tolist()), abs=1e-9)
    assert shapes == [(10, depth)] * 20


BLOCKED_PEAK = """
import sys, torch
sys.path.insert(0, {platform!r})
from pairsim.eval.metrics import blocked_retrieval_metrics
def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))
torch.set_num_threads(1)  # no per-thread allocator arenas
n = {n}
items = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
labels, self_keys = torch.arange(n) % 2, torch.arange(n)
for _ in range(2):  # the first call also maps the library pages it runs: measure the second
    before = kib("VmRSS:")
    blocked_retrieval_metrics(items, items, labels, labels, self_keys=self_keys, query_block=64, key_block=1024)
print((kib("VmHWM:") - before) * 1024)
"""


def test_blocked_memory_does_not_grow_with_queries_times_depth():
    """Two classes over n items: D = R ≈ n/2, so a [Q, D] summary (bool hits, float64 precision
    and its temporaries) needs over Q·D·12 bytes (24 MB at n = 2000); the blocks need ~1 MB.
    Peak RSS (VmHWM: ru_maxrss would inherit the forking pytest's) beyond what a fresh process
    held before the measured call; a fixed mmap threshold makes glibc unmap freed blocks at
    once, so RSS counts only live tensors."""
    n = 2000
    script = BLOCKED_PEAK.format(platform=str(Path(metrics_module.__file__).parents[2]), n=n)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True,
                          env=os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072"})
    extra = int(done.stdout.split()[-1])
    assert extra < n * (n // 2) * 12, f"peak RSS grew by {extra / 2**20:.0f} MB"


def unit(*rows):
    return torch.nn.functional.normalize(torch.tensor(rows, dtype=torch.float32), dim=1)


def tiny_split(image_unimodal=None) -> SplitEmbeddings:
    """Images a, b (class 0) and c (class 1); a and b have two captions each, c one. Caption rows
    are out of caption order, so the grid must sort them."""
    return SplitEmbeddings(
        image=unit([1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 1]),
        image_ids=np.array(["a", "b", "c"]), labels=np.array([0, 0, 1]),
        #                 a/1           a/0           b/0           b/1           c/0
        text=unit([0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1], [0, 1, 0, 0]),
        text_image_ids=np.array(["a", "a", "b", "b", "c"]), caption_index=np.array([1, 0, 0, 1, 0]),
        image_unimodal=image_unimodal)


def test_grid_items_use_another_caption_for_keys_than_for_queries():
    images, query_rows, key_rows = grid_items(tiny_split())
    assert images.tolist() == [0, 1]          # c has a single caption
    assert query_rows.tolist() == [1, 2]      # caption index 0 of a and b
    assert key_rows.tolist() == [0, 3]        # caption index 1


def test_modality_grid_on_a_known_geometry():
    """Images a, b are orthogonal to every caption: image↔text ties, broken towards item a (50 %).
    Captions of one item point the same way, so text↔text and everything fused find their item."""
    grid = modality_grid(tiny_split(), NormalizedSumFusion())
    np.testing.assert_allclose(grid[1], [[100, 50, 100], [50, 100, 100], [100, 100, 100]])
    np.testing.assert_allclose(grid[5], np.full((3, 3), 100.0))


def test_unimodal_metrics_use_the_unimodal_heads_and_exclude_the_query_itself():
    # cross-modal image embeddings put a and b next to c (another class); the uni-modal ones together
    metrics = unimodal_metrics(tiny_split(), ks=(1,))
    assert metrics["i2i_R@1"] == 0.0 and metrics["i2i_n_queries_without_positive"] == 1  # c: no other class-1 image
    metrics = unimodal_metrics(tiny_split(image_unimodal=unit([1, 0.2, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0])), ks=(1,))
    assert metrics["i2i_R@1"] == 100.0 and metrics["i2i_mAP@R"] == 100.0
    # t2t: a/1 ↔ a/0 and b/0 ↔ b/1 identical; c/0 has no other caption
    assert metrics["t2t_R@1"] == 100.0 and metrics["t2t_n_queries_without_positive"] == 1


def test_unimodal_metrics_skip_images_without_class_labels():
    split = tiny_split()
    split.labels = np.array([-1, -1, -1])
    assert not any(k.startswith("i2i") for k in unimodal_metrics(split, ks=(1,)))


def test_evaluate_split_reports_every_family_and_draws_its_pictures(tmp_path):
    split = tiny_split()
    report = evaluate_split(split, NormalizedSumFusion(), ks=(1, 5))
    # a scores 0 with every caption: the tie goes to row 0 (a/1), a hit; b and c rank c/0 or b/0 first
    assert report.metrics["i2t_R@1"] == pytest.approx(100 / 3) and report.metrics["rsum"] == pytest.approx(
        sum(report.metrics[f"{d}_R@{k}"] for d in ("i2t", "t2i") for k in (1, 5)))
    for key in ("i2t_mAP@R", "t2i_R-P", "t2i_median_rank", "t2t_R@5", "i2i_R@1", "grid_text2fused_R@1",
                "grid_fused2image_R@5"):
        assert key in report.metrics, key
    heatmap = grid_heatmap(report.grid, tmp_path / "grid.png")
    gallery = retrieval_gallery(split, read_tiny_rows, tmp_path / "gallery.png", k=3)
    for path in (heatmap, gallery):
        with Image.open(path) as image:
            assert image.format == "PNG" and np.asarray(image.convert("L")).std() > 10


def read_tiny_rows(ids: list[str]) -> dict[str, dict]:
    """tiny_split's shard rows: a, b and c, one colour each."""
    rows = {}
    for name, colour in zip("abc", ("red", "green", "blue")):
        buffer = io.BytesIO()
        Image.new("RGB", (16, 16), colour).save(buffer, format="PNG")
        rows[name] = {"image": buffer.getvalue(), "captions": [f"{name} zero", f"{name} one"]}
    return {i: rows[i] for i in ids}


def test_pictures_are_logged_as_step_images(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(new_experiment(uri)).info.run_id
    split = tiny_split()
    report = evaluate_split(split, NormalizedSumFusion(), ks=(1, 5))
    with RunLogger(uri, run_id) as run:
        for epoch, step in enumerate((8, 16), start=1):
            log_pictures(run, report, split, read_tiny_rows, "val", step, title=f"val, epoch {epoch}")
    assert step_images(client, run_id) == {(key, step) for key in ("val/gallery", "val/modality_grid")
                                           for step in (8, 16)}


def test_split_from_raw_outputs_is_scored_by_cosine_and_fused_from_the_raw_outputs():
    """Heads give outputs of any norm: the split keeps them L2-normalised (ranking by cosine, not
    by dot product) with their norms, and ``raw_sum`` fuses the outputs as the model gave them."""
    from pairsim.models.fusion import RawSumFusion

    rng = np.random.default_rng(0)
    image, text = rng.normal(size=(4, 3)) * [[1], [5], [0.2], [3]], rng.normal(size=(8, 3)) * 7
    batches = [{"image_ids": np.array(["a", "b", "c", "d"]), "labels": np.array([0, 0, 1, 1]),
                "image": image.astype(np.float32)},
               {"text_image_ids": np.repeat(["a", "b", "c", "d"], 2), "caption_index": np.tile([0, 1], 4),
                "text": text.astype(np.float32)}]
    split = SplitEmbeddings.from_batches(batches)
    torch.testing.assert_close(split.image.norm(dim=1), torch.ones(4))
    torch.testing.assert_close(split.text.norm(dim=1), torch.ones(8))
    rows = np.array([1, 3])
    torch.testing.assert_close(split.raw("image", rows), torch.from_numpy(image[rows]).float())
    cosine = (image / np.linalg.norm(image, axis=1, keepdims=True)) @ (text / np.linalg.norm(text, axis=1,
                                                                                              keepdims=True)).T
    i2t = retrieval_metrics(torch.from_numpy(cosine), torch.from_numpy(np.repeat(np.eye(4, dtype=bool), 2, axis=1)),
                            (1, 5))
    assert evaluate_split(split, NormalizedSumFusion(), (1, 5)).metrics["i2t_R@1"] == pytest.approx(i2t["R@1"])
    seen = []

    class Recording(RawSumFusion):
        def forward(self, image, text):
            seen.append((image, text))
            return super().forward(image, text)

    modality_grid(split, Recording(), (1,))
    (query_image, query_text), (key_image, key_text) = seen  # the grid's fused queries, then its keys
    torch.testing.assert_close(query_image, torch.from_numpy(image).float())  # the outputs as the model gave them
    torch.testing.assert_close(query_text, torch.from_numpy(text[0::2]).float())  # caption 0 of each image
    torch.testing.assert_close(key_text, torch.from_numpy(text[1::2]).float())


def test_split_from_device_tensors_equals_the_split_from_arrays():
    """Validation keeps the embeddings as tensors on the worker's device: concatenated and
    normalised there, they score as arrays do; ``to`` moves every tensor."""
    split = tiny_split()
    fields = {"image_ids": split.image_ids, "labels": split.labels, "text_image_ids": split.text_image_ids,
              "caption_index": split.caption_index}
    halves = [fields | {"image": split.image * 2, "text": split.text * 3}]
    from_tensors = SplitEmbeddings.from_batches(halves)
    from_arrays = SplitEmbeddings.from_batches([fields | {"image": (split.image * 2).numpy(),
                                                          "text": (split.text * 3).numpy()}])
    torch.testing.assert_close(from_tensors.image, from_arrays.image)
    torch.testing.assert_close(from_tensors.text_norm, from_arrays.text_norm)
    assert evaluate_split(from_tensors, NormalizedSumFusion()).metrics == evaluate_split(
        from_arrays, NormalizedSumFusion()).metrics
    moved = from_tensors.to("meta")
    assert moved.image.device.type == moved.image_norm.device.type == "meta" and moved.image_ids is from_tensors.image_ids


def test_in_daemon_thread_hands_back_the_result_or_the_error_from_a_daemon_thread():
    """The caption pass of ``embed_with_ray_data`` runs this way: its error is raised where its
    result is awaited, and a Ctrl-C'd driver does not wait for it at exit."""
    import threading

    thread = in_daemon_thread(threading.current_thread).result(timeout=30)
    assert thread.daemon and thread is not threading.current_thread()
    assert in_daemon_thread(sum, [1, 2]).result(timeout=30) == 3
    with pytest.raises(ZeroDivisionError):
        in_daemon_thread(divmod, 1, 0).result(timeout=30)
