"""The retrieval model pairsim trains: an open_clip model with its fusion module and optional
heads (:class:`RetrievalModel`), and its export format — open_clip weights, a heads side file
and a model card holding their checksums.

An export's three files are one unit: their places are checked together before any work
(:func:`claim_export`) — each absent, or the set there an earlier export pairsim wrote, which is
replaced whole — then each file is written under a temporary name and renamed into place, the
card last, and a heads file the new export lacks is removed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from pairsim import outputs, untrusted
from pairsim.config import FUSIONS, ModelConfig
from pairsim.models import clip, fusion, saved
from pairsim.models.saved import ExportChecksums, ModelCard, UnsafeCheckpointError


def projection_head(dim: int) -> torch.nn.Sequential:
    """LayerNorm + Linear(d, d), the linear weights drawn from N(0, 0.02²): CUSA's per-tower head
    as its authors' code initialises it."""
    linear = torch.nn.Linear(dim, dim)
    torch.nn.init.normal_(linear.weight, std=0.02)
    return torch.nn.Sequential(torch.nn.LayerNorm(dim), linear)


class RetrievalModel(torch.nn.Module):
    """An open_clip model plus the pieces pairsim's objectives read.

    ``forward(image=None, text=None)`` returns a dict with ``image`` and ``text`` — the
    cross-modal outputs **before** L2 normalisation: each tower's un-normalised output
    (``encode_image`` / ``encode_text``), or the cross-modal heads applied to its normalised
    output when the model has heads — ``fused`` (when both are given and the model has a fusion
    module: only GCL reads it; the fusion sees those un-normalised outputs) and
    ``image_unimodal`` / ``text_unimodal`` (the uni-modal heads on the normalised tower outputs,
    when they exist). The losses and the evaluation L2-normalise what they score. open_clip's own
    ``logit_scale`` is frozen: the losses own their temperatures and scales.

    The towers run through ``encode_*``, not the CLIP module's forward (which normalises), so
    under DeepSpeed ZeRO-3 the parameters the CLIP module holds directly (positional embedding,
    text projection) are read outside their module's forward: DeepSpeed's parameter getter
    gathers them and registers them as external parameters of the running module on first
    access (``deepspeed.zero.register_external_parameter`` done for us; checked on two ranks
    against one process by ``tests/test_models.py``).
    """

    def __init__(self, open_clip_model: torch.nn.Module, dim: int, fusion: str | None = None,
                 crossmodal_heads: bool = False, unimodal_heads: bool = False):
        super().__init__()
        self.clip = open_clip_model
        for name in clip.SCALAR_PARAMS:
            if isinstance(getattr(open_clip_model, name, None), torch.nn.Parameter):
                getattr(open_clip_model, name).requires_grad_(False)
        self.fusion = fusion_by_name(fusion) if fusion else None
        self.cross_heads = torch.nn.ModuleDict(
            {"image": projection_head(dim), "text": projection_head(dim)}) if crossmodal_heads else None
        self.unimodal_heads = torch.nn.ModuleDict(
            {"image": projection_head(dim), "text": projection_head(dim)}) if unimodal_heads else None

    def forward(self, image: torch.Tensor | None = None, text: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = {}
        for modality, inputs, encode in (("image", image, self.clip.encode_image), ("text", text, self.clip.encode_text)):
            if inputs is None:
                continue
            features = encode(inputs)
            normalized = F.normalize(features, dim=-1)
            out[modality] = self.cross_heads[modality](normalized) if self.cross_heads is not None else features
            if self.unimodal_heads is not None:
                out[f"{modality}_unimodal"] = self.unimodal_heads[modality](normalized)
        if self.fusion is not None and image is not None and text is not None:
            out["fused"] = self.fusion(out["image"], out["text"])
        return out


def create_retrieval_model(cfg: ModelConfig, fused: bool = False, unimodal_heads: bool = False) -> RetrievalModel:
    """The configured open_clip model with its heads, and ``cfg.fusion`` when the objective reads
    fused embeddings (GCL) and uni-modal heads when it reads those (CUSA)."""
    dim = clip.embed_dim(cfg.arch)
    return RetrievalModel(clip.create_model(cfg), dim, cfg.fusion if fused else None, cfg.crossmodal_heads, unimodal_heads)


def open_clip_state(state_dict: dict[str, torch.Tensor], prefix: str = "clip.") -> dict[str, torch.Tensor]:
    """The open_clip part of a :class:`RetrievalModel` state dict, with open_clip's own key names."""
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def model_card(cfg: ModelConfig, model: RetrievalModel, zero_stage: int, epoch: int, step: int,
               val: dict[str, float]) -> ModelCard:
    """What rebuilds ``model`` around its saved weights, with when it was saved and its val metrics."""
    return ModelCard(model=cfg, fused=model.fusion is not None, unimodal_heads=model.unimodal_heads is not None,
                     zero_stage=zero_stage, epoch=epoch, step=step, val=val)


def exported_files(weights: str | Path) -> tuple[Path, Path, Path]:
    """(open_clip weights, heads side file, model card) of an export: ``model.pt``,
    ``model.heads.pt``, ``model.json``."""
    weights = Path(weights)
    return weights, weights.with_suffix(".heads.pt"), weights.with_suffix(".json")


def claim_export(weights: str | Path) -> None:
    """Check the files of an export to be written at ``weights`` (:func:`exported_files`) before
    any work, each with :func:`pairsim.outputs.check_file_target`: absent, or — when the set there
    is an export pairsim wrote (:func:`_written_by_pairsim`) — a file to replace.
    :class:`~pairsim.outputs.OutputRefused` naming the first file in the way otherwise."""
    if not Path(weights).name or Path(weights).name in (".", ".."):
        raise outputs.OutputRefused(f"export weights {weights}: not a file name; give e.g. model.pt")
    files = exported_files(weights)
    if files[0] == files[2]:
        raise outputs.OutputRefused(f"export weights {files[0]}: the name of its model card; give e.g. model.pt")
    owned = _written_by_pairsim(files[0])
    for path, what in zip(files, ("export weights", "export heads file", "export model card")):
        outputs.check_file_target(path, what, owned)


def _written_by_pairsim(weights: Path) -> bool:
    """Whether the export files at ``weights`` are a set pairsim wrote: each a regular file or
    absent, and the card a model card whose SHA-256 match the weights and heads there
    (:func:`verified_export_card`). An export written before cards held checksums cannot be
    told from someone else's files: it is not."""
    if any(path.is_symlink() or path.exists() and not path.is_file() for path in exported_files(weights)):
        return False  # nothing is read through a link or from a device
    try:
        return verified_export_card(weights).sha256 is not None
    except (OSError, ValueError):  # UnsafeCheckpointError and MetadataError are ValueErrors
        return False


def _write_export_files(weights: Path, writers: Sequence[Callable[[Path], object] | None]) -> list[Path]:
    """The files of the export at ``weights``, in :func:`exported_files`'s order: each written by
    its writer under a temporary name beside it, then renamed onto it; one without a writer is
    removed (a file of the export replaced that the new one lacks). Returns those written."""
    weights.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for path, write in zip(exported_files(weights), writers):
        if write is None:
            path.unlink(missing_ok=True)
            continue
        temporary = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            write(temporary)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        written.append(path)
    return written


def write_exported(card: ModelCard, state_dict: dict[str, torch.Tensor], weights: str | Path) -> list[Path]:
    """Write a :class:`RetrievalModel` state dict as open_clip weights (loadable by
    ``open_clip.create_model_and_transforms(arch, pretrained=weights)``), its heads in a side
    file (when it has any) and its card with both files' SHA-256, into the places
    :func:`claim_export` cleared; returns the files written."""
    weights, heads_file, _ = exported_files(weights)
    heads = {k: v.detach().float().cpu() for k, v in state_dict.items() if not k.startswith("clip.")}

    def write_card(path: Path) -> None:  # called once the weights and heads are in place
        sums = ExportChecksums(weights=untrusted.sha256(weights), heads=untrusted.sha256(heads_file) if heads else None)
        path.write_text(card.model_copy(update={"sha256": sums}).model_dump_json(indent=2))

    return _write_export_files(weights, [functools.partial(clip.save_open_clip_weights, open_clip_state(state_dict)),
                                         functools.partial(torch.save, heads) if heads else None, write_card])


def copy_exported(source: str | Path, weights: str | Path) -> list[Path]:
    """Copy the export at ``source`` (its files that exist) into the places :func:`claim_export`
    cleared at ``weights``; returns the files written."""
    return _write_export_files(Path(weights), [functools.partial(shutil.copyfile, path) if path.is_file() else None
                                               for path in exported_files(source)])


def verified_export_card(weights: str | Path) -> ModelCard:
    """The card of the export ``weights`` once its files pass the checks made before any is
    loaded: none leads outside the weights' folder, and the weights and heads match the SHA-256
    the card holds (an export written before cards held them is checked for links only).
    :class:`~pairsim.models.saved.UnsafeCheckpointError` naming the file otherwise."""
    weights, heads_file, card_file = exported_files(weights)
    if problems := saved.outside(weights.parent, [weights, heads_file, card_file]):
        raise UnsafeCheckpointError(f"{weights}: the export is refused: {'; '.join(problems)}")
    if not card_file.is_file():
        raise FileNotFoundError(f"{card_file}: no model card beside {weights} (not a pairsim export?)")
    card = saved.read_card(card_file)
    if card.sha256 is not None:
        sums = {weights.name: card.sha256.weights} | ({heads_file.name: card.sha256.heads} if card.sha256.heads else {})
        problems = saved.checksum_problems(weights.parent, sums)
        if card.sha256.heads is None and heads_file.exists():
            problems.append(f"{heads_file.name}: a heads file the card has no checksum for")
        if problems:
            raise UnsafeCheckpointError(f"{weights}: the export is refused: {'; '.join(problems)}")
    return card


def model_digest(weights: str | Path) -> str:
    """What identifies the export ``weights`` in what is made with it (embeddings, indexes,
    served models): the SHA-256 of its weights' and heads' SHA-256s (the card's, or computed for
    an export whose card predates them), as 64 hex digits. Checks the export first
    (:func:`verified_export_card`)."""
    weights, heads_file, _ = exported_files(weights)
    card = verified_export_card(weights)
    sums = card.sha256 or ExportChecksums(weights=untrusted.sha256(weights),
                                          heads=untrusted.sha256(heads_file) if heads_file.is_file() else None)
    return hashlib.sha256(f"{sums.weights}:{sums.heads or ''}".encode()).hexdigest()


def load_exported(weights: str | Path) -> tuple[RetrievalModel, ModelCard]:
    """The :class:`RetrievalModel` (eval mode, fp32) and card of an export written by
    :func:`write_exported`, its files checked first (:func:`verified_export_card`); the
    open_clip weights go through open_clip's own loader."""
    weights, heads_file, _ = exported_files(weights)
    card = verified_export_card(weights)
    cfg = card.model.model_copy(update={"pretrained": str(weights), "init_from": None})
    model = create_retrieval_model(cfg, fused=card.fused, unimodal_heads=card.unimodal_heads)
    if heads_file.is_file():
        missing, unexpected = model.load_state_dict(torch.load(heads_file, map_location="cpu", weights_only=True), strict=False)
        missing = [k for k in missing if not k.startswith("clip.")]
        if missing or unexpected:
            raise ValueError(f"{heads_file}: heads do not fit the model card (missing {missing}, "
                             f"unexpected {unexpected})")
    elif model.cross_heads is not None or model.unimodal_heads is not None:
        raise FileNotFoundError(f"{heads_file}: the model card names heads, but their file is missing")
    return model.eval(), card


def fusion_module(model: RetrievalModel, cfg: ModelConfig) -> torch.nn.Module:
    """The model's own fusion module, else the configured one (the evaluation's image+text items)."""
    return model.fusion if model.fusion is not None else fusion_by_name(cfg.fusion)


def fusion_by_name(name: str) -> torch.nn.Module:
    """The fusion ``model.fusion`` names: built in (:data:`pairsim.models.fusion.BUILT_IN`) or a plugin's."""
    if name in fusion.BUILT_IN:
        return fusion.BUILT_IN[name]()
    if name not in FUSIONS.names():
        raise KeyError(f"model.fusion: unknown {name!r} (registered: {', '.join(FUSIONS.names())})")
    return FUSIONS.plugin(name)()
