"""pairsim.dist: every collective runs on the backend's device, whatever device the caller's
tensors are on, and the results come back where they came from."""

import pytest
import torch
import torch.distributed

from conftest import on_gloo_ranks
from pairsim import dist


def test_backends_reduce_on_their_own_device():
    assert dist.collective_device("gloo") == torch.device("cpu")
    assert dist.collective_device("GLOO") == torch.device("cpu")
    if torch.cuda.is_available():
        assert dist.collective_device("nccl") == torch.device("cuda", torch.cuda.current_device())


def test_one_process_needs_no_process_group():
    assert (dist.rank(), dist.world_size(), dist.is_distributed()) == (0, 1, False)
    x = torch.arange(3.0)
    assert dist.all_reduce(x) is x and dist.all_gather(x) is x and dist.all_true(False) is False
    assert dist.mean_over_ranks({"a": torch.tensor(2.0)}) == {"a": 2.0}


def _worker(rank, world):
    seen = []  # (collective, device) of every tensor pairsim hands to torch.distributed
    real = {name: getattr(torch.distributed, name) for name in ("all_reduce", "all_gather_single")}

    def spy(name):
        def call(*args, **kwargs):
            seen.append((name, str(args[0].device)))
            return real[name](*args, **kwargs)
        return call

    for name in real:
        setattr(torch.distributed, name, spy(name))
    x = torch.tensor([[1.0, 2.0]]) * (rank + 1)
    x.requires_grad_(True)
    gathered = dist.all_gather(x)
    (gathered * torch.tensor([[1.0], [10.0]])).sum().backward()  # loss reads both ranks' rows
    result = {
        "gathered": gathered.tolist(),
        "grad": x.grad.tolist(),
        "mean": dist.mean_over_ranks({"v": torch.tensor(float(rank))}),
        "all_true": [dist.all_true(True), dist.all_true(rank == 0)],
        "device": str(dist.collective_device()),
        "seen": seen,
    }
    for name, call in real.items():
        setattr(torch.distributed, name, call)
    return result


@pytest.fixture(scope="module")
def two_ranks():
    return on_gloo_ranks(_worker, timeout=60)


def test_collectives_agree_across_ranks(two_ranks):
    for rank, r in two_ranks.items():
        assert r["gathered"] == [[1.0, 2.0], [2.0, 4.0]]
        # d/dx of sum(gathered · w) summed over both ranks' losses: 2 × this rank's weight
        assert r["grad"] == [[2.0 * (1.0, 10.0)[rank]] * 2]
        assert r["mean"] == {"v": 0.5}
        assert r["all_true"] == [True, False]


def test_every_collective_tensor_is_on_the_backends_device(two_ranks):
    for r in two_ranks.values():
        assert r["device"] == "cpu"
        names = [name for name, _ in r["seen"]]
        assert names.count("all_gather_single") == 1 and names.count("all_reduce") == 4
        assert {device for _, device in r["seen"]} == {r["device"]}
