"""Every loss against a naive float64 implementation written from the papers' formulas, the
identities between them, bf16 inputs, and the modules on 2 gloo processes vs 1 process."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import on_gloo_ranks
from pairsim.config import load_config
from pairsim.build import build_objective
from pairsim.losses import (Bounded, CUSALoss, GCLLoss, ImageTextLoss, InfoNCE, Sigmoid, Temperature, TripletHN,
                            Unified)
from pairsim.losses import functional as L
from toy_loss import CosineHinge

# ----------------------------------------------------------------------- naive float64 references


def lse(values):
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def lists(*tensors):
    """Plain Python numbers: the references never touch torch arithmetic."""
    return [t.tolist() for t in tensors]


def naive_infonce(sim, scale, pos):
    b, total = len(sim), 0.0
    for s, p in (lists(sim, pos), lists(sim.T, pos.T)):
        for i in range(b):
            row = [scale * s[i][j] for j in range(b)]
            targets = [j for j in range(b) if p[i][j] or j == i]
            total += -sum(row[t] - lse(row) for t in targets) / len(targets) / b
    return total


def naive_unified(sim, margin, gamma, pos):
    """log1p of a plain sum of exponentials, exactly as eq. (5) reads (overflows for large γ)."""
    (s, p), b, total = lists(sim, pos), len(sim), 0.0
    for i in range(b):
        i2t = sum(math.exp(gamma * (s[i][j] - s[i][i] + margin)) for j in range(b) if j != i and not p[i][j])
        t2i = sum(math.exp(gamma * (s[j][i] - s[i][i] + margin)) for j in range(b) if j != i and not p[j][i])
        total += (math.log1p(i2t) + math.log1p(t2i)) / gamma
    return total / b


def naive_triplet(sim, margin, pos):
    (s, p), b, total = lists(sim, pos), len(sim), 0.0
    for i in range(b):
        i2t = max(s[i][j] for j in range(b) if j != i and not p[i][j])
        t2i = max(s[j][i] for j in range(b) if j != i and not p[j][i])
        total += max(i2t - s[i][i] + margin, 0) + max(t2i - s[i][i] + margin, 0)
    return total / b


def naive_sigmoid(sim, scale, bias, pos):
    """SigLIP's eq. (1): −(1/|B|) Σ_i Σ_j log σ(z_ij (t·x_i·y_j + b)), −log σ(x) = log(1 + e^{−x})."""
    (s, p), b = lists(sim, pos), len(sim)
    total = 0.0
    for i in range(b):
        for j in range(b):
            z = 1.0 if i == j or p[i][j] else -1.0
            total += math.log1p(math.exp(-z * (scale * s[i][j] + bias)))
    return total / b


def naive_gcl(embeddings, tau, groups, mask_self=True):
    """The GCL formula term by term: every pair j, query modality a, positive modality b != a."""
    normed = [[[x / math.sqrt(sum(y * y for y in row)) for x in row] for row in e.tolist()] for e in embeddings]
    n, m, groups = len(normed[0]), len(normed), groups.tolist()
    cos = lambda a, j, b, k: sum(x * y for x, y in zip(normed[a][j], normed[b][k]))  # noqa: E731
    total, terms = 0.0, 0
    for j in range(n):
        for a in range(m):
            keys = [cos(a, j, b, k) / tau for b in range(m) for k in range(n)
                    if not (mask_self and b == a and k == j) and not (k != j and groups[k] == groups[j])]
            for b in range(m):
                if b != a:
                    total -= cos(a, j, b, j) / tau - lse(keys)
                    terms += 1
    return total / terms


def naive_kl_rows(teacher, student):
    total = 0.0
    for t_row, s_row in zip(teacher.tolist(), student.tolist()):
        lq, lp = lse(t_row), lse(s_row)
        total += sum(math.exp(t - lq) * ((t - lq) - (s - lp)) for t, s in zip(t_row, s_row))
    return total / len(teacher)


def unit(b, d, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(b, d, generator=g, dtype=dtype), dim=-1)


GROUPS = torch.tensor([0, 0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8])  # duplicates inside and across the halves


def group_positives(groups):
    return groups[:, None] == groups[None, :]


# ------------------------------------------------------------------------------- functional API

@pytest.mark.parametrize("with_positives", [False, True])
@pytest.mark.parametrize("scale", [1.0, 20.0])
def test_infonce_matches_naive(with_positives, scale):
    sim = unit(12, 16, 0) @ unit(12, 16, 1).T
    pos = group_positives(GROUPS) if with_positives else torch.eye(12, dtype=torch.bool)
    got = L.infonce_loss(sim, scale, pos if with_positives else None)
    assert got.item() == pytest.approx(naive_infonce(sim, scale, pos), rel=1e-10)


@pytest.mark.parametrize("with_positives", [False, True])
@pytest.mark.parametrize("margin,gamma", [(0.2, 50.0), (0.0, 10.0), (0.5, 5.0)])
def test_unified_matches_naive(with_positives, margin, gamma):
    sim = unit(12, 16, 2) @ unit(12, 16, 3).T
    pos = group_positives(GROUPS) if with_positives else torch.eye(12, dtype=torch.bool)
    got = L.unified_loss(sim, margin, gamma, pos if with_positives else None)
    assert got.item() == pytest.approx(naive_unified(sim, margin, gamma, pos), rel=1e-10)


@pytest.mark.parametrize("with_positives", [False, True])
def test_triplet_hn_matches_naive(with_positives):
    sim = unit(12, 16, 4) @ unit(12, 16, 5).T
    pos = group_positives(GROUPS) if with_positives else torch.eye(12, dtype=torch.bool)
    got = L.triplet_hn_loss(sim, 0.3, pos if with_positives else None)
    assert got.item() == pytest.approx(naive_triplet(sim, 0.3, pos), rel=1e-10)


@pytest.mark.parametrize("with_positives", [False, True])
@pytest.mark.parametrize("scale,bias", [(10.0, -10.0), (1.0, 0.0), (50.0, -5.0)])
def test_sigmoid_matches_naive(with_positives, scale, bias):
    sim = unit(12, 16, 7) @ unit(12, 16, 8).T
    pos = group_positives(GROUPS) if with_positives else torch.eye(12, dtype=torch.bool)
    got = L.sigmoid_loss(sim, scale, bias, pos if with_positives else None)
    assert got.item() == pytest.approx(naive_sigmoid(sim, scale, bias, pos), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sigmoid_equals_open_clips_siglip_loss(dtype):
    """Against ``open_clip.loss.SigLipLoss`` (one process) on the same features, scale and bias:
    the loss and the features' gradients."""
    from open_clip.loss import SigLipLoss

    image, text = unit(32, 16, 11, dtype).requires_grad_(True), unit(32, 16, 12, dtype).requires_grad_(True)
    scale, bias = torch.tensor(10.0, dtype=dtype), torch.tensor(-10.0, dtype=dtype)
    theirs = SigLipLoss()(image, text, scale, bias)
    their_grads = torch.autograd.grad(theirs, [image, text])
    ours = L.sigmoid_loss(image @ text.T, scale, bias)
    our_grads = torch.autograd.grad(ours, [image, text])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    assert ours.item() == pytest.approx(theirs.item(), rel=tolerance)
    for mine, reference in zip(our_grads, their_grads):
        torch.testing.assert_close(mine, reference, rtol=tolerance, atol=tolerance)


def test_off_diagonal_positives_are_never_pushed_apart():
    """Images 0 and 1 share a group: s_01 gets no gradient from the margin losses (neither anchor
    nor negative) and is pulled up by InfoNCE (a target)."""
    sim = (unit(12, 16, 6) @ unit(12, 16, 7).T).requires_grad_(True)
    pos = group_positives(GROUPS)
    for loss, sign in [(lambda s: L.unified_loss(s, 0.2, 50.0, pos), 0), (lambda s: L.triplet_hn_loss(s, 0.9, pos), 0),
                       (lambda s: L.infonce_loss(s, 10.0, pos), -1)]:
        (grad,) = torch.autograd.grad(loss(sim), sim)
        assert torch.sign(grad[0, 1]).item() == sign and torch.sign(grad[1, 0]).item() == sign
        assert (grad[0, 2:] > 0).any()  # while real negatives are pushed down


@pytest.mark.parametrize("with_groups", [False, True])
@pytest.mark.parametrize("mask_self", [True, False])
def test_gcl_matches_naive(with_groups, mask_self):
    image, text, fused = unit(12, 8, 8), unit(12, 8, 9), unit(12, 8, 10)
    groups = GROUPS if with_groups else torch.arange(12)
    got = L.gcl_loss(image * 3, text, fused * 0.5, 0.1, groups if with_groups else None, mask_self)
    assert got.item() == pytest.approx(naive_gcl([image, text, fused], 0.1, groups, mask_self), rel=1e-10)


def test_gcl_without_fused_is_the_two_modality_form():
    image, text = unit(12, 8, 11), unit(12, 8, 12)
    got = L.gcl_loss(image, text, None, 0.07, GROUPS)
    assert got.item() == pytest.approx(naive_gcl([image, text], 0.07, GROUPS), rel=1e-10)


def test_csa_and_usa_match_naive():
    image, text = unit(10, 8, 13), unit(10, 8, 14)
    t_img, t_txt = unit(10, 6, 15), unit(10, 6, 16)
    u_img, u_txt = unit(10, 8, 17), unit(10, 8, 18)
    sim, tis, tts = image @ text.T, t_img @ t_img.T, t_txt @ t_txt.T
    csa = L.csa_loss(sim, tis, tts, 0.45, teacher_temperature=0.7)
    expected = 0.5 * (naive_kl_rows(tis / 0.7, sim / 0.45) + naive_kl_rows(tts / 0.7, sim.T / 0.45))
    assert csa.item() == pytest.approx(expected, rel=1e-10)
    usa = L.usa_loss(u_img @ u_img.T, u_txt @ u_txt.T, tis, tts, 0.3, 0.6)
    expected = 0.5 * (naive_kl_rows(tis, u_img @ u_img.T / 0.3) + naive_kl_rows(tts, u_txt @ u_txt.T / 0.6))
    assert usa.item() == pytest.approx(expected, rel=1e-10)
    assert L.csa_loss(sim, sim / 0.45, sim.T / 0.45, 0.45).item() == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------------------- identities

def test_gamma_times_unified_at_zero_margin_is_infonce_at_scale_gamma():
    sim = unit(12, 16, 19) @ unit(12, 16, 20).T
    for gamma in (1.0, 14.0, 80.0):
        assert (gamma * L.unified_loss(sim, 0.0, gamma)).item() == pytest.approx(
            L.infonce_loss(sim, gamma).item(), rel=1e-10)


@pytest.mark.parametrize("with_positives", [False, True])
def test_unified_tends_to_triplet_hn_as_gamma_grows(with_positives):
    sim = unit(12, 16, 21) @ unit(12, 16, 22).T
    pos = group_positives(GROUPS) if with_positives else None
    triplet = L.triplet_hn_loss(sim, 0.2, pos).item()
    gaps = [abs(L.unified_loss(sim, 0.2, g, pos).item() - triplet) for g in (1e2, 1e3, 1e4, 1e5)]
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 1e-4


def features(b, seed, dtype=torch.float64, d=8, teacher_d=6):
    return {"image": unit(b, d, seed, dtype), "text": unit(b, d, seed + 1, dtype), "fused": unit(b, d, seed + 2, dtype),
            "image_unimodal": unit(b, d, seed + 3, dtype), "text_unimodal": unit(b, d, seed + 4, dtype),
            "teacher_image": unit(b, teacher_d, seed + 5, dtype), "teacher_text": unit(b, teacher_d, seed + 6, dtype)}


@pytest.mark.parametrize("structure", ["image_text", "gcl"])
def test_cusa_with_zero_weights_equals_its_base(structure):
    teachers = {"image_teacher": {"kind": "initial_student"}}
    cfg = load_config(None, [f"loss.structure={structure}", "loss.base=infonce",
                             f"loss.cusa={{alpha: 0, beta: 0, image_teacher: {teachers['image_teacher']}}}"])
    with_cusa, base_only = build_objective(cfg.loss), build_objective(cfg.loss.model_copy(update={"cusa": None}))
    feats = features(12, 30) | {"group_ids": GROUPS}
    out = with_cusa(**feats)
    assert out["loss/csa"] > 0 and out["loss/usa"] > 0
    assert out["loss"].item() == pytest.approx(base_only(**feats)["loss"].item(), rel=1e-12)


def test_objective_total_is_base_plus_weighted_cusa_terms():
    cfg = load_config(None, ["loss.cusa={alpha: 0.3, beta: 0.7, image_teacher: {kind: initial_student}}"])
    out = build_objective(cfg.loss)(**features(12, 40), group_ids=GROUPS)
    expected = out["loss/base"] + 0.3 * out["loss/csa"] + 0.7 * out["loss/usa"]
    assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-12)
    assert set(out) >= {"temperature/cross", "temperature/image", "temperature/text"}


def official_cusa(f, idx, tau, cross_tau, image_tau, text_tau, alpha, beta):
    """The CUSA authors' loss, transcribed from lerogo/aaai24_itr_cusa ``unire/model.py`` (mode
    ``mean``, ``use_loss: kl``, ``cross_softlabel_mode: each``, soft-label τ 1) in float64."""
    norm = lambda x: x / x.norm(dim=1, keepdim=True)  # noqa: E731  (get_similarity)
    logits_per_image = norm(f["image"]) @ norm(f["text"]).t()
    logits_per_text = logits_per_image.t()
    idx = idx.view(-1, 1)
    pos_idx = torch.eq(idx, idx.t()).double()
    sim_targets = pos_idx / pos_idx.sum(1, keepdim=True)
    loss_i2t = -torch.mean(F.log_softmax(logits_per_image / tau, dim=1) * sim_targets, dim=1).mean()
    loss_t2i = -torch.mean(F.log_softmax(logits_per_text / tau, dim=1) * sim_targets, dim=1).mean()
    contrastive = (loss_i2t + loss_t2i) / 2.0
    soft_image = norm(f["teacher_image"]) @ norm(f["teacher_image"]).t()
    soft_text = norm(f["teacher_text"]) @ norm(f["teacher_text"]).t()

    def kl(logits, softlabel, t):  # KLContrastiveSimLoss
        return F.kl_div(F.log_softmax(logits / t, dim=1), F.softmax(softlabel / 1.0, dim=1), reduction="batchmean")

    cross = (kl(logits_per_image, soft_image, cross_tau) + kl(logits_per_text, soft_text, cross_tau)) / 2.0 * alpha
    uni_image, uni_text = norm(f["image_unimodal"]), norm(f["text_unimodal"])
    uni = (kl(uni_image @ uni_image.t(), soft_image, image_tau) + kl(uni_text @ uni_text.t(), soft_text, text_tau)) / 2.0
    return cross + uni * beta + contrastive


CUSA_PAPER = ["loss.base=infonce", "loss.cusa={image_teacher: {kind: initial_student}, reduction: paper}"]


@pytest.mark.parametrize("b", [2, 12, 33, 128])
def test_cusa_paper_reduction_is_the_authors_loss(b):
    groups = torch.arange(b) // 3  # three pairs per image: the code's idx
    f = features(b, 90 + b)
    objective = build_objective(load_config(None, CUSA_PAPER).loss).double()
    out = objective(**f, group_ids=groups)
    taus = [t.item() for t in (objective.structure.base.temperature(), *objective.cusa.temperatures().values())]
    assert taus == pytest.approx([0.05, 0.45, 0.45, 0.45])  # the paper's (cross, image, text: dict order)
    expected = official_cusa(f, groups, *taus, alpha=0.1, beta=0.5)
    assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-15)
    # the two reductions differ by 2B on the base term only
    pairsim = build_objective(load_config(None, CUSA_PAPER + ["loss.cusa.reduction=pairsim"]).loss).double()
    assert pairsim(**f, group_ids=groups)["loss/base"].item() == pytest.approx(2 * b * out["loss/base"].item(),
                                                                               rel=1e-12)


def test_module_losses_equal_the_functional_ones():
    """The structure modules (rows × global columns machinery) against the whole-matrix functions."""
    f = features(12, 50)
    sim, pos = f["image"] @ f["text"].T, group_positives(GROUPS)
    tau = Temperature(0.05, 0.01, 0.1).double()
    sigmoid = Sigmoid(Temperature(0.1, 0.01, 1.0), Bounded(-10.0, -100.0, 100.0)).double()
    for base, expected in [(InfoNCE(tau), L.infonce_loss(sim, 1 / tau(), pos)),
                           (Unified(0.2, 50.0), L.unified_loss(sim, 0.2, 50.0, pos)),
                           (TripletHN(0.2), L.triplet_hn_loss(sim, 0.2, pos)),
                           (sigmoid, L.sigmoid_loss(sim, 1 / sigmoid.temperature(), sigmoid.bias(), pos))]:
        got = ImageTextLoss(base)(image=f["image"], text=f["text"], group_ids=GROUPS)
        assert got.item() == pytest.approx(expected.item(), rel=1e-12)
        assert base(sim, pos).item() == pytest.approx(expected.item(), rel=1e-12)
    got = GCLLoss(InfoNCE(tau))(image=f["image"], text=f["text"], fused=f["fused"], group_ids=GROUPS)
    assert got.item() == pytest.approx(L.gcl_loss(f["image"], f["text"], f["fused"], tau(), GROUPS).item(), rel=1e-12)
    cusa = CUSALoss().double()
    csa, usa = cusa(**{k: v for k, v in f.items() if k != "fused"})
    tau_c, tau_i, tau_t = cusa.cross_temperature(), cusa.image_temperature(), cusa.text_temperature()
    t_img, t_txt = f["teacher_image"] @ f["teacher_image"].T, f["teacher_text"] @ f["teacher_text"].T
    assert csa.item() == pytest.approx(L.csa_loss(sim, t_img, t_txt, tau_c).item(), rel=1e-12)
    expected = L.usa_loss(f["image_unimodal"] @ f["image_unimodal"].T, f["text_unimodal"] @ f["text_unimodal"].T,
                          t_img, t_txt, tau_i, tau_t)
    assert usa.item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize("base", [InfoNCE(Temperature(0.05, 0.01, 0.1).double()), Unified(0.2, 50.0), TripletHN(0.2),
                                  CosineHinge(0.3)], ids=["infonce", "unified", "triplet_hn", "cos_hinge"])
def test_square_fast_path_equals_the_masked_general_path(base):
    """One positive per row: the square form (one matrix, indexed targets) against the row
    functions given an all-False ignore mask and, where they take a target mask, the targets as
    a bool identity matrix (the masked general path), loss and gradient (float64)."""
    sim = (unit(12, 16, 23) @ unit(12, 16, 24).T).requires_grad_(True)
    eye, nothing = torch.eye(12, dtype=torch.bool), torch.zeros(12, 12, dtype=torch.bool)
    fast = base.square(sim)
    (fast_grad,) = torch.autograd.grad(fast, sim)
    targets = torch.arange(12) if isinstance(base, CosineHinge) else eye  # the toy takes column indices only
    general = base.rows(sim, targets, nothing).mean() + base.rows(sim.T, targets, nothing).mean()
    (general_grad,) = torch.autograd.grad(general, sim)
    # Unified's masked path: softplus, linear past 20 (off by up to e⁻²⁰ ≈ 2e-9)
    assert fast.item() == pytest.approx(general.item(), rel=1e-10)
    torch.testing.assert_close(fast_grad, general_grad, rtol=1e-8, atol=1e-12)
    assert base(sim, eye).item() == pytest.approx(fast.item(), rel=1e-12)  # identity positives: the fast path


def test_image_text_without_shared_images_is_the_square_loss():
    """No group ids, or all distinct: one matrix product, both directions, against the naive formulas."""
    f, tau = features(12, 55), Temperature(0.05, 0.01, 0.1).double()
    sim, eye = f["image"] @ f["text"].T, torch.eye(12, dtype=torch.bool)
    for base, expected in [(InfoNCE(tau), naive_infonce(sim, 1 / tau().item(), eye)),
                           (Unified(0.2, 50.0), naive_unified(sim, 0.2, 50.0, eye)),
                           (TripletHN(0.2), naive_triplet(sim, 0.2, eye))]:
        for groups in (None, torch.arange(12)):
            got = ImageTextLoss(base)(image=f["image"], text=f["text"], group_ids=groups)
            assert got.item() == pytest.approx(expected, rel=1e-10)


def test_triplet_hn_of_one_pair_is_zero():
    sim = torch.tensor([[0.3]], dtype=torch.float64, requires_grad=True)
    loss = L.triplet_hn_loss(sim, 0.2)
    loss.backward()
    assert loss.item() == 0.0 and sim.grad.item() == 0.0


def test_temperature_is_clamped_where_used():
    tau = Temperature(0.05, 0.01, 0.1)
    with torch.no_grad():
        tau.value.fill_(5.0)
    assert tau().item() == pytest.approx(0.1)
    assert Temperature(0.5, 0.1, 1.0, learnable=False).value.requires_grad is False
    with pytest.raises(ValueError, match="min <= init <= max"):
        Temperature(0.5, 0.01, 0.1)


# ------------------------------------------------------------------------- bf16 and bad values

@pytest.mark.parametrize("structure,base", [("image_text", "unified"), ("image_text", "triplet_hn"),
                                            ("image_text", "infonce"), ("gcl", "unified"), ("gcl", "infonce")])
def test_bf16_inputs_give_a_finite_fp32_loss_at_gamma_1000(structure, base):
    params = {"unified": ["loss.base.gamma=1000", "loss.base.margin=0.5"], "triplet_hn": ["loss.base.margin=0.5"], "infonce": []}
    cfg = load_config(None, [f"loss.structure={structure}", f"loss.base={base}", *params[base],
                             "loss.cusa={image_teacher: {kind: initial_student}}"])
    feats = {k: v.bfloat16().requires_grad_(True) for k, v in features(32, 60, torch.float32).items()}
    out = build_objective(cfg.loss)(**feats)
    out["loss"].backward()
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])
    assert all(torch.isfinite(v.grad).all() for k, v in feats.items() if v.grad is not None)


def test_unified_gradient_is_finite_in_float32_at_gamma_1000_with_saturated_rows():
    sim = torch.full((8, 8), -1.0, requires_grad=True)  # every negative far past the margin
    loss = L.unified_loss(sim * 1.0 + torch.eye(8) * 2.0, 0.5, 1000.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(sim.grad).all()




# --------------------------------------------------------------------- distributed equivalence

MODULES = {
    "image_text_infonce": ["loss.base=infonce"],
    "image_text_unified": ["loss.base=unified", "loss.base.gamma=30"],
    "image_text_triplet_hn": ["loss.base=triplet_hn"],
    "gcl_infonce": ["loss.structure=gcl", "loss.base=infonce"],
    "gcl_unified": ["loss.structure=gcl", "loss.base=unified", "loss.base.gamma=30"],
    "cusa_unified": ["loss.base=unified", "loss.base.gamma=30", "loss.cusa={image_teacher: {kind: initial_student}}"],
    "gcl_cusa_infonce": ["loss.structure=gcl", "loss.base=infonce",
                         "loss.cusa={image_teacher: {kind: initial_student}}"],
    "cusa_paper": CUSA_PAPER,
    "image_text_sigmoid": ["loss.base=sigmoid"],
    "gcl_sigmoid": ["loss.structure=gcl", "loss.base=sigmoid"],
    "cusa_sigmoid": ["loss.base=sigmoid", "loss.cusa={image_teacher: {kind: initial_student}}"],
    "image_text_sigmoid_no_groups": ["loss.base=sigmoid"],
    "image_text_infonce_no_groups": ["loss.base=infonce"],
    "image_text_triplet_hn_no_groups": ["loss.base=triplet_hn"],
}
B = 12


def run_case(name, local_loss, feats, rank=0, world=1):
    """(loss, feature grads [b, Σd], temperature grads) of one module on this process's share."""
    torch.manual_seed(0)
    # temperatures inside their ranges so their gradients are live
    temperature = ["loss.base.temperature={init: 0.05, min: 0.01, max: 0.1}"] if "loss.base=infonce" in MODULES[name] else []
    cfg = load_config(None, MODULES[name] + [f"loss.local_loss={local_loss}", *temperature])
    objective = build_objective(cfg.loss, rank, world).double()
    b = B // world
    mine = {k: v[rank * b:(rank + 1) * b].clone().requires_grad_(k != "group_ids") for k, v in feats.items()
            if not (k == "group_ids" and name.endswith("_no_groups"))}  # the square fast path
    out = objective(**mine)
    out["loss"].backward()  # what the data-parallel engine does on each rank
    grads = torch.cat([mine[k].grad for k in sorted(mine) if k != "group_ids" and mine[k].grad is not None], dim=1)
    temps = torch.cat([p.grad.reshape(-1) for p in objective.parameters()] or [torch.zeros(0, dtype=torch.float64)])
    return out["loss"].detach(), grads, temps


def _saved_for_backward(rank, world, b, d):
    """The largest tensor (elements) the sigmoid objective keeps for its backward, on this rank's
    share of the global batch, scoring its own rows (the ring) and every row (a gathered batch)."""
    largest = {}
    for local_loss in (True, False):
        objective = build_objective(load_config(None, ["loss.base=sigmoid", f"loss.local_loss={local_loss}"]).loss,
                                    rank, world)
        generator = torch.Generator().manual_seed(rank)
        feats = {k: torch.randn(b, d, generator=generator).requires_grad_() for k in ("image", "text")}
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            loss = objective(**feats, group_ids=torch.arange(rank * b, (rank + 1) * b) // 2)["loss"]
        loss.backward()  # the blocks recomputed, the gradients passed back around the ring
        largest[local_loss] = max(sizes)
    return largest


def _distributed_worker(rank, world, feats):
    results = {}
    for name in MODULES:
        for local_loss in (False, True):
            loss, grads, temps = run_case(name, local_loss, feats, rank, world)
            gathered = [[torch.zeros_like(t) for _ in range(world)] for t in (loss, grads, temps)]
            for bucket, t in zip(gathered, (loss, grads, temps)):
                dist.all_gather(bucket, t)
            # the engine averages losses (for logging) and gradients over ranks
            results[name, local_loss] = (torch.stack(gathered[0]).mean().numpy(), (torch.cat(gathered[1]) / world).numpy(),
                                         torch.stack(gathered[2]).mean(0).numpy())
    return results | {"saved for backward": _saved_for_backward(rank, world, 64, 16)}


@pytest.fixture(scope="module")
def distributed_results():
    feats = features(B, 80) | {"group_ids": GROUPS}
    return feats, on_gloo_ranks(_distributed_worker, feats)


@pytest.mark.parametrize("local_loss", [False, True])
@pytest.mark.parametrize("name", list(MODULES))
def test_two_processes_match_one_process(name, local_loss, distributed_results):
    """Float64, 2 gloo ranks with B/2 each vs 1 process with B: loss, feature and temperature grads."""
    feats, results = distributed_results
    loss, grads, temps = (torch.from_numpy(x) for x in results[0][name, local_loss])
    ref_loss, ref_grads, ref_temps = run_case(name, local_loss, feats)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-9)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(temps, ref_temps, rtol=1e-9, atol=1e-12)


def test_the_sigmoid_ring_keeps_no_similarity_block_for_the_backward(distributed_results):
    """2 gloo ranks, 64 rows each, 16-d features: the ring (``local_loss``) keeps nothing larger
    than one rank's features (64 × 16) for the backward — no 64 × 64 block of similarities, let
    alone 64 × 128 — while scoring every row of the gathered batch keeps the 128 × 128 matrix."""
    _, results = distributed_results
    for rank in (0, 1):
        largest = results[rank]["saved for backward"]
        assert largest[True] <= 64 * 16
        assert largest[False] >= 128 * 128
