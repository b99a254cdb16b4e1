"""A run's modules from its config: the one module that imports both :mod:`pairsim.config` and torch.

:data:`FACTORIES` maps each built-in part's parameter model (:mod:`pairsim.config.components`,
where the names map to the models) to what builds it from plain arguments; a plugin's part is its
entry point's class, called with its parameters as keyword arguments. Losses and teachers
never import config; fusions are made by name in :mod:`pairsim.models.retrieval`, below this
module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pairsim.config import ConfigError, RunConfig, Section
from pairsim.config import components as c
from pairsim.config.components import Family
from pairsim.config.fields import leading_keys
from pairsim.losses.modules import (BaseLoss, CUSALoss, GCLLoss, ImageTextLoss, InfoNCE, Objective, Sigmoid,
                                    Structure, TripletHN, Unified)
from pairsim.losses.temperature import Bounded, Temperature
from pairsim.teachers.encoders import (MODALITIES, InitialStudentTeacher, OpenCLIPTeacher, SentenceTransformerTeacher,
                                       Teacher)
from pairsim.teachers.store import TeacherStore


def temperature(cfg: c.TemperatureConfig) -> Temperature:
    return Temperature(cfg.init, cfg.min, cfg.max, cfg.learnable)


FACTORIES: dict[type[Section], Callable[..., Any]] = {
    # base losses: (params) → BaseLoss
    c.InfoNCEParams: lambda p: InfoNCE(temperature(p.temperature)),
    c.UnifiedParams: lambda p: Unified(p.margin, p.gamma),
    c.TripletHNParams: lambda p: TripletHN(p.margin),
    c.SigmoidParams: lambda p: Sigmoid(temperature(p.temperature),
                                       Bounded(p.bias.init, p.bias.min, p.bias.max, p.bias.learnable)),
    # structures: (params, base, local_loss=, rank=, world_size=) → Structure
    c.ImageTextParams: lambda p, base, **dist: ImageTextLoss(base, **dist),
    c.GCLParams: lambda p, base, **dist: GCLLoss(base, p.mask_self, **dist),
    # teachers: (params, modality, student RunConfig) → Teacher
    c.SentenceTransformersParams: lambda p, modality, student: SentenceTransformerTeacher(p.path, p.max_length),
    c.OpenCLIPTeacherParams: lambda p, modality, student: OpenCLIPTeacher(modality, p.arch, str(p.path)),
    c.InitialStudentParams: lambda p, modality, student: InitialStudentTeacher(
        modality, student.model.arch, _initial_weights(modality, student), seed=student.train.seed),
}
"""Each built-in part's parameter model → its builder."""


def _initial_weights(modality: str, student: RunConfig) -> str | None:
    start = student.model.init_from
    if start is not None and not Path(start).is_file():
        raise ConfigError(f"loss.cusa.{modality}_teacher: initial_student reads the open_clip weights of an export; "
                          f"model.init_from is a checkpoint directory ({start}): export it (pairsim export) and "
                          "name its model.pt", (f"loss.cusa.{modality}_teacher", "model.init_from"))
    return str(start) if start else student.model.pretrained


def part(family: Family, params: Section, *args: Any, **kwargs: Any) -> Any:
    """The module ``params`` (a part of ``family``) describes, built-in or plugin."""
    factory = FACTORIES.get(type(params))
    if factory is not None:
        return factory(params, *args, **kwargs)
    plugin = family.plugin(getattr(params, family.selector))
    return plugin(*args, **params.model_dump(exclude={family.selector}), **kwargs)


def build_base(cfg) -> BaseLoss:
    """The base loss of a :class:`~pairsim.config.LossConfig`."""
    return part(c.BASE_LOSSES, cfg.base)


def build_objective(cfg, rank: int = 0, world_size: int = 1) -> Objective:
    """The objective a :class:`~pairsim.config.LossConfig` describes, for this worker's place."""
    dist = {"local_loss": cfg.local_loss, "rank": rank, "world_size": world_size}
    structure: Structure = part(c.STRUCTURES, cfg.structure, build_base(cfg), **dist)
    if cfg.cusa is None:
        return Objective(structure, **dist)
    cusa = CUSALoss(temperature(cfg.cusa.cross_temperature), temperature(cfg.cusa.image_temperature),
                    temperature(cfg.cusa.text_temperature), cfg.cusa.teacher_temperature, **dist)
    return Objective(structure, cusa, cfg.cusa.alpha, cfg.cusa.beta, cfg.cusa.reduction, **dist)


def build_teachers(cfg: RunConfig) -> dict[str, Teacher]:
    """The run's live teachers by modality ({} without CUSA)."""
    cusa = cfg.loss.cusa
    if cusa is None:
        return {}
    return {m: part(c.TEACHERS, teacher, m, cfg) for m in MODALITIES
            if (teacher := getattr(cusa, f"{m}_teacher")) is not None}


def teacher_sources(cfg: RunConfig) -> tuple[dict[str, Teacher], TeacherStore | None]:
    """Where a run's CUSA teacher embeddings come from: the live teachers by modality, or the
    features extracted to ``loss.cusa.teacher_features``; ({}, None) without CUSA."""
    cusa = cfg.loss.cusa
    if cusa is None:
        return {}, None
    if cusa.teacher_features:
        return {}, TeacherStore(cusa.teacher_features)
    return build_teachers(cfg), None


def check_teachers(cfg: RunConfig) -> None:
    """Driver-side checks: the files each teacher names exist and it can be built;
    :class:`ConfigError` naming every problem's key."""
    cusa = cfg.loss.cusa
    if cusa is None:
        return
    problems = [problem for m in MODALITIES if (teacher := getattr(cusa, f"{m}_teacher")) is not None
                for problem in teacher.check_files(f"loss.cusa.{m}_teacher")]
    if problems:
        message = "\n".join(problems)
        raise ConfigError(message, leading_keys(message))
    build_teachers(cfg)
