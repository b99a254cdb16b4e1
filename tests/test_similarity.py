"""Positive vs hardest-negative similarities (pairsim.eval.similarity) against a naive loop."""

import numpy as np
import pytest
import torch
from mlflow.utils.validation import _validate_metric_name
from PIL import Image

from pairsim.eval.similarity import log_similarities, pair_similarities, similarity_histogram
from pairsim.eval.suite import SplitEmbeddings
from pairsim.tracking import metric_key


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def split(captions_per_image, dim=8, seed=0, extra_captions=0) -> SplitEmbeddings:
    """Random unit embeddings; image ``i`` has ``captions_per_image[i]`` captions, shuffled
    among ``extra_captions`` captions of an image that is not in the split."""
    rng = np.random.default_rng(seed)
    image_ids = np.array([f"img{i}" for i in range(len(captions_per_image))])
    text_ids = np.array([f"img{i}" for i, n in enumerate(captions_per_image) for _ in range(n)]
                        + ["missing"] * extra_captions)
    order = rng.permutation(len(text_ids))
    return SplitEmbeddings(image=torch.from_numpy(unit(rng.normal(size=(len(image_ids), dim))).astype(np.float32)),
                           image_ids=image_ids, labels=-np.ones(len(image_ids), dtype=np.int64),
                           text=torch.from_numpy(unit(rng.normal(size=(len(text_ids), dim))).astype(np.float32)),
                           text_image_ids=text_ids[order], caption_index=np.zeros(len(text_ids), dtype=np.int64))


def naive(emb: SplitEmbeddings):
    """Every (image, caption of it) pair, caption order, by loops in float64."""
    image, text = emb.image.double().numpy(), emb.text.double().numpy()
    positive, i2t, t2i = [], [], []
    for c, owner in enumerate(emb.text_image_ids):
        for i, image_id in enumerate(emb.image_ids):
            if image_id != owner:
                continue
            positive.append(image[i] @ text[c])
            i2t.append(max(image[i] @ text[o] for o in range(len(text)) if emb.text_image_ids[o] != image_id))
            t2i.append(max(image[o] @ text[c] for o in range(len(image)) if emb.image_ids[o] != owner))
    return np.array(positive), np.array(i2t), np.array(t2i)


@pytest.mark.parametrize("captions, extra", [([3, 1, 5, 2, 4, 2, 3], 0), ([1] * 9, 0), ([2, 0, 3, 1], 3)],
                         ids=["several_captions", "one_caption", "uncaptioned_image_and_orphan_captions"])
@pytest.mark.parametrize("image_block", [2, 256])
def test_pair_similarities_match_a_naive_loop(captions, extra, image_block):
    emb = split(captions, extra_captions=extra)
    sims = pair_similarities(emb, image_block=image_block)
    positive, i2t, t2i = naive(emb)
    assert len(sims.positive) == sum(captions)
    np.testing.assert_allclose(sims.positive, positive, atol=1e-6)
    np.testing.assert_allclose(sims.i2t_hardest_negative, i2t, atol=1e-6)
    np.testing.assert_allclose(sims.t2i_hardest_negative, t2i, atol=1e-6)
    metrics = sims.metrics()
    pooled = np.concatenate([i2t, t2i])
    assert metrics["val/sim/positive_mean"] == pytest.approx(positive.mean(), abs=1e-6)
    assert metrics["val/sim/hardest_negative_mean"] == pytest.approx(pooled.mean(), abs=1e-6)
    assert metrics["val/sim/gap"] == pytest.approx(np.concatenate([positive, positive]).mean() - pooled.mean(),
                                                   abs=1e-6)


def test_two_images_are_each_others_hardest_negative():
    emb = split([2, 1])
    sims = pair_similarities(emb)
    image, text, owner = emb.image.double(), emb.text.double(), emb.text_image_ids
    for pair, c in enumerate(range(3)):
        mine, other = (0, 1) if owner[c] == "img0" else (1, 0)
        assert sims.positive[pair] == pytest.approx(float(image[mine] @ text[c]), abs=1e-6)
        assert sims.t2i_hardest_negative[pair] == pytest.approx(float(image[other] @ text[c]), abs=1e-6)
        others = [o for o in range(3) if owner[o] != owner[c]]
        assert sims.i2t_hardest_negative[pair] == pytest.approx(max(float(image[mine] @ text[o]) for o in others),
                                                                abs=1e-6)


def test_a_perfect_model_separates_positives_from_hardest_negatives():
    emb = split([2, 1, 3])
    emb.text = emb.image[torch.as_tensor([int(i.removeprefix("img")) for i in emb.text_image_ids])]
    metrics = pair_similarities(emb).metrics()
    assert metrics["val/sim/positive_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["val/sim/gap"] == pytest.approx(1 - metrics["val/sim/hardest_negative_mean"])
    assert metrics["val/sim/gap"] > 0


@pytest.mark.parametrize("captions, extra, reason", [
    ([3], 0, "at least 2 images"), ([], 0, "at least 2 images"),
    ([2, 0], 0, "captions of at least 2 images"), ([0, 0], 2, "a caption of an image in the split")])
def test_splits_without_a_negative_are_refused(captions, extra, reason):
    with pytest.raises(ValueError, match=reason):
        pair_similarities(split(captions, extra_captions=extra))


def test_metric_keys_are_valid_mlflow_keys_like_the_other_val_metrics():
    for key in pair_similarities(split([2, 1])).metrics():
        assert key.startswith("val/sim/") and metric_key(key) == key
        _validate_metric_name(key)


def test_histogram_is_a_png(tmp_path):
    sims = pair_similarities(split([3, 1, 2, 5]))
    path = similarity_histogram(sims, tmp_path / "epoch_001.png", "val, epoch 1")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 100


class FakeRun:
    def __init__(self):
        self.metrics, self.artifacts = {}, []

    def log_metrics(self, metrics, step):
        self.metrics[step] = metrics

    def log_artifact(self, path, artifact_path=None):
        assert path.is_file()
        self.artifacts.append(f"{artifact_path}/{path.name}")


def test_log_similarities_logs_metrics_at_the_step_and_the_epochs_histogram():
    run = FakeRun()
    metrics = log_similarities(run, split([2, 2, 1]), step=48, epoch=3)
    assert run.metrics == {48: metrics}
    assert set(metrics) == {"val/sim/positive_mean", "val/sim/hardest_negative_mean", "val/sim/gap"}
    assert run.artifacts == ["similarity/epoch_003.png"]
