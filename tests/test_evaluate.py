import pytest
import torch

from pairsim.evaluate import first_positive_rank, image_text_retrieval, recall_at_k


def test_recall_on_a_hand_computed_matrix():
    # 3 queries × 4 keys. Query 0: positive key 2 ranked 2nd; query 1: positives 0 and 3, best at
    # rank 1; query 2: positive key 1 ranked last (4th).
    sim = torch.tensor([[0.9, 0.1, 0.5, 0.2],
                        [0.8, 0.7, 0.1, 0.3],
                        [0.4, 0.0, 0.3, 0.2]])
    pos = torch.tensor([[0, 0, 1, 0], [1, 0, 0, 1], [0, 1, 0, 0]], dtype=torch.bool)
    assert first_positive_rank(sim, pos).tolist() == [2, 1, 4]
    assert recall_at_k(sim, pos, ks=(1, 2, 3, 4)) == pytest.approx(
        {"R@1": 100 / 3, "R@2": 200 / 3, "R@3": 200 / 3, "R@4": 100.0})


def test_ties_break_towards_the_lower_key_index():
    sim = torch.tensor([[0.5, 0.5, 0.5]])
    assert first_positive_rank(sim, torch.tensor([[False, False, True]])).tolist() == [3]
    assert first_positive_rank(sim, torch.tensor([[True, False, False]])).tolist() == [1]


def test_queries_without_positives_are_left_out():
    sim = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    pos = torch.tensor([[True, False], [False, False]])
    assert recall_at_k(sim, pos, ks=(1,)) == {"R@1": 100.0}


def test_image_text_retrieval_with_several_captions_per_image():
    # 2 images, 5 captions: captions 0-2 describe image "a", 3-4 image "b".
    image = torch.eye(3)[:2]                       # a = e0, b = e1
    text = torch.tensor([[0.0, 0.0, 1.0],          # a, off-axis: scores 0 with both images
                         [1.0, 0.0, 0.0],          # a
                         [0.0, 1.0, 0.0],          # a, but points at b
                         [0.0, 1.0, 0.0],          # b
                         [0.6, 0.8, 0.0]])         # b
    metrics = image_text_retrieval(image, ["a", "b"], text, ["a", "a", "a", "b", "b"], ks=(1, 5))
    # i2t: a's best caption (1) is first; b ties captions 2 and 3 at 1.0, caption 2 (wrong) wins
    # the tie by index, so b's first hit is at rank 2.
    assert metrics["i2t_R@1"] == 50.0 and metrics["i2t_R@5"] == 100.0
    # t2i: caption 0 ties (0, 0) → image a first: hit. 1 → a: hit. 2 → b: miss (R@1), hit at 2.
    # 3 → b: hit. 4 → b (0.8 > 0.6): hit.
    assert metrics["t2i_R@1"] == 80.0 and metrics["t2i_R@5"] == 100.0
    assert metrics["rsum"] == 50.0 + 100.0 + 80.0 + 100.0
