"""What a person reads of an evaluation: the report table, the modality-grid heatmap and the
retrieval gallery, and logging them all into an MLflow run."""

from __future__ import annotations

import io
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from pairsim.eval.metrics import Metrics
from pairsim.metric_families import GRID_KS, MODALITIES, directions, grid_metric_name
from pairsim.eval.suite import EvalReport, SplitEmbeddings


def grid_heatmap(grid: dict[int, np.ndarray], path: str | Path, title: str = "") -> Path:
    """The modality grid as one annotated 3×3 heatmap per k (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(grid), figsize=(4.2 * len(grid), 4), squeeze=False)
    for ax, (k, values) in zip(axes[0], sorted(grid.items())):
        ax.imshow(values, vmin=0, vmax=100, cmap="viridis")
        ax.set_xticks(range(3), [f"{m} key" for m in MODALITIES])
        ax.set_yticks(range(3), [f"{m} query" for m in MODALITIES])
        ax.set_title(f"R@{k} (%)")
        for (i, j), value in np.ndenumerate(values):
            ax.text(j, i, f"{value:.1f}", ha="center", va="center", color="white" if value < 60 else "black")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


RowReader = Callable[[list[str]], dict[str, dict[str, Any]]]  # image ids -> their shard rows


def retrieval_gallery(emb: SplitEmbeddings, read_rows: RowReader, path: str | Path, n_queries: int = 4, k: int = 5,
                      title: str = "") -> Path:
    """A PNG of ``n_queries`` text queries (spread over the split), each with its top-``k``
    images, hits framed green and misses red. ``read_rows(ids)`` gives each image's shard row
    (``image`` bytes and ``captions``); only the shown images' rows are read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    query_rows = np.linspace(0, len(emb.text) - 1, num=min(n_queries, len(emb.text))).round().astype(int)
    top = torch.sort(emb.text[query_rows].float() @ emb.image.float().T, dim=1, descending=True, stable=True)
    top = top.indices[:, :k].numpy()
    ids = [str(i) for i in emb.image_ids]
    rows = read_rows(sorted({ids[j] for j in top.ravel()} | {str(emb.text_image_ids[q]) for q in query_rows}))
    fig, axes = plt.subplots(len(query_rows), k, figsize=(2.2 * k, 2.6 * len(query_rows)), squeeze=False)
    for line, (q, found) in enumerate(zip(query_rows, top)):
        target = str(emb.text_image_ids[q])
        caption = rows[target]["captions"][int(emb.caption_index[q])]
        axes[line][0].set_title(caption if len(caption) < 60 else caption[:57] + "…", loc="left", fontsize=9)
        for rank, (ax, j) in enumerate(zip(axes[line], found), start=1):
            with Image.open(io.BytesIO(rows[ids[j]]["image"])) as image:
                ax.imshow(image.convert("RGB"))
            hit = ids[j] == target
            ax.set_xticks([]), ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_edgecolor("green" if hit else "red")
                spine.set_linewidth(4)
            ax.set_xlabel(f"{rank}. {ids[j]}" + (" ✓" if hit else ""), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def render_pictures(report: EvalReport, emb: SplitEmbeddings, read_rows: RowReader, out_dir: Path, split: str,
                    title: str = "") -> dict[str, Path]:
    """The modality-grid heatmap (none when no image of the split has two captions) and the
    retrieval gallery as PNGs in ``out_dir``, by name: ``modality_grid``, ``gallery``."""
    pictures = {"modality_grid": grid_heatmap(report.grid, out_dir / f"{split}_modality_grid.png", title)
                } if report.grid else {}
    return pictures | {"gallery": retrieval_gallery(emb, read_rows, out_dir / f"{split}_gallery.png", title=title)}


def log_report(logger, report: EvalReport, emb: SplitEmbeddings, read_rows: RowReader, split: str, step: int,
               title: str = "") -> None:
    """Into an MLflow run: ``<split>/<metric>`` metrics, ``eval/<split>.json`` and the modality
    grid heatmap and retrieval gallery PNGs under ``eval/``."""
    logger.log_metrics({f"{split}/{k}": v for k, v in report.metrics.items()}, step)
    logger.log_dict({"split": split, "metrics": report.metrics,
                     "grid": {f"R@{k}": v.tolist() for k, v in report.grid.items()}, "grid_axes": MODALITIES},
                    f"eval/{split}.json")
    with tempfile.TemporaryDirectory() as tmp:
        for path in render_pictures(report, emb, read_rows, Path(tmp), split, title).values():
            logger.log_artifact(path, "eval")


def log_pictures(logger, report: EvalReport, emb: SplitEmbeddings, read_rows: RowReader, split: str, step: int,
                 title: str = "") -> None:
    """Into an MLflow run: the modality-grid heatmap and retrieval gallery as the step images
    ``<split>/modality_grid`` and ``<split>/gallery`` at ``step`` (the UI slides through the steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in render_pictures(report, emb, read_rows, Path(tmp), split, title).items():
            logger.log_image(path, f"{split}/{name}", step)


def format_report(metrics: Metrics, ks: Sequence[int] = (1, 5, 10)) -> str:
    """The report as a table: one row per registered direction the metrics have
    (:func:`pairsim.metric_families.directions`), then RSUM and the modality grid's R@1."""
    columns = [f"R@{k}" for k in ks] + ["mAP@R", "R-P", "median_rank"]
    lines = [f"{'direction':<14}" + "".join(f"{c:>12}" for c in columns)]
    for direction, label in directions().items():
        if f"{direction}_R@{ks[0]}" in metrics:
            lines.append(f"{label:<14}" + "".join(f"{metrics[f'{direction}_{c}']:12.2f}" for c in columns))
    lines.append(f"{'RSUM':<14}{metrics['rsum']:12.2f}")
    k = GRID_KS[0]
    if grid_metric_name(MODALITIES[0], MODALITIES[0], k) in metrics:
        lines += ["", f"modality grid R@{k} (rows: queries)", f"{'':<14}" + "".join(f"{m:>12}" for m in MODALITIES)]
        for q in MODALITIES:
            lines.append(f"{q:<14}" + "".join(f"{metrics[grid_metric_name(q, key, k)]:12.2f}" for key in MODALITIES))
    return "\n".join(lines)
