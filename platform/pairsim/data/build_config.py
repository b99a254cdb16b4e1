"""The shard build's options (``pairsim shards build``), validated before anything is read."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationError, model_validator

from pairsim.config import ConfigError, Float, Int, PathOrUri, Section, registered
from pairsim.config.fields import KeyedValueError
from pairsim.registry import DATA_FORMATS

SPLIT_NAME = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$"  # a directory name inside the dataset: no '..', no hidden name


def _unescaped(value: Any) -> Any:
    """A string's backslash escapes decoded (``\\t`` → tab), as a shell passes them on."""
    return codecs.decode(value, "unicode_escape") if isinstance(value, str) else value


class BuildConfig(Section):
    """One shard build (``pairsim shards build``): where the source is, where the shards go,
    how big they are and how images are cleaned."""

    format: Annotated[str, registered(DATA_FORMATS)] = Field(
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
            raise KeyedValueError(f"{', '.join(foreign)}: only for format "
                                  + " / ".join(f for f, fmt in DATA_FORMATS.items() if foreign[0] in fmt.options)
                                  + f", not {self.format!r}", *foreign)
        return self

    @classmethod
    def from_args(cls, **values: Any) -> BuildConfig:
        try:
            return cls.model_validate({k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:
            raise ConfigError.from_validation(exc, "shards build options") from None
