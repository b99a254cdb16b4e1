"""What only a GPU can check: evaluation and losses on the device give what they give on the
CPU. Skipped without CUDA (CI has none); run on a GPU machine with ``pytest tests/test_gpu.py``."""

import numpy as np
import pytest
import torch

from pairsim.config import load_config
from pairsim.eval.metrics import blocked_retrieval_metrics
from pairsim.eval.suite import SplitEmbeddings, evaluate_split
from pairsim.build import build_objective
from pairsim.models import clip
from pairsim.models.fusion import NormalizedSumFusion
from test_evaluate import class_problem, tied_problem
from test_losses import GROUPS, features

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def same_metrics(on_gpu: dict[str, float], on_cpu: dict[str, float]) -> bool:
    """Equal, but for the float64 means (mAP@R, R-P), which sum in another order there."""
    return on_gpu.keys() == on_cpu.keys() and all(
        on_gpu[k] == pytest.approx(v, rel=1e-12) if k.endswith(("mAP@R", "R-P")) else on_gpu[k] == v
        for k, v in on_cpu.items())


@pytest.mark.parametrize("seed,blocks", [(0, (7, 5)), (1, (64, 1000)), (2, (16, 64))])
def test_blocked_retrieval_on_the_gpu_equals_the_cpu(seed, blocks):
    """Grid embeddings (exact scores on both devices, many ties): the same metrics, image-text
    labels and class labels with each query's own key left out."""
    queries, keys, ql, kl = tied_problem(seed, 300, 500, 40)
    on_cpu = blocked_retrieval_metrics(queries, keys, ql, kl, (1, 5, 10), query_block=blocks[0], key_block=blocks[1])
    assert same_metrics(blocked_retrieval_metrics(queries.to(CUDA), keys.to(CUDA), ql.numpy(), kl.numpy(), (1, 5, 10),
                                                  query_block=blocks[0], key_block=blocks[1]), on_cpu)
    items, labels, self_keys = class_problem(seed, 400)
    on_cpu = blocked_retrieval_metrics(items, items, labels, labels, (1, 5), self_keys=self_keys,
                                       query_block=blocks[0], key_block=blocks[1])
    assert same_metrics(blocked_retrieval_metrics(items.to(CUDA), items.to(CUDA), labels, labels, (1, 5),
                                                  self_keys=self_keys, query_block=blocks[0], key_block=blocks[1]),
                        on_cpu)


def four_hot(n: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """Rows of four ±1 entries: norm 2, so normalised rows (±0.5) and their scores are exact on any device."""
    support = torch.rand(n, dim, generator=g).argsort(1)[:, :4]
    signs = torch.randint(0, 2, (n, 4), generator=g).float() * 2 - 1
    return torch.zeros(n, dim).scatter_(1, support, signs)


def test_the_evaluation_suite_runs_on_the_embeddings_device():
    """A split embedded on the GPU (tensors, as validation leaves them) is evaluated there, the
    fusion module with it, to the CPU's figures: exactly where the scores are exact on both
    devices; the fused items (normalised sums, rounded by each device's own kernels) within one
    query of a near-tie."""
    g = torch.Generator().manual_seed(0)
    n_images = 60
    image, text = four_hot(n_images, 8, g), four_hot(2 * n_images, 8, g)
    ids = np.array([f"im{i}" for i in range(n_images)])
    fields = {"image_ids": ids, "labels": np.arange(n_images) % 5, "text_image_ids": np.repeat(ids, 2),
              "caption_index": np.tile([0, 1], n_images)}
    on_cpu = SplitEmbeddings.from_batches([fields | {"image": image.numpy(), "text": text.numpy()}])
    on_gpu = SplitEmbeddings.from_batches([fields | {"image": image.to(CUDA), "text": text.to(CUDA)}])
    assert on_gpu.image.device.type == "cuda"
    fusion = NormalizedSumFusion()
    expected = evaluate_split(on_cpu, fusion).metrics
    got = evaluate_split(on_gpu, fusion.to(CUDA)).metrics
    fused = {k for k in expected if k.startswith("grid_") and "fused" in k}
    assert same_metrics({k: v for k, v in got.items() if k not in fused},
                        {k: v for k, v in expected.items() if k not in fused})
    assert all(abs(got[k] - expected[k]) <= 100 / n_images + 1e-9 for k in fused)
    assert on_gpu.to("cpu").image.device.type == "cpu"


@pytest.mark.parametrize("base", ["infonce", "triplet_hn", "unified"])
@pytest.mark.parametrize("structure", ["image_text", "gcl"])
def test_objectives_on_the_gpu_match_the_float64_cpu_reference(base, structure):
    cfg = load_config(None, [f"loss.base={base}", f"loss.structure={structure}"])
    feats = features(len(GROUPS), 3) | {"group_ids": GROUPS}
    reference = build_objective(cfg.loss).double()(**feats)
    objective = build_objective(cfg.loss).to(CUDA)
    out = objective(**{k: v.float().to(CUDA) if v.is_floating_point() else v.to(CUDA) for k, v in feats.items()})
    for key, value in reference.items():
        assert out[key].item() == pytest.approx(value.item(), rel=1e-4, abs=1e-5), key


def test_pixels_are_normalised_on_the_gpu_as_on_the_cpu():
    cfg = load_config(None)
    pixels = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    normalize = clip.PixelNormalizer(cfg.model)
    on_gpu = normalize(pixels.to(CUDA), torch.bfloat16)
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.bfloat16
    torch.testing.assert_close(on_gpu.cpu(), normalize(pixels, torch.bfloat16))
