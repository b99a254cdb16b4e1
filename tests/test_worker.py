"""The training worker's own parts that run without Ray: its epoch costs, the thread that draws
each epoch's pictures while the next epoch trains, and the val inputs kept between epochs."""

import threading

import numpy as np
import pytest
import torch

from pairsim.train.hooks import EpochPictures, epoch_costs
from pairsim.train.worker import ValInputs


def test_pictures_draw_in_one_background_thread_in_order_and_close_waits_for_the_last():
    drawn, release = [], threading.Event()
    pictures = EpochPictures()
    pictures.submit(lambda: drawn.append(("epoch 1", threading.current_thread().name)))
    pictures.submit(lambda: (release.wait(5), drawn.append(("epoch 2", threading.current_thread().name))))
    assert [epoch for epoch, _ in drawn] == ["epoch 1"]  # the second submit waited for the first only
    release.set()
    pictures.close()
    assert [epoch for epoch, _ in drawn] == ["epoch 1", "epoch 2"]
    assert all(name.startswith("pairsim-pictures") and name != threading.main_thread().name for _, name in drawn)


def test_a_drawing_error_is_raised_at_the_next_epoch_or_at_close():
    def fail():
        raise ValueError("no gallery")

    pictures = EpochPictures()
    pictures.submit(fail)
    with pytest.raises(ValueError, match="no gallery"):
        pictures.submit(lambda: None)
    pictures.submit(fail)
    with pytest.raises(ValueError, match="no gallery"):
        pictures.close()


def test_epoch_costs_put_validation_against_training():
    costs = epoch_costs(8.0, 1.0, torch.device("cpu"))
    assert costs == {"perf/train_epoch_s": 8.0, "perf/val_s": 1.0, "perf/val_share": 0.125}  # no GPU, no GPU memory


def val_batches(n_batches: int, rows: int = 4):
    """What Ray Data gives a worker for the val split: image batches (uint8 pixels), then caption
    batches (tokens), each with its ids."""
    images = [{"image_id": np.array([f"im{b}-{i}" for i in range(rows)]), "label": np.zeros(rows, dtype=np.int64),
               "pixels": np.full((rows, 3, 8, 8), b, dtype=np.uint8)} for b in range(n_batches)]
    texts = [{"image_id": np.array([f"im{b}-{i}" for i in range(rows)]), "caption_index": np.zeros(rows, dtype=np.int64),
              "tokens": np.full((rows, 5), b, dtype=np.int64)} for b in range(n_batches)]
    return images + texts


def test_val_inputs_are_read_once_and_kept_on_the_device_when_they_fit():
    reads = []
    batches = val_batches(3)

    def read():
        reads.append(1)
        yield from batches

    inputs = ValInputs(read, budget_bytes=10**6, device=torch.device("cpu"))
    first, second = list(inputs), list(inputs)
    assert len(reads) == 1 and len(first) == len(second) == 6
    for given, kept in zip(batches, second):
        assert set(given) == set(kept)
        for key, value in given.items():
            if key in ("pixels", "tokens"):
                assert isinstance(kept[key], torch.Tensor) and torch.equal(kept[key], torch.from_numpy(value))
            else:
                assert kept[key] is value  # ids stay on the host


def test_val_inputs_over_their_budget_are_read_every_epoch_and_never_kept():
    reads = []
    batches = val_batches(3)
    one_pass = sum(b[k].nbytes for b in batches for k in ("pixels", "tokens") if k in b)

    def read():
        reads.append(1)
        yield from batches

    inputs = ValInputs(read, budget_bytes=one_pass - 1, device=torch.device("cpu"))
    assert [list(b) for b in inputs] == [list(b) for b in batches] and len(reads) == 1
    assert list(inputs) and len(reads) == 2 and inputs.kept is None and not inputs.keeping
    assert ValInputs(read, budget_bytes=0, device=torch.device("cpu")).kept is None
    assert ValInputs(read, budget_bytes=one_pass, device=torch.device("cpu")).keeping  # exactly fits
