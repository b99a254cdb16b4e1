"""Pair-similarity losses as functions of similarity matrices.

Conventions (all functions): ``sim[i, j]`` is the cosine similarity of image i and text j,
[B, B]. ``positives`` is an optional bool [B, B] marking pairs that share an image id; the
diagonal is always a positive and off-diagonal positives are never counted as negatives.
Results are means over anchors with both retrieval directions summed. Inputs of any float
dtype are computed in float32 at least (float64 stays float64).

Every loss is built on a *row* function over a similarity block ``sim`` [R, C] with
``targets`` (each row's positives: a bool mask [R, C], or one column index per row [R]) and
``ignore`` (an optional bool mask [R, C] of keys that are neither positives nor negatives,
left out of every sum). Rows are what the distributed
modules compute when each worker scores only its own rows (``local_loss``).

The common case, a square matrix whose only positives are its diagonal (no two pairs of one
image in the batch, every row scored), has a *square* function per loss: both directions from
the one matrix (no second matrix product), targets and hardest negatives picked by index
rather than through B×B masks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 when it is float64 (bf16/fp16 are promoted)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _lowest(x: torch.Tensor) -> float:
    return torch.finfo(x.dtype).min


def _masked_(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` with masked entries set, in place, to the dtype's lowest finite value: they vanish
    from softmaxes and maxima, and an all-masked row stays finite (so do its gradients) rather
    than NaN. Only for a fresh ``x`` that autograd has not saved."""
    return x if mask is None else x.masked_fill_(mask, _lowest(x))


def _exclude_(x: torch.Tensor, targets: torch.Tensor, ignore: torch.Tensor | None) -> torch.Tensor:
    """:func:`_masked_` of the targets and the ignored keys: what is left are the negatives."""
    if targets.dtype == torch.bool:
        x.masked_fill_(targets, _lowest(x))
    else:
        x.scatter_(1, targets[:, None], _lowest(x))
    return _masked_(x, ignore)


def _at_targets(x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` at every target [K], the row of each [K]). ``targets`` is a bool mask [R, C] or,
    for one target per row, its column index [R] (a gather: no mask, no scan)."""
    if targets.dtype == torch.bool:
        return x[targets], targets.nonzero(as_tuple=True)[0]
    return x.gather(1, targets[:, None]).squeeze(1), torch.arange(x.shape[0], device=x.device)


def _mean_per_row(values: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row mean of ``values`` [K] over each row's targets; [R]."""
    if targets.dtype != torch.bool:
        return values
    sums = torch.zeros(targets.shape[0], dtype=values.dtype, device=values.device).index_add(0, rows, values)
    return sums / targets.sum(1).clamp(min=1)


def split_positives(anchors: torch.Tensor, positives: torch.Tensor | None, anchors_only: bool):
    """(targets, ignore) for rows whose own pair sits in column ``anchors`` [R] and whose further
    positives (pairs sharing an image id) are marked in ``positives`` [R, C].

    ``anchors_only`` (margin losses): the anchors are the targets and further positives are
    ignored. Otherwise (InfoNCE) every positive is a target.
    """
    if positives is None:
        return anchors, None
    anchor_mask = torch.zeros_like(positives).scatter_(1, anchors[:, None], True)
    further = positives & ~anchor_mask
    if not further.any():  # no two pairs of one image in this batch: the one-target fast path
        return anchors, None
    return (anchors, further) if anchors_only else (positives | anchor_mask, None)


# ---------------------------------------------------------------------------------------- rows


def infonce_rows(sim: torch.Tensor, scale: torch.Tensor | float, targets: torch.Tensor,
                 ignore: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row cross-entropy of ``softmax(scale · sim[r, ~ignore])`` against a target uniform
    over the row's ``targets``: −mean_{t ∈ T(r)} log softmax(scale · sim[r])_t. Returns [R]."""
    sim = fp32(sim)
    if targets.dtype != torch.bool:  # one target per row: the fused cross-entropy kernel
        return F.cross_entropy(_masked_(sim * scale, ignore), targets, reduction="none")
    log_p = F.log_softmax(_masked_(sim * scale, ignore), dim=1)
    values, rows = _at_targets(log_p, targets)
    return _mean_per_row(-values, rows, targets)


def unified_rows(sim: torch.Tensor, margin: float, gamma: float, targets: torch.Tensor,
                 ignore: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row Unified loss, each target an anchor: mean over t ∈ T(r) of

        (1/γ) log(1 + Σ_{k ∈ N(r)} exp(γ(s_rk − s_rt + m))),   N(r) = not target, not ignored.

    Computed as softplus(logsumexp_k γ(s_rk + m) − γ s_rt) / γ — a logsumexp with a zero term —
    so loss and gradient stay finite in float32 up to γ = 1000 and beyond. With one target per
    row this equals −log_softmax(z)_t / γ for z = γ(s_r + m) with z_t = γ s_rt, which runs as
    the fused cross-entropy kernel. Returns [R].
    """
    sim = fp32(sim)
    if targets.dtype != torch.bool:
        logits = (sim + margin).mul_(gamma)
        logits.scatter_add_(1, targets[:, None], logits.new_full((targets.shape[0], 1), -gamma * margin))
        return F.cross_entropy(_masked_(logits, ignore), targets, reduction="none") / gamma
    # one [R, C] temporary: (s + m) · γ and the masks are applied in place
    lse = torch.logsumexp(_exclude_((sim + margin).mul_(gamma), targets, ignore), dim=1)  # [R]
    positive, rows = _at_targets(sim, targets)
    terms = F.softplus(lse[rows] - gamma * positive, beta=1.0, threshold=20.0) / gamma
    return _mean_per_row(terms, rows, targets)


def triplet_hn_rows(sim: torch.Tensor, margin: float, targets: torch.Tensor,
                    ignore: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row hardest-negative triplet loss (VSE++), each target an anchor: mean over t ∈ T(r)
    of [max_{k ∈ N(r)} s_rk − s_rt + m]_+. Returns [R]."""
    sim = fp32(sim)
    hardest = _exclude_(sim.clone(), targets, ignore).max(dim=1).values  # [R]
    positive, rows = _at_targets(sim, targets)
    return _mean_per_row((hardest[rows] - positive + margin).clamp(min=0), rows, targets)


def sigmoid_rows(sim: torch.Tensor, scale: torch.Tensor | float, bias: torch.Tensor | float, targets: torch.Tensor,
                 ignore: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row SigLIP loss, every pair of the row an independent binary decision:

        Σ_{c ∉ ignore} −log σ(z_rc l_rc),   l = scale · s + bias,   z_rc = +1 for c ∈ T(r), −1 otherwise,

    computed as Σ_c softplus(l_rc) − Σ_{c ∈ T(r)} l_rc (−log σ(−l) = softplus(l), −log σ(l) =
    softplus(l) − l): no matrix of signs. ``targets``: a column index per row, or a boolean mask.
    A sum over the row, not a mean: the loss of a matrix is the sum over its pairs divided by its
    rows (:func:`sigmoid_loss`). Returns [R]."""
    logits = fp32(sim) * scale + bias
    negative = F.softplus(logits, threshold=40.0)  # linear past 40, where e^−l is below float64's precision
    if ignore is not None:
        negative = negative.masked_fill(ignore, 0.0)
    if targets.dtype == torch.bool:
        return negative.sum(1) - logits.masked_fill(~targets, 0.0).sum(1)
    return negative.sum(1) - logits.gather(1, targets[:, None])[:, 0]


# -------------------------------------------------------------- square, one positive per row


def infonce_square(sim: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """:func:`infonce_loss` of a square ``sim`` [B, B] whose only positives are its diagonal:
    CLIP's loss (both directions summed) with logits z = scale · sim,

        mean_i −log softmax_j(z_ij)_i + mean_j −log softmax_i(z_ij)_j,

    open_clip's two fused cross-entropies over z and zᵀ (a softmax along the columns of z in
    place runs several times slower on CUDA than over a transposed copy)."""
    logits = fp32(sim) * scale
    labels = torch.arange(logits.shape[0], device=logits.device)
    return F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)


def _hardest_off_diagonal(sim: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of the largest off-diagonal entry of each row, and row of that of each column,
    of a square ``sim``; [B] each, without gradient. Both are row-wise argmaxes of a masked
    copy, the columns' of its transposed copy: an argmax over dim 0 holds 8 B×B on CUDA."""
    with torch.no_grad():
        negatives = sim.clone()
        negatives.diagonal().fill_(_lowest(negatives))
        return negatives.argmax(dim=1), negatives.T.contiguous().argmax(dim=1)


def triplet_hn_square(sim: torch.Tensor, margin: float) -> torch.Tensor:
    """:func:`triplet_hn_loss` of a square ``sim`` [B, B] whose only positives are its diagonal:

        mean_i [max_{j≠i} s_ij − s_ii + m]_+ + [max_{j≠i} s_ji − s_ii + m]_+

    The anchors s_ii and both hardest negatives are read with one index into ``sim`` (3B
    entries), so the backward writes 3B entries of one zero gradient. One pair has no negative:
    a zero loss."""
    sim = fp32(sim)
    b = sim.shape[0]
    if b < 2:
        return sim.sum() * 0.0
    i = torch.arange(b, device=sim.device)
    in_row, in_column = _hardest_off_diagonal(sim)
    positive, i2t, t2i = sim.take(torch.stack([i * (b + 1), i * b + in_row, in_column * b + i]))  # [B] each
    return ((i2t - positive + margin).clamp(min=0) + (t2i - positive + margin).clamp(min=0)).mean()


def rows_square(rows_fn, sim: torch.Tensor) -> torch.Tensor:
    """The square form of any row loss: mean of ``rows_fn(sim, anchors, None)`` plus the same over
    ``sim.T``, each row's one target on the diagonal (what losses without a fused one use)."""
    anchors = torch.arange(sim.shape[0], device=sim.device)
    return rows_fn(sim, anchors, None).mean() + rows_fn(sim.T, anchors, None).mean()


class SoftLabels(NamedTuple):
    """A teacher's soft labels Q (rows sum to 1) and Σ_j Q_j log Q_j per row, without gradient."""

    probs: torch.Tensor
    plogp: torch.Tensor


def soft_labels(teacher_sim: torch.Tensor, teacher_temperature: float = 1.0) -> SoftLabels:
    """CUSA's soft labels: Q = softmax_j(u_ij / τ_T), computed once per step for every term."""
    with torch.no_grad():
        log_q = F.log_softmax(fp32(teacher_sim) / teacher_temperature, dim=1)
        probs = log_q.exp()
        return SoftLabels(probs, (probs * log_q).sum(1))


def kl_rows(teacher: SoftLabels, student_logits: torch.Tensor) -> torch.Tensor:
    """Per-row KL(Q ‖ softmax(student)) = Σ_j Q_j log Q_j − Σ_j Q_j log P_j; the second term is
    a soft-target cross-entropy (one fused kernel). Returns [R]."""
    return F.cross_entropy(fp32(student_logits), teacher.probs, reduction="none") + teacher.plogp


# ------------------------------------------------------------------------------- image ↔ text


def one_target_per_row(targets: torch.Tensor, ignore: torch.Tensor | None) -> bool:
    """Whether :func:`split_positives` found only the anchors: one target per row, nothing ignored."""
    return targets.dtype != torch.bool and ignore is None


def both_directions(rows_fn, sim: torch.Tensor, positives: torch.Tensor | None, anchors_only: bool,
                    square_fn=None) -> torch.Tensor:
    """mean over rows of ``rows_fn(sim, targets, ignore)`` plus the same over ``sim.T`` (text→image),
    each row's anchor on the diagonal and further ``positives`` split as :func:`split_positives` does.
    Without further positives: ``square_fn(sim)``, both directions at once (default :func:`rows_square`)."""
    anchors = torch.arange(sim.shape[0], device=sim.device)
    i2t = split_positives(anchors, positives, anchors_only)
    if one_target_per_row(*i2t):
        return square_fn(sim) if square_fn is not None else rows_square(rows_fn, sim)
    t2i = split_positives(anchors, positives.T, anchors_only)
    return rows_fn(sim, *i2t).mean() + rows_fn(sim.T, *t2i).mean()


def infonce_loss(sim: torch.Tensor, scale: torch.Tensor | float,
                 positives: torch.Tensor | None = None) -> torch.Tensor:
    """InfoNCE / CLIP's contrastive loss (Radford et al. 2021; van den Oord et al. 2018).

    Σ over both directions of mean_i CE(softmax(scale · sim[i, :]), uniform over P(i)), where
    P(i) = {j : positives[i, j]} ∪ {i}. Without positives this is CLIP's loss with logit scale
    ``scale`` (= 1/τ), summed rather than averaged over the two directions.
    """
    return both_directions(lambda s, t, ig: infonce_rows(s, scale, t, ig), sim, positives, anchors_only=False,
                           square_fn=lambda s: infonce_square(s, scale))


def unified_loss(sim: torch.Tensor, margin: float, gamma: float,
                 positives: torch.Tensor | None = None) -> torch.Tensor:
    """Unified loss of pair similarity optimisation (Li et al., arXiv 2209.13869), eq. (5):

    (1/B) Σ_i (1/γ)[ log(1 + Σ_{j∉P(i)} e^{γ(s_ij − s_ii + m)}) + log(1 + Σ_{j∉P'(i)} e^{γ(s_ji − s_ii + m)}) ]

    with P(i) = {j : positives[i, j]}, P'(i) = {j : positives[j, i]}. m = 0 gives InfoNCE with
    scale γ divided by γ; γ → ∞ gives :func:`triplet_hn_loss`. Finite in float32 up to γ = 1000.
    """
    return both_directions(lambda s, t, ig: unified_rows(s, margin, gamma, t, ig), sim, positives,
                            anchors_only=True)


def triplet_hn_loss(sim: torch.Tensor, margin: float, positives: torch.Tensor | None = None) -> torch.Tensor:
    """Triplet loss with the hardest negative (VSE++, Faghri et al. 2018):

    (1/B) Σ_i [max_{j∉P(i)} s_ij − s_ii + m]_+ + [max_{j∉P'(i)} s_ji − s_ii + m]_+
    """
    return both_directions(lambda s, t, ig: triplet_hn_rows(s, margin, t, ig), sim, positives, anchors_only=True,
                           square_fn=lambda s: triplet_hn_square(s, margin))


def sigmoid_loss(sim: torch.Tensor, scale: torch.Tensor | float, bias: torch.Tensor | float,
                 positives: torch.Tensor | None = None) -> torch.Tensor:
    """SigLIP's sigmoid loss (Zhai et al., ICCV 2023, arXiv 2303.15343) of an image×text ``sim``
    [B, B]: −(1/B) Σ_i Σ_j log σ(z_ij (scale · s_ij + bias)), z_ij = +1 for a positive pair
    (the diagonal, and ``positives``: pairs sharing an image), −1 otherwise. Every pair counts
    once: there are no two directions to sum."""
    targets = torch.arange(sim.shape[0], device=sim.device)
    if positives is not None:
        targets = positives | torch.eye(sim.shape[0], sim.shape[1], dtype=torch.bool, device=sim.device)
    return sigmoid_rows(sim, scale, bias, targets).mean()


# ---------------------------------------------------------------------------------------- GCL


def gcl_masks(pair_ids: torch.Tensor, modality: torch.Tensor, group_ids: torch.Tensor | None,
              key_pair_ids: torch.Tensor, key_modality: torch.Tensor, key_group_ids: torch.Tensor | None,
              mask_self: bool):
    """(targets, ignore) for GCL query rows against keys, given each side's pair index,
    modality index (0 image, 1 text, 2 fused) and optional group id.

    Targets: the same pair's embeddings of the other modalities. Ignored: the query itself
    (``mask_self``) and every key of another pair with the same group id.
    """
    same_pair = pair_ids[:, None] == key_pair_ids[None, :]
    same_modality = modality[:, None] == key_modality[None, :]
    targets = same_pair & ~same_modality
    ignore = same_pair & same_modality if mask_self else torch.zeros_like(same_pair)
    if group_ids is not None:
        ignore |= (group_ids[:, None] == key_group_ids[None, :]) & ~same_pair
    return targets, ignore


def gcl_layout(n: int, modalities: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair index and modality index of the stacked embeddings [image; text; (fused)], [M·n] each."""
    pair_ids = torch.arange(n, device=device).repeat(modalities)
    modality = torch.arange(modalities, device=device).repeat_interleave(n)
    return pair_ids, modality


def gcl_loss(image: torch.Tensor, text: torch.Tensor, fused: torch.Tensor | None, temperature: torch.Tensor | float,
             group_ids: torch.Tensor | None = None, mask_self: bool = True) -> torch.Tensor:
    """Generalized Contrastive Learning (Lee et al., NeurIPS 2025, arXiv 2509.25638).

    −1/(6N) Σ_j Σ_{a ≠ b ∈ {i, t, it}} log[ exp(cos(e_a^j, e_b^j)/τ) / Σ_{keys} exp(cos(e_a^j, key)/τ) ]

    over all 3N keys of the batch, leaving out the query itself when ``mask_self`` and always
    the keys of another pair with the same group id. Embeddings [N, d] are L2-normalised here.
    With ``fused=None`` it is the two-modality form (2N keys, 2N terms).
    """
    parts = [image, text] + ([fused] if fused is not None else [])
    emb = F.normalize(fp32(torch.cat(parts)), dim=-1)
    pair_ids, modality = gcl_layout(image.shape[0], len(parts), emb.device)
    groups = None if group_ids is None else group_ids.repeat(len(parts))
    targets, ignore = gcl_masks(pair_ids, modality, groups, pair_ids, modality, groups, mask_self)
    return infonce_rows(emb @ emb.T, 1.0 / temperature, targets, ignore).mean()


# --------------------------------------------------------------------------------------- CUSA


def csa_loss(sim_i2t: torch.Tensor, teacher_image_sim: torch.Tensor, teacher_text_sim: torch.Tensor,
             temperature: torch.Tensor | float, teacher_temperature: float = 1.0) -> torch.Tensor:
    """Cross-modal soft-label alignment of CUSA (Huang et al., AAAI 2024, arXiv 2403.05261):

    ½[ KL(Q_img ‖ softmax_j(sim_i2t[i, j]/τ)) + KL(Q_txt ‖ softmax_j(sim_i2tᵀ[i, j]/τ)) ]

    Q = row softmax of the teacher similarity / ``teacher_temperature``; KL(teacher ‖ student)
    averaged over rows ("batchmean").
    """
    i2t = kl_rows(soft_labels(teacher_image_sim, teacher_temperature), sim_i2t * (1.0 / temperature)).mean()
    t2i = kl_rows(soft_labels(teacher_text_sim, teacher_temperature), sim_i2t.T * (1.0 / temperature)).mean()
    return 0.5 * (i2t + t2i)


def usa_loss(sim_image_image: torch.Tensor, sim_text_text: torch.Tensor, teacher_image_sim: torch.Tensor,
             teacher_text_sim: torch.Tensor, image_temperature: torch.Tensor | float,
             text_temperature: torch.Tensor | float, teacher_temperature: float = 1.0) -> torch.Tensor:
    """Uni-modal soft-label alignment of CUSA (Huang et al., AAAI 2024, arXiv 2403.05261):

    ½[ KL(Q_img ‖ softmax(sim_image_image/τ_i)) + KL(Q_txt ‖ softmax(sim_text_text/τ_t)) ]

    with the conventions of :func:`csa_loss`; the student similarities come from uni-modal heads.
    """
    image = kl_rows(soft_labels(teacher_image_sim, teacher_temperature), sim_image_image * (1.0 / image_temperature))
    text = kl_rows(soft_labels(teacher_text_sim, teacher_temperature), sim_text_text * (1.0 / text_temperature))
    return 0.5 * (image.mean() + text.mean())
