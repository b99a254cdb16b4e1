"""A saved model — a checkpoint directory or an export — as it is checked before any of it is
loaded: its model card (:class:`ModelCard`, read by :func:`read_card`) and its files, each
inside its folder (:func:`outside`) and matching its SHA-256 (:func:`checksum_problems`).
:func:`pairsim.train.checkpoints.verify_checkpoint` and
:func:`pairsim.models.retrieval.verified_export_card` apply them; nothing here imports torch."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from pairsim import storage, untrusted
from pairsim.config import Bool, Float, Int, ModelConfig, Section
from pairsim.errors import InputError

MAX_METADATA_BYTES = 1 << 20  # a card or checksum file: a few kB as pairsim writes them


class UnsafeCheckpointError(InputError):
    """A checkpoint or export refused before any of it is loaded: a file that links outside its
    folder or differs from its checksum, a card or checksum file that is not what pairsim
    writes, or a pickle that would run code."""


class MetadataError(UnsafeCheckpointError):
    """A model card or checksum file that is not what pairsim writes: unreadable, over
    :data:`MAX_METADATA_BYTES`, not JSON, or a field missing, unknown or of the wrong type."""


Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class ExportChecksums(Section):
    """The SHA-256 of an export's files, kept in its card."""

    weights: Sha256 = Field(description="of the open_clip weights file (model.pt)")
    heads: Sha256 | None = Field(description="of the heads side file (model.heads.pt); null when the model has none")


class ModelCard(Section):
    """A checkpoint's ``pairsim_model.json`` and an export's ``model.json``: what rebuilds the
    model around its weights (:func:`pairsim.models.retrieval.model_card`), when it was saved
    and its val metrics."""

    model_config = ConfigDict(allow_inf_nan=True, ser_json_inf_nan="constants")  # a val metric may be NaN

    model: ModelConfig = Field(description="the run's model section")
    fused: Bool = Field(description="the model has a fusion module (its objective reads fused embeddings)")
    unimodal_heads: Bool = Field(description="the model has uni-modal heads (its objective reads them)")
    zero_stage: Int = Field(ge=0, le=3, description="the DeepSpeed ZeRO stage it was trained under")
    epoch: Int = Field(ge=1, description="the epochs trained when it was saved")
    step: Int = Field(ge=0, description="the optimizer steps taken when it was saved")
    val: dict[str, Float] = Field(description="the val metrics of that epoch")
    sha256: ExportChecksums | None = Field(
        None, description="an export's: the SHA-256 of its files (a checkpoint's are in pairsim_checksums/; "
                          "exports written before pairsim kept them have none)")


Metadata = TypeVar("Metadata", bound=BaseModel)


def read_metadata(source: storage.LocationLike, kind: type[Metadata]) -> Metadata:
    """A card or checksum file (a path or a URI) as ``kind``; :class:`MetadataError` naming the
    file and every wrong field otherwise."""
    return untrusted.read_model(source, kind, MAX_METADATA_BYTES, MetadataError)


def read_card(source: storage.LocationLike) -> ModelCard:
    """The model card at ``source`` (:func:`read_metadata`): every reader of a card reads it here."""
    return read_metadata(source, ModelCard)


def outside(root: Path, paths: Iterable[Path]) -> list[str]:
    """A problem for each of ``paths`` that resolves outside ``root`` (a link to a file or folder
    elsewhere, or a name with ``..``) or not at all (a loop of links), each named."""
    base, problems = root.resolve(), []
    for path in paths:
        name = path.relative_to(root) if path.is_relative_to(root) else path
        try:
            target = path.resolve()
        except RuntimeError:  # Path.resolve's word for a loop
            problems.append(f"{name}: a loop of links")
            continue
        if not target.is_relative_to(base):
            problems.append(f"{name}: leads to {target}, outside {root}")
    return problems


def checksum_problems(root: Path, expected: dict[str, str]) -> list[str]:
    """A problem for each file ``expected`` names (relative to ``root``, with its SHA-256) that is
    outside ``root``, missing, or differs from its checksum."""
    if problems := outside(root, [root / name for name in expected]):
        return problems
    for name, digest in expected.items():
        if not (root / name).is_file():
            problems.append(f"{name}: missing")
        elif untrusted.sha256(root / name) != digest:
            problems.append(f"{name}: content differs from its checksum (truncated or altered)")
    return problems
