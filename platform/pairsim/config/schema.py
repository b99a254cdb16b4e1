"""The run configuration's schema: one typed, validated section per concern (data, model, loss,
optimizer, training, evaluation, tracking, Ray) and :class:`RunConfig`, all of them together."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import Field, SerializeAsAny, ValidationError, ValidationInfo, field_validator, model_validator

from pairsim import storage
from pairsim.config.fields import (Bool, ConfigError, Float, Int, KeyedValueError, PathOrUri, Section,
                                   check_tracking_uri, registered)
from pairsim.config.components import (BASE_LOSSES, FUSIONS, STRUCTURES, TEACHERS, BaseLossParams, Choosing,
                                       ImageTextParams, SentenceTransformersParams, StructureParams, TeacherParams,
                                       TemperatureConfig, UnifiedParams)
from pairsim.config.tree import MISSING, flatten, get_dotted, set_dotted
from pairsim import metric_families

class DataConfig(Section):
    """Where the Parquet shards are, how training pairs are drawn from them, and what Ray Data
    may use to decode, augment and tokenize them."""

    path: PathOrUri = Field(Path("data/shapes"), description="dataset directory holding manifest.json (a path or "
                                                              "a URI: s3://bucket/key, gs://…)")
    val_path: PathOrUri | None = Field(
        None, description="dataset directory of the val and test splits when they are not in data.path (train on "
                          "your data, evaluate on another dataset's split)")
    train_split: str = Field("train", description="the split trained on")
    val_split: str = Field("val", description="evaluated after each epoch; picks the best checkpoint")
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
    pin_memory: Bool = Field(True, description="with train.use_gpu: batches collated into page-locked host memory, "
                                               "so Ray Data's copy to the GPU (in its prefetch thread) does not "
                                               "block on pageable memory")
    cpus_per_task: Float = Field(1.0, gt=0.0, description="CPUs each decode/augment/tokenize task reserves")
    max_cpus: Float | None = Field(
        None, gt=0.0, description="cap on the CPUs Ray Data uses; None: all the training workers leave free")
    shard_checks: Literal["error", "skip", "off"] = Field(
        "error", description="each shard's SHA-256, computed as Ray Data reads it, against its manifest's: error "
                             "fails the run naming the shard; skip leaves it out, its image ids listed in the run's "
                             "data/skipped_images.json; off reads it unchecked (pairsim.data.shard_reader)")
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


class ModelConfig(Section):
    """An open_clip architecture, randomly initialised or loaded from ``pretrained``."""

    arch: str = Field("pairsim-tiny", description="an open_clip architecture name (open_clip.list_models()) or "
                                                  "pairsim-tiny, a 7.6 M-parameter ViT for CPUs and tests")
    pretrained: str | None = Field(None, description="open_clip tag or local weights file")
    init_from: Path | None = Field(
        None, description="start from a pairsim model: an export (model.pt with its model.json card beside it, as "
                          "`pairsim export` and every run's MLflow model/ artifacts hold) or a checkpoint directory; "
                          "its open_clip weights and the heads this config has are loaded, checked before Ray starts "
                          "(architecture, files, safe pickles). A plain open_clip weights file goes in pretrained")
    fusion: Annotated[str, registered(FUSIONS)] = Field(
        "normalized_sum", description="fused image+text embedding for GCL, a name of "
                                      "pairsim.config.components.FUSIONS: normalized_sum or raw_sum "
                                      "(UniIR's CLIP-SF)")
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
            raise KeyedValueError("model.init_from and model.pretrained both name starting weights; set one (init_from: "
                                  "a pairsim export or checkpoint; pretrained: an open_clip tag or weights file)",
                                  "init_from", "pretrained")
        return self

    @model_validator(mode="after")
    def _unlocked_needs_lock(self) -> ModelConfig:
        for tower, unlocked in (("image", "lock_image_unlocked_groups"), ("text", "lock_text_unlocked_layers")):
            if getattr(self, unlocked) and not getattr(self, f"lock_{tower}"):
                raise KeyedValueError(f"model.{unlocked}: only applies with model.lock_{tower}=true", unlocked)
        return self


def _unimodal_temperature() -> TemperatureConfig:
    return TemperatureConfig(init=0.45, min=0.1, max=1.0)


def _cross_temperature() -> TemperatureConfig:
    return TemperatureConfig(init=0.45, min=0.1, max=0.99)  # the CUSA code's (image_tau_max + text_tau_max) / 2


class CUSAConfig(Choosing):
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
    image_teacher: SerializeAsAny[TeacherParams] | None = Field(
        None, description="a teacher kind (pairsim.config.components.TEACHERS) and its own keys")
    text_teacher: SerializeAsAny[TeacherParams] | None = Field(
        default_factory=SentenceTransformersParams, description="a teacher kind and its own keys")
    teacher_features: Path | None = Field(
        None, description="teacher embeddings made by pipelines/extract_teacher.py; None runs the teachers live")

    @field_validator("cross_temperature", "image_temperature", "text_temperature", mode="before")
    @classmethod
    def _own_defaults(cls, value: Any, info: ValidationInfo) -> Any:
        """Keys left out of a partly written τ (``--set loss.cusa.cross_temperature.init=0.5``)
        keep these temperatures' own defaults, not the base loss's."""
        default = _cross_temperature() if info.field_name == "cross_temperature" else _unimodal_temperature()
        return default.model_dump() | value if isinstance(value, dict) else value

    components: ClassVar = {"image_teacher": TEACHERS, "text_teacher": TEACHERS}

    @field_validator("image_teacher", "text_teacher")
    @classmethod
    def _fits_modality(cls, teacher: TeacherParams | None, info: ValidationInfo) -> TeacherParams | None:
        modality = info.field_name.removesuffix("_teacher")
        if teacher is not None and modality not in teacher.modalities:
            raise ValueError(f"a {teacher.kind} teacher encodes {' and '.join(teacher.modalities)} only")
        return teacher

    @model_validator(mode="after")
    def _has_teachers(self) -> CUSAConfig:
        if self.teacher_features is None:
            missing = [n for n in ("image_teacher", "text_teacher") if getattr(self, n) is None]
            if missing:
                raise KeyedValueError(f"CUSA needs teachers: set {' and '.join(missing)} "
                                      "or teacher_features (pipelines/extract_teacher.py)", *missing)
        return self


class LossConfig(Choosing):
    """One objective: a base pairwise loss over a similarity structure, plus optional CUSA terms.

    ``base`` and ``structure`` are parts chosen by name, each with its own keys
    (:mod:`pairsim.config.components`): ``structure`` ``image_text`` (the B×B image↔text matrix)
    or ``gcl`` (the 3N×3N matrix over image, text and fused embeddings; ``mask_self``);
    ``base`` ``infonce`` (scale 1/τ, τ from ``temperature``), ``unified`` (``margin`` m, scale
    ``gamma`` γ) or ``triplet_hn`` (``margin`` m).
    """

    components: ClassVar = {"base": BASE_LOSSES, "structure": STRUCTURES}
    moved_keys: ClassVar = {"margin": "base.margin", "gamma": "base.gamma", "temperature": "base.temperature",
                            "gcl_mask_self": "structure.mask_self"}

    structure: SerializeAsAny[StructureParams] = Field(
        default_factory=ImageTextParams, description="similarity structure: its name "
                                                     "(pairsim.config.components.STRUCTURES) and its own keys")
    base: SerializeAsAny[BaseLossParams] = Field(
        default_factory=UnifiedParams, description="base pairwise loss: its name "
                                                   "(pairsim.config.components.BASE_LOSSES) and its own keys")
    local_loss: Bool = Field(False, description="local rows × global columns (O(B_local·B) memory)")
    cusa: CUSAConfig | None = None


class OptimConfig(Section):
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
        "torch", description="torch: torch.optim.AdamW (fused, on a GPU or a CPU), no compiler needed; deepspeed: "
                             "DeepSpeed's FusedAdam, a CUDA op built with nvcc on first use unless DeepSpeed was "
                             "installed with it")


DEEPSPEED_OWNED_KEYS = {
    "train_batch_size": "train.micro_batch_size and train.accumulate_steps",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.accumulate_steps",
    "gradient_clipping": "optim.grad_clip",
    "zero_optimization.stage": "train.zero_stage",
    "bf16.enabled": "train.precision",
    "fp16.enabled": "train.precision",
    "torch_autocast": "train.precision",
    "optimizer": "optim.*",
    "scheduler": "optim.*",
}
"""DeepSpeed config keys that ``train.deepspeed`` may not set: pairsim derives them from the field named."""


class TrainConfig(Section):
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
    precision: Literal["fp32", "bf16", "fp16", "amp_bf16"] | None = Field(
        None, description="bf16/fp16: DeepSpeed keeps the weights in that type, fp32 master copies in its "
                          "optimizer; amp_bf16: fp32 weights, forward and loss under torch.autocast to bfloat16 "
                          "(DeepSpeed's torch_autocast; open_clip_train's --precision amp_bf16); unset: amp_bf16 "
                          "with use_gpu (the fastest path measured on a GPU), fp32 without")
    accumulate_steps: Int = Field(
        1, ge=1, description="micro-batches per optimizer step (the global batch is micro_batch_size × "
                             "num_workers × accumulate_steps)")
    accumulate_mode: Literal["cache_features", "independent"] = Field(
        "cache_features", description="cache_features: the loss sees all accumulated micro-batches as one "
                                      "batch, negatives included (GradCache; one extra no-grad forward per "
                                      "micro-batch); independent: each micro-batch is its own contrastive batch")
    grad_checkpointing: Bool = Field(False, description="recompute the towers' activations in backward "
                                                        "(open_clip's --grad-checkpointing)")
    tf32: Bool = Field(True, description="with use_gpu: TF32 tensor cores for float32 matmuls and convolutions "
                                         "(open_clip_train's default); false: full float32")
    compile: Bool = Field(False, description="torch.compile the image and text towers (Inductor: a C compiler on "
                                             "the workers; the first steps compile); not with zero_stage 3, whose "
                                             "parameter hooks break the graphs")
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="merged over the DeepSpeed config pairsim derives (e.g. "
                                          "zero_optimization.offload_optimizer); keys pairsim sets from its own "
                                          "fields are refused, naming the field")
    log_every_n_steps: Int = Field(10, ge=1)
    seed: Int = 0

    @model_validator(mode="after")
    def _precision_for_the_device(self) -> TrainConfig:
        if self.precision is None:
            self.precision = "amp_bf16" if self.use_gpu else "fp32"
        return self

    @field_validator("compile")
    @classmethod
    def _compile_without_zero3(cls, compile_towers: bool, info: ValidationInfo) -> bool:
        if compile_towers and info.data.get("zero_stage") == 3:
            raise ValueError("torch.compile of the towers does not run under zero_stage 3 (its parameter gathering "
                             "hooks break the graphs); use zero_stage <= 2 or compile=false")
        return compile_towers

    @field_validator("deepspeed")
    @classmethod
    def _no_owned_deepspeed_keys(cls, tree: dict[str, Any]) -> dict[str, Any]:
        owned = [f"{key} (set {field})" for key, field in DEEPSPEED_OWNED_KEYS.items()
                 if get_dotted(tree, key) is not MISSING]
        if owned:
            raise ValueError("pairsim sets these from its own fields: " + "; ".join(owned))
        return tree


class EvalConfig(Section):
    """The evaluation suite (:mod:`pairsim.eval`): on the val split after each epoch, and on
    the test split once, with the best checkpoint, at the end."""

    batch_size: Int = Field(256, ge=1)
    ks: tuple[Int, ...] = (1, 5, 10)
    select_metric: str = Field(
        "rsum", description="val metric that picks the best checkpoint (the lowest for *median_rank, else the "
                            "highest), e.g. rsum, t2i_R@1, i2t_mAP@R, t2t_R-P, i2i_R@5, grid_text2fused_R@1")
    concurrency: Int = Field(1, ge=1, description="Ray Data actors, one GPU each, embedding a split for the "
                                                  "end-of-run and standalone evaluations (on CPU the decoding tasks "
                                                  "embed, as many as run at once)")
    val_cache_gib: Float = Field(
        1.0, ge=0.0, description="the val split's decoded pixels and tokens, as epoch 1 read them, kept on each "
                                 "training worker's device up to this size, so later epochs' validations embed them "
                                 "without Ray Data reading and decoding the split again; 0: read it every epoch")

    @model_validator(mode="after")
    def _known_metric(self) -> EvalConfig:
        if not self.ks or any(k < 1 for k in self.ks):
            raise KeyedValueError("ks must be a non-empty list of integers >= 1", "ks")
        reported = metric_families.metric_names(self.ks)
        if self.select_metric not in reported:
            raise KeyedValueError(f"select_metric: {self.select_metric!r} is not a metric the evaluation reports for "
                                  f"ks {list(self.ks)} (one of {', '.join(n for n, m in reported.items() if m)})",
                                  "select_metric")
        if reported[self.select_metric] is None:
            raise KeyedValueError(f"select_metric: {self.select_metric!r} is a count the evaluation reports, not a "
                                  "metric a best checkpoint can be selected by", "select_metric")
        return self

    @property
    def select_mode(self) -> str:
        """``min`` or ``max``: how ``select_metric`` picks the best checkpoint, as its metric family
        declares it (the lowest median rank, the highest of everything else)."""
        return metric_families.metric_names(self.ks)[self.select_metric]


class TrackingConfig(Section):
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


LABEL = r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$"  # a Ray node label's name or value


class NodeRolesConfig(Section):
    """Which nodes of a cluster do what, told by a node label (``ray start --labels
    pairsim-role=train``; cluster.yaml's node types set it): Ray Train's workers go to ``train``
    nodes, Ray Data's read and decode tasks and actors to ``data`` nodes (Ray's label selectors)."""

    placement: Literal["auto", "required", "off"] = Field(
        "auto", description="auto: by role when some node carries the label, anywhere otherwise (one machine); "
                            "required: refuse a cluster without both roles; off: ignore the labels")
    label: str = Field("pairsim-role", pattern=LABEL, description="the node label that names a node's role")
    train: str = Field("train", pattern=LABEL, description="its value on the nodes that run training workers")
    data: str = Field("data", pattern=LABEL, description="its value on the nodes that run Ray Data's work")


class RayConfig(Section):
    """The Ray instance, the CPU split between Ray Data and the training workers, and storage."""

    address: str | None = Field(None, description="None starts a local instance; 'auto' joins one")
    data_cpus: Float = Field(
        2.0, gt=0.0, description="CPUs kept for Ray Data ingest beside the training workers"
    )
    storage_path: PathOrUri = Field(Path("ray_results"), description="checkpoints (shared storage on a cluster: a "
                                                                     "shared mount or a URI, s3://bucket/key)")
    run_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=200,
        description="Ray Train run name, held while the run lives (a second run under it is refused); "
                    "re-running a stopped or failed run's name resumes it, a finished run's with --resume",
    )
    max_failures: Int = Field(0, ge=-1, description="worker-group restarts from the last checkpoint")
    checkpoints_kept: Int = Field(2, ge=1, description="the best checkpoints by eval.select_metric kept beside "
                                                       "the latest (Ray Train's CheckpointConfig num_to_keep)")
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


class RunConfig(Section):
    """Everything one training job needs."""

    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _optimizer_runs_here(self) -> RunConfig:
        if self.optim.impl == "deepspeed" and not self.train.use_gpu:
            raise KeyedValueError("optim.impl: 'deepspeed' runs DeepSpeed's FusedAdam, a CUDA op; set train.use_gpu=true "
                                  "or keep optim.impl=torch", "optim.impl", "train.use_gpu")
        return self

    def flat(self) -> dict[str, Any]:
        """Dotted-key view, as logged to MLflow params."""
        return flatten(self.model_dump(mode="json"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def with_absolute_paths(self) -> RunConfig:
        """This config with its local paths absolute (:func:`absolute_paths`)."""
        return validate(absolute_paths(self.model_dump(mode="json")), "the config with absolute paths")


LOCAL_PATH_KEYS = ("data.path", "data.val_path", "ray.storage_path", "loss.cusa.teacher_features", "model.pretrained",
                   "model.init_from",
                   "loss.cusa.image_teacher.path", "loss.cusa.text_teacher.path")


def absolute_paths(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with its local paths made absolute against the working directory (a job's is
    where ``ray job submit --working-dir`` unpacked it), so that workers in any directory find
    the same files. A symbolic link stays the path the user wrote (what reads it follows it, and
    messages name both: ``model.init_from``'s link and where it leads). URIs (``s3://…``) stay as
    they are, and ``model.pretrained`` is a path only when it names an existing file (else an
    open_clip tag)."""
    flat = flatten(tree)
    for key in LOCAL_PATH_KEYS:
        value = flat.get(key)
        if value is None or (key == "model.pretrained" and not Path(value).is_file()):
            continue
        parsed = storage.parse(value)
        set_dotted(tree, key, parsed if isinstance(parsed, str) else str(parsed.absolute()))
    return tree


def validate(tree: dict[str, Any], source: str) -> RunConfig:
    """``tree`` as a :class:`RunConfig`; :class:`ConfigError` naming every bad key, from ``source``."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError.from_validation(exc, source) from None
