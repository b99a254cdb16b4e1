"""The names of the evaluation suite's metrics, without computing any: what each metric family
reports for given ``ks`` on data with given :class:`DataFacts`, each metric with its selection
mode.

:data:`FAMILIES` is the one list of metric families, in report order; :func:`metric_names` what
they report together. The config's ``eval.select_metric`` check, the driver's check against the
val data and the report table read these; :mod:`pairsim.eval.suite` computes the metrics. This
module imports no torch (only numpy), so the config can import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

MODALITIES = ("image", "text", "fused")
GRID_KS = (1, 5)
Mode = Literal["max", "min"] | None  # how a metric picks the best checkpoint; None: a count, never selected


@dataclass(frozen=True)
class DataFacts:
    """What a split holds that decides which metrics it can give: ``has_labels``, some class
    label (≥ 0) that two images or more share (image→image: an image alone in its class has no
    positive); ``has_multi_caption``, some image with two captions or more (text→text and the
    modality grid)."""

    has_labels: bool = True
    has_multi_caption: bool = True

    @classmethod
    def from_columns(cls, labels: np.ndarray, captions_per_image: np.ndarray) -> DataFacts:
        """From the images' ``label`` column and caption counts (e.g. read from the shards)."""
        labels = np.asarray(labels)
        return cls(has_labels=bool((np.unique(labels[labels >= 0], return_counts=True)[1] >= 2).any()),
                   has_multi_caption=bool((np.asarray(captions_per_image) >= 2).any()))

    @classmethod
    def of(cls, emb: Any) -> DataFacts:
        """Of a split's embeddings (a :class:`pairsim.eval.suite.SplitEmbeddings`, or anything with
        its numpy arrays ``image_ids``, ``labels`` and ``text_image_ids``)."""
        ids, counts = np.unique(np.asarray(emb.text_image_ids).astype(str), return_counts=True)
        captions = dict(zip(ids.tolist(), counts.tolist()))
        return cls.from_columns(np.asarray(emb.labels, dtype=np.int64),
                                np.array([captions.get(i, 0) for i in np.asarray(emb.image_ids).astype(str).tolist()]))

    def describe(self) -> str:
        return (f"{'with' if self.has_labels else 'no'} class labels, "
                f"{'some' if self.has_multi_caption else 'no'} image with two captions or more")


def ranking_metric_names(prefix: str, ks: Sequence[int]) -> dict[str, Mode]:
    """The names :func:`pairsim.eval.metrics.metrics_from_query_values` reports for one ranking
    direction, prefixed, with their modes (the lowest median rank is best)."""
    return ({f"{prefix}_R@{k}": "max" for k in ks} | {f"{prefix}_mAP@R": "max", f"{prefix}_R-P": "max",
            f"{prefix}_median_rank": "min", f"{prefix}_n_queries_without_positive": None})


def grid_metric_name(query: str, key: str, k: int) -> str:
    return f"grid_{query}2{key}_R@{k}"


class MetricFamily:
    """One family of the suite's metrics, named in :data:`FAMILIES`.

    ``directions``: its ranking directions, metric prefix → what a person reads (the rows of the
    report table, in order). :meth:`names` must list exactly what the family's compute in
    :data:`pairsim.eval.suite.COMPUTE` reports on data with those facts
    (:func:`pairsim.eval.suite.evaluate_split` checks).
    """

    directions: dict[str, str] = {}

    def names(self, ks: Sequence[int], facts: DataFacts | None = None) -> dict[str, Mode]:
        """The metrics reported for ``ks`` on data with ``facts`` (None: on some data), each with
        its mode: ``max``, ``min``, or None for a count no checkpoint is selected by."""
        raise NotImplementedError


class CrossModalFamily(MetricFamily):
    """Image→text and text→image (each caption of the image a positive), and rsum."""

    directions = {"i2t": "image→text", "t2i": "text→image"}

    def names(self, ks, facts=None):
        return ranking_metric_names("i2t", ks) | ranking_metric_names("t2i", ks) | {"rsum": "max"}


class UniModalFamily(MetricFamily):
    """Text→text (needs images with two captions) and image→image (needs a class two images share)."""

    directions = {"i2i": "image→image", "t2t": "text→text"}

    def names(self, ks, facts=None):
        out: dict[str, Mode] = {}
        if facts is None or facts.has_multi_caption:
            out |= ranking_metric_names("t2t", ks)
        if facts is None or facts.has_labels:
            out |= ranking_metric_names("i2i", ks)
        return out


class ModalityGridFamily(MetricFamily):
    """R@1 and R@5 of {image, text, fused} queries × keys (needs images with two captions);
    k in :data:`GRID_KS` whatever ``ks``."""

    def names(self, ks, facts=None):
        if facts is not None and not facts.has_multi_caption:
            return {}
        return {grid_metric_name(q, key, k): "max" for k in GRID_KS for q in MODALITIES for key in MODALITIES}


FAMILIES: dict[str, MetricFamily] = {"crossmodal": CrossModalFamily(), "unimodal": UniModalFamily(),
                                     "grid": ModalityGridFamily()}


def metric_names(ks: Sequence[int], facts: DataFacts | None = None) -> dict[str, Mode]:
    """Every metric the suite reports for ``ks`` — on data with ``facts``, or on some data when
    None — each with its mode (``max``, ``min``, or None for a count), the families of
    :data:`FAMILIES` in order."""
    return {name: mode for family in FAMILIES.values() for name, mode in family.names(tuple(ks), facts).items()}


def selectable_metrics(ks: Sequence[int], facts: DataFacts | None = None) -> dict[str, str]:
    """The metrics of :func:`metric_names` a best checkpoint can be selected by, with their modes."""
    return {name: mode for name, mode in metric_names(ks, facts).items() if mode is not None}


def skipped_groups(ks: Sequence[int], facts: DataFacts) -> dict[str, str]:
    """The metric groups (name prefix → label) that data with every fact gives and a split
    with ``facts`` cannot: image→image without class labels, text→text and the modality grid
    with one caption per image."""
    given = metric_names(ks, facts)
    labels = directions() | {"grid": "the modality grid"}
    return {prefix: labels.get(prefix, prefix) for prefix in dict.fromkeys(
        name.split("_", 1)[0] for name in metric_names(ks, DataFacts()) if name not in given)}


def directions() -> dict[str, str]:
    """Every family's ranking directions: metric prefix → label (i2t → image→text, ...)."""
    return {prefix: label for family in FAMILIES.values() for prefix, label in family.directions.items()}
