"""What the loss does to a split's similarities: each positive pair's similarity against its
query's hardest negative (the distributions Li et al., "Unified Loss of Pair Similarity
Optimization for Vision-Language Retrieval", arXiv 2209.13869, plot in their Fig. 4), as a
few ``<split>/sim/...`` metrics and a histogram logged into an MLflow run every epoch.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pairsim.eval.metrics import Metrics
from pairsim.eval.suite import SplitEmbeddings

BINS = np.linspace(-1.0, 1.0, 81)  # cosine similarities of L2-normalised embeddings


@dataclass(frozen=True)
class PairSimilarities:
    """One entry per positive pair (image i, caption c of i), in caption order.

    ``positive`` s(i, c); ``i2t_hardest_negative`` max s(i, c') over captions c' of other
    images; ``t2i_hardest_negative`` max s(i', c) over other images i'.
    """

    positive: np.ndarray
    i2t_hardest_negative: np.ndarray
    t2i_hardest_negative: np.ndarray

    @property
    def hardest_negative(self) -> np.ndarray:
        """Both directions' hardest negatives pooled: 2 per positive pair."""
        return np.concatenate([self.i2t_hardest_negative, self.t2i_hardest_negative])

    def metrics(self, prefix: str = "val/sim/") -> Metrics:
        """``positive_mean``, ``hardest_negative_mean`` (both directions pooled) and ``gap``,
        their difference: the mean margin by which a positive beats its query's hardest negative."""
        positive = float(self.positive.mean(dtype=np.float64))
        negative = float(self.hardest_negative.mean(dtype=np.float64))
        return {f"{prefix}positive_mean": positive, f"{prefix}hardest_negative_mean": negative,
                f"{prefix}gap": positive - negative}


def pair_similarities(emb: SplitEmbeddings, image_block: int = 256) -> PairSimilarities:
    """Positive and hardest-negative cosine similarities of every positive pair of the split
    (the quantities of Li et al., arXiv 2209.13869, Fig. 4).

    For image i and each caption c of i, with s = cosine similarity and id(·) the image id::

        positive  = s(i, c)
        i2t hard  = max_{c' : id(c') ≠ id(i)} s(i, c')    (the image query's hardest negative)
        t2i hard  = max_{i' : id(i') ≠ id(i)} s(i', c)    (the caption query's hardest negative)

    An image's i2t hardest negative repeats for each of its captions, so both directions weigh
    every pair once; the arrays keep the directions apart, the metrics and the histogram pool
    them (2 hardest negatives per positive pair). Captions whose image is not in the split are negatives only; images
    without captions, negative images only. One pass of ``image_block`` images × all captions
    at a time. Raises ValueError when a positive pair has no negative (fewer than 2 images, or
    every caption is of one image).
    """
    if len(emb.image) < 2:
        raise ValueError(f"pair similarities need at least 2 images for a negative; the split has {len(emb.image)}")
    image, text = emb.image.float(), emb.text.float()
    image_label, text_label = (torch.as_tensor(labels, dtype=torch.long) for labels in emb.id_labels())
    row_of_label = torch.full((len(image) + len(text),), -1, dtype=torch.long)
    row_of_label[image_label] = torch.arange(len(image))
    image_row = row_of_label[text_label]  # each caption's image row, -1: not in the split
    pairs = (image_row >= 0).nonzero().squeeze(1)
    if len(pairs) == 0:
        raise ValueError("pair similarities need a caption of an image in the split; the split has none")

    i2t = torch.empty(len(image))
    t2i = torch.full((len(text),), -torch.inf)
    for start in range(0, len(image), image_block):
        scores = image[start:start + image_block] @ text.T
        scores.masked_fill_(image_label[start:start + image_block, None] == text_label[None, :], -torch.inf)
        i2t[start:start + image_block] = scores.max(1).values
        t2i = torch.maximum(t2i, scores.max(0).values)
    rows = image_row[pairs]
    out = PairSimilarities(positive=(image[rows] * text[pairs]).sum(1).numpy(),
                           i2t_hardest_negative=i2t[rows].numpy(), t2i_hardest_negative=t2i[pairs].numpy())
    if np.isinf(out.i2t_hardest_negative).any():
        raise ValueError("pair similarities need captions of at least 2 images for a negative caption; "
                         "every caption of the split is of one image")
    if np.isinf(out.t2i_hardest_negative).any():
        raise ValueError("pair similarities need at least 2 distinct image ids for a negative image")
    return out


def similarity_histogram(sims: PairSimilarities, path: str | Path, title: str = "") -> Path:
    """Overlaid histograms of the positive and the (pooled) hardest-negative similarities on
    shared bins over [-1, 1], each as a share of its values (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = sims.metrics(prefix="")
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for values, label, mean, color in (
            (sims.positive, "positive", metrics["positive_mean"], "tab:green"),
            (sims.hardest_negative, "hardest negative", metrics["hardest_negative_mean"], "tab:red")):
        values = np.clip(values, BINS[0], BINS[-1])  # rounding can land a hair outside [-1, 1]
        ax.hist(values, bins=BINS, weights=np.full(len(values), 1 / len(values)), alpha=0.5, color=color,
                label=f"{label}: mean {mean:.3f} (n={len(values)})")
    ax.set_xlim(BINS[0], BINS[-1])
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("share of pairs")
    ax.legend(loc="upper left")
    ax.set_title(f"{title + ': ' if title else ''}mean gap (positive − hardest negative) {metrics['gap']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def log_similarities(logger, emb: SplitEmbeddings, step: int, epoch: int, split: str = "val") -> Metrics:
    """Into an MLflow run: ``<split>/sim/{positive_mean, hardest_negative_mean, gap}`` at
    ``step`` and the histogram as ``similarity/epoch_<epoch>.png``. Returns the metrics."""
    sims = pair_similarities(emb)
    metrics = sims.metrics(prefix=f"{split}/sim/")
    logger.log_metrics(metrics, step)
    with tempfile.TemporaryDirectory() as tmp:
        path = similarity_histogram(sims, Path(tmp) / f"epoch_{epoch:03d}.png",
                                    f"{split}, epoch {epoch}")
        logger.log_artifact(path, "similarity")
    return metrics
