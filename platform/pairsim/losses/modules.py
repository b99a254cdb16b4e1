"""Loss modules over model outputs: learnable temperatures, the global batch, composition.

An objective is a **base** pairwise loss (:class:`InfoNCE`, :class:`Unified`, :class:`TripletHN`,
:class:`Sigmoid`)
applied over a **similarity structure** (:class:`ImageTextLoss`: the B×B image↔text matrix;
:class:`GCLLoss`: the 3N×3N matrix over image, text and fused embeddings), plus optional
:class:`CUSALoss` soft-label terms: total = w·base + α·CSA + β·USA (:class:`Objective`; w = 1, or
1/(2B) under the CUSA authors' reduction).

Every module takes plain constructor arguments; the config's parts
(:mod:`pairsim.config.components`) are turned into them by :mod:`pairsim.build`.

Structures and CUSA are :class:`BatchLoss` modules: called with features they gather them once
(:mod:`pairsim.losses.distributed`), L2-normalise them in float32, and score rows against the
global batch; :class:`Objective` gathers once for all its terms. Group ids (the image id of
each pair) make pairs of one image positives of each other, never negatives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pairsim.losses import functional
from pairsim.losses.distributed import GlobalBatch, gather_batch
from pairsim.losses.temperature import Bounded, Temperature


# -------------------------------------------------------------------------------- base losses


class BaseLoss(nn.Module):
    """A pairwise loss over the rows of a similarity matrix (``loss.base``).

    Subclasses set ``rows(sim, targets, ignore)`` → per-row losses (see :mod:`pairsim.losses.functional`); ``anchors_only``: the loss needs one
    anchor positive per row (margin losses) rather than a target distribution over positives;
    ``directions``: 2, or 1 when the image rows alone give the image↔text loss.
    ``square(sim)``, the common case of one positive per row on the diagonal of a square matrix,
    both directions summed, defaults to ``rows`` over ``sim`` and ``sim.T``; a subclass may
    override it with a fused form that must equal that.
    """

    anchors_only = False
    directions = 2  # image→text and text→image rows summed; 1: the image rows count every pair once (sigmoid)

    def rows(self, sim: torch.Tensor, targets: torch.Tensor, ignore: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def square(self, sim: torch.Tensor) -> torch.Tensor:
        """The loss of a [B, B] matrix whose only positives are its diagonal, both directions summed."""
        return functional.rows_square(self.rows, sim)

    def forward(self, sim: torch.Tensor, positives: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of a whole [B, B] matrix, both directions summed (``positives``: [B, B] bool
        of pairs sharing an image; the diagonal always is one)."""
        return functional.both_directions(self.rows, sim, positives, self.anchors_only, self.square)

    def temperatures(self) -> dict[str, torch.Tensor]:
        """Its temperatures in use (clamped), by name, for logging; {} when it has none."""
        return {}

    def biases(self) -> dict[str, torch.Tensor]:
        """Its learned logit biases in use (clamped), by name, for logging; {} when it has none."""
        return {}


class InfoNCE(BaseLoss):
    """InfoNCE / CLIP contrastive loss with scale 1/τ (Radford et al. 2021).

    Per row: cross-entropy of softmax(sim/τ) against a target uniform over the row's positives.
    Default τ: learnable, init 0.05, clamped to [0.01, 0.1] (CUSA's base). Limits: τ → 0 weighs
    only the hardest negatives; multiple positives share the target mass.
    """

    anchors_only = False

    def __init__(self, temperature: Temperature | None = None):
        super().__init__()
        self.temperature = temperature or Temperature(0.05, 0.01, 0.1)

    def rows(self, sim, targets, ignore=None):
        return functional.infonce_rows(sim, 1.0 / self.temperature(), targets, ignore)

    def square(self, sim):
        return functional.infonce_square(sim, 1.0 / self.temperature())

    def temperatures(self) -> dict[str, torch.Tensor]:
        return {"base": self.temperature()}


class Unified(BaseLoss):
    """Unified loss of pair similarity optimisation (Li et al., arXiv 2209.13869), eq. (5).

    Per anchor: (1/γ) log(1 + Σ_negatives exp(γ(s_neg − s_pos + m))). Defaults m = 0.2, γ = 50
    (the paper's CLIP fine-tuning). Limits: m = 0 is InfoNCE with scale γ, divided by γ;
    γ → ∞ is :class:`TripletHN`. Finite in float32 up to γ = 1000.
    """

    anchors_only = True

    def __init__(self, margin: float = 0.2, gamma: float = 50.0):
        super().__init__()
        if gamma <= 0 or margin < 0:
            raise ValueError(f"Unified needs gamma > 0 and margin >= 0, got gamma={gamma}, margin={margin}")
        self.margin, self.gamma = margin, gamma

    def rows(self, sim, targets, ignore=None):
        return functional.unified_rows(sim, self.margin, self.gamma, targets, ignore)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, gamma={self.gamma}"


class TripletHN(BaseLoss):
    """Triplet loss with the hardest negative in the batch (VSE++, Faghri et al., BMVC 2018).

    Per anchor: [max_negatives s_neg − s_pos + m]_+. Default m = 0.2. It is the γ → ∞ limit of
    :class:`Unified`; only one negative per anchor gets gradient.
    """

    anchors_only = True

    def __init__(self, margin: float = 0.2):
        super().__init__()
        if margin < 0:
            raise ValueError(f"TripletHN needs margin >= 0, got {margin}")
        self.margin = margin

    def rows(self, sim, targets, ignore=None):
        return functional.triplet_hn_rows(sim, self.margin, targets, ignore)

    def square(self, sim):
        return functional.triplet_hn_square(sim, self.margin)

    def extra_repr(self) -> str:
        return f"margin={self.margin}"


# ----------------------------------------------------------------------- losses over a batch


class Sigmoid(BaseLoss):
    """SigLIP's sigmoid pairwise loss (Zhai et al., ICCV 2023, arXiv 2303.15343).

    Every pair is an independent binary decision: Σ_pairs −log σ(z (t·s + b)), z = +1 for a
    positive pair and −1 otherwise, divided by the rows (the batch size). Learnable scale t = 1/τ
    and bias b; defaults the paper's inits, t = 10 (τ 0.1, kept in [0.01, 1]) and b = −10 (kept
    in [−100, 100]). Limits: no softmax couples a row's pairs, so several positives per row
    need no shared target mass; the bias sets how negative-heavy the batch may be. Distributed
    under :class:`ImageTextLoss` with ``local_loss``: the ring (O(B_local²) memory a worker).
    """

    directions = 1

    def __init__(self, temperature: Temperature | None = None, bias: Bounded | None = None):
        super().__init__()
        self.temperature = temperature or Temperature(0.1, 0.01, 1.0)
        self.bias = bias or Bounded(-10.0, -100.0, 100.0)

    def rows(self, sim, targets, ignore=None):
        return functional.sigmoid_rows(sim, 1.0 / self.temperature(), self.bias(), targets, ignore)

    def square(self, sim):
        return self(sim)  # one positive per row, on the diagonal

    def forward(self, sim: torch.Tensor, positives: torch.Tensor | None = None) -> torch.Tensor:
        return functional.sigmoid_loss(sim, 1.0 / self.temperature(), self.bias(), positives)

    def temperatures(self) -> dict[str, torch.Tensor]:
        return {"base": self.temperature()}

    def biases(self) -> dict[str, torch.Tensor]:
        return {"base": self.bias()}


class BatchLoss(nn.Module):
    """A loss over the global batch of all workers.

    Args:
        local_loss: score only this worker's rows against the global batch (O(B_local × B)).
        rank, world_size: this worker's place in the default process group.
    """

    def __init__(self, *, local_loss: bool = False, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.local_loss, self.rank, self.world_size = local_loss, rank, world_size

    def gather(self, features: dict[str, torch.Tensor | None]) -> GlobalBatch:
        """Normalise (float32, L2) and gather every feature once; integer ids pass unchanged."""
        prepared = {k: F.normalize(functional.fp32(v), dim=-1) if v is not None and v.is_floating_point() else v
                    for k, v in features.items()}
        return gather_batch(prepared, local_loss=self.local_loss, rank=self.rank, world_size=self.world_size)

    def forward(self, **features: torch.Tensor | None):
        return self.loss(self.gather(features))

    def loss(self, batch: GlobalBatch):
        raise NotImplementedError

    def temperatures(self) -> dict[str, torch.Tensor]:
        """Its temperatures in use (clamped), by name, for logging; {} when it has none."""
        return {}


def _group_positives(batch: GlobalBatch) -> torch.Tensor | None:
    groups = batch.get("group_ids")
    return None if groups is None else batch.rows("group_ids")[:, None] == groups[None, :]


class Structure(BatchLoss):
    """A base loss applied over a similarity structure of the global batch (``loss.structure``).

    ``inputs``: the model outputs it scores.
    """

    inputs: tuple[str, ...] = ("image", "text")

    def __init__(self, base: BaseLoss, **kwargs):
        super().__init__(**kwargs)
        self.base = base

    def temperatures(self) -> dict[str, torch.Tensor]:
        return self.base.temperatures()

    def biases(self) -> dict[str, torch.Tensor]:
        return self.base.biases()


class ImageTextLoss(Structure):
    """A base loss over the image↔text similarity matrix, both directions summed (the image
    rows alone for a base loss of one direction, :attr:`BaseLoss.directions`).

    Inputs: ``image``, ``text`` [B, d] and optional ``group_ids`` [B] (pairs with equal ids
    are positives of each other). Row i's anchor is column i of the global batch. When every
    row is scored and no two pairs share an image, both directions come from the one image→text
    matrix (:meth:`BaseLoss.square`): one matrix product, as open_clip's ``ClipLoss`` over a gathered batch.
    A one-direction base loss with ``local_loss`` on several workers scores its rows against
    one worker's texts at a time, passed around the ring (:meth:`GlobalBatch.ring`), each
    B_local² block recomputed in the backward rather than kept: peak memory O(B_local²), not
    O(B_local × B).
    """

    def loss(self, batch: GlobalBatch) -> torch.Tensor:
        if self.base.directions == 1 and batch.local_loss and batch.world_size > 1:
            return self.ring_loss(batch)
        rows, columns = batch.rows("image").shape[0], batch.size
        anchors = torch.arange(batch.first_row, batch.first_row + rows, device=batch.local["image"].device)
        targets, ignore = functional.split_positives(anchors, _group_positives(batch), self.base.anchors_only)
        if rows == columns and functional.one_target_per_row(targets, ignore):
            return self.base.square(batch.similarity("image", "text"))
        i2t = self.base.rows(batch.similarity("image", "text"), targets, ignore)
        if self.base.directions == 1:
            return i2t.mean()
        t2i = self.base.rows(batch.similarity("text", "image"), targets, ignore)
        return i2t.mean() + t2i.mean()

    def ring_loss(self, batch: GlobalBatch) -> torch.Tensor:
        """The image rows' loss summed over the ring's blocks of texts, divided by the rows."""
        image, groups = batch.local["image"], batch.local.get("group_ids")
        total = image.new_zeros(())
        for first, block in batch.ring("text", "group_ids"):
            total = total + checkpoint(self._block_loss, image, block["text"], batch.first_row - first, groups,
                                       block.get("group_ids"), use_reentrant=False)
        return total / batch.local_size

    def _block_loss(self, image: torch.Tensor, text: torch.Tensor, offset: int, groups: torch.Tensor | None,
                    block_groups: torch.Tensor | None) -> torch.Tensor:
        """Σ of the base's row losses of ``image`` against one block of texts; row i's own text is
        the block's column i + ``offset`` (if it holds it), further positives share a group id."""
        targets = (torch.arange(image.shape[0], device=image.device)[:, None] + offset
                   == torch.arange(text.shape[0], device=image.device)[None, :])
        if groups is not None:
            targets = targets | (groups[:, None] == block_groups[None, :])
        return self.base.rows(image @ text.T, targets).sum()


class GCLLoss(Structure):
    """Generalized Contrastive Learning (Lee et al., NeurIPS 2025, arXiv 2509.25638).

    The base loss over the 3N×3N similarity matrix of image, text and fused embeddings: each
    query's positives are the same pair's other two embeddings, every other key of the batch
    is a negative; the query itself (``mask_self``) and other pairs of the same group are left
    out. With :class:`InfoNCE` this is :func:`~pairsim.losses.functional.gcl_loss`; with
    :class:`Unified` the margin and γ apply to the same matrix. Inputs: ``image``, ``text``,
    ``fused`` [B, d], optional ``group_ids``. Costs 9× the logits of :class:`ImageTextLoss`.
    """

    MODALITIES = inputs = ("image", "text", "fused")

    def __init__(self, base: BaseLoss, mask_self: bool = True, **kwargs):
        super().__init__(base, **kwargs)
        self.mask_self = mask_self

    def loss(self, batch: GlobalBatch) -> torch.Tensor:
        names = [m for m in self.MODALITIES if m in batch.columns]
        keys = torch.cat([batch.columns[m] for m in names])
        queries = torch.cat([batch.rows(m) for m in names])
        n_keys, n_rows = batch.columns["image"].shape[0], batch.rows("image").shape[0]
        key_pairs, key_modality = functional.gcl_layout(n_keys, len(names), keys.device)
        row_pairs, row_modality = functional.gcl_layout(n_rows, len(names), keys.device)
        groups = batch.get("group_ids")
        row_groups = None if groups is None else batch.rows("group_ids").repeat(len(names))
        key_groups = None if groups is None else groups.repeat(len(names))
        targets, ignore = functional.gcl_masks(row_pairs + batch.first_row, row_modality, row_groups,
                                               key_pairs, key_modality, key_groups, self.mask_self)
        return self.base.rows(queries @ keys.T, targets, ignore).mean()


class CUSALoss(BatchLoss):
    """CUSA soft-label terms (Huang et al., AAAI 2024, arXiv 2403.05261); returns (CSA, USA).

    Teacher similarities u_ij = cos(teacher_i, teacher_j) give soft labels Q = softmax(u/τ_T).
    CSA aligns the cross-modal similarities (``image``, ``text``) with them at τ_c; USA aligns
    the uni-modal heads' similarities (``image_unimodal``, ``text_unimodal``) at τ_img, τ_txt.
    Inputs also ``teacher_image``, ``teacher_text`` [B, d_teacher]. Defaults are the authors'
    code: τ_c, τ_img, τ_txt learnable, init 0.45, in [0.1, 0.99] (τ_c) and [0.1, 1.0]; τ_T = 1 fixed.
    """

    def __init__(self, cross_temperature: Temperature | None = None, image_temperature: Temperature | None = None,
                 text_temperature: Temperature | None = None, teacher_temperature: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.cross_temperature = cross_temperature or Temperature(0.45, 0.1, 0.99)
        self.image_temperature = image_temperature or Temperature(0.45, 0.1, 1.0)
        self.text_temperature = text_temperature or Temperature(0.45, 0.1, 1.0)
        self.teacher_temperature = teacher_temperature

    def temperatures(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"{name}_temperature")() for name in ("cross", "image", "text")}

    def loss(self, batch: GlobalBatch) -> tuple[torch.Tensor, torch.Tensor]:
        sim, kl = batch.similarity, functional.kl_rows
        teacher_image = functional.soft_labels(sim("teacher_image", "teacher_image"), self.teacher_temperature)
        teacher_text = functional.soft_labels(sim("teacher_text", "teacher_text"), self.teacher_temperature)
        cross, image, text = 1.0 / self.cross_temperature(), 1.0 / self.image_temperature(), 1.0 / self.text_temperature()
        csa = 0.5 * (kl(teacher_image, sim("image", "text") * cross).mean()
                     + kl(teacher_text, sim("text", "image") * cross).mean())
        usa = 0.5 * (kl(teacher_image, sim("image_unimodal", "image_unimodal") * image).mean()
                     + kl(teacher_text, sim("text_unimodal", "text_unimodal") * text).mean())
        return csa, usa


class Objective(BatchLoss):
    """w·base + α·CSA + β·USA over one gather of the model's outputs.

    ``reduction`` sets the base's weight w: ``pairsim`` 1; ``paper`` 1/(2B) with B the global
    batch, the CUSA authors' code (its base cross-entropy is a mean over the B columns of a row,
    the two directions averaged), under which the paper's α, β hold (see
    :class:`~pairsim.config.CUSAConfig`).

    ``forward(image, text, fused=None, image_unimodal=None, text_unimodal=None, group_ids=None,
    teacher_image=None, teacher_text=None)`` returns a dict: ``loss`` (the total, to backprop),
    ``loss/base`` (w·base, as it enters the total), ``loss/csa``, ``loss/usa`` and each temperature
    (``temperature/...``), the parts detached. It does not check them: a training step stops on a
    non-finite term (:class:`pairsim.train.accumulation.TermsOnHost`) without making the host wait
    on the device.
    """

    REDUCTIONS = ("pairsim", "paper")

    def __init__(self, structure: Structure, cusa: CUSALoss | None = None,
                 alpha: float = 0.1, beta: float = 0.5, reduction: str = "pairsim", **kwargs):
        super().__init__(**kwargs)
        if reduction not in self.REDUCTIONS:
            raise ValueError(f"reduction must be one of {self.REDUCTIONS}, got {reduction!r}")
        self.structure, self.cusa, self.alpha, self.beta, self.reduction = structure, cusa, alpha, beta, reduction

    @property
    def needs(self) -> set[str]:
        """Model outputs and batch fields this objective reads."""
        needed = set(self.structure.inputs)
        if self.cusa is not None:
            needed |= {"image_unimodal", "text_unimodal", "teacher_image", "teacher_text"}
        return needed

    def forward(self, **features: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return self.loss(self.gather({k: v for k, v in features.items() if k in self.needs | {"group_ids"}}))

    def loss(self, batch: GlobalBatch) -> dict[str, torch.Tensor]:
        base = self.structure.loss(batch)
        if self.reduction == "paper":
            base = base / (2 * batch.size)
        terms = {"loss/base": base}
        total = base
        if self.cusa is not None:
            csa, usa = self.cusa.loss(batch)
            terms |= {"loss/csa": csa, "loss/usa": usa}
            total = base + self.alpha * csa + self.beta * usa
        return {"loss": total} | {k: v.detach() for k, v in terms.items()} | self.temperatures() | {
            f"bias/{k}": v.detach() for k, v in self.structure.biases().items()}

    def temperatures(self) -> dict[str, torch.Tensor]:
        """The clamped temperatures in use, detached, for logging."""
        temps = dict(self.structure.temperatures())
        if self.cusa is not None:
            temps |= self.cusa.temperatures()
        return {f"temperature/{k}": v.detach() for k, v in temps.items()}
