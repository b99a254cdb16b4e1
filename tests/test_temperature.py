"""A learnable temperature driven past its bound comes back as soon as its gradient says so: in
plain torch (any optimizer, through the global post-step hook) and inside DeepSpeed engines at
ZeRO 0, 2 and 3 (fp32, bf16, fp16), on 2 gloo ranks; so does any :class:`Bounded` scalar (the
sigmoid loss's bias). Clamping only where τ is used fails these: the
gradient past the bound is zero and the stored value never returns."""

import pytest
import torch

from conftest import on_gloo_ranks
from pairsim.losses import Bounded, Temperature

LOW, HIGH = 0.01, 0.1


def drive(optimizer_step, loss_of, stored, pushes=(-1.0, 1.0)):
    """Push τ up with a large step, then pull it down; returns [stored τ after the push, after the pull]."""
    history = []
    for push in pushes:  # loss = push · τ: first up past the max, then down
        optimizer_step(loss_of(push))
        history.append(stored())
    return history


@pytest.mark.parametrize("optimizer,lr,pushes", [(torch.optim.SGD, 0.02, (-10.0, 1.0)),
                                                 (torch.optim.AdamW, 0.5, (-1.0, 1.0)),  # Adam's momentum: m₂ > 0
                                                 (torch.optim.Adagrad, 0.1, (-10.0, 1.0))])
def test_temperature_returns_from_its_bound_under_any_torch_optimizer(optimizer, lr, pushes):
    tau = Temperature(0.05, LOW, HIGH)
    opt = optimizer(tau.parameters(), lr=lr)  # the push's step overshoots the max by ≥ 0.1

    def step(loss):
        opt.zero_grad()
        loss.backward()
        opt.step()

    at_bound, after = drive(step, lambda push: push * tau(), lambda: tau.value.item(), pushes)
    assert at_bound == pytest.approx(HIGH)  # the large step was clamped on the stored value
    assert LOW <= after < HIGH  # and the gradient pulled it back inside
    assert tau().item() == pytest.approx(after)


def test_a_bias_of_any_sign_returns_from_its_bound_as_a_temperature_does():
    """A :class:`Bounded` scalar (the sigmoid loss's bias, in [−20, 0]) under the same hook."""
    bias = Bounded(-10.0, -20.0, 0.0)
    opt = torch.optim.SGD(bias.parameters(), lr=2.0)

    def step(loss):
        opt.zero_grad()
        loss.backward()
        opt.step()

    at_bound, after = drive(step, lambda push: push * bias(), lambda: bias.value.item(), (10.0, -1.0))
    assert at_bound == pytest.approx(-20.0)  # pushed down by 20, clamped on the stored value
    assert -20.0 < after <= 0.0 and bias().item() == pytest.approx(after)


def test_gradient_flows_at_and_beyond_a_bound():
    tau = Temperature(0.1, LOW, HIGH)
    (2.0 * tau()).backward()
    assert tau.value.grad.item() == 2.0  # torch's clamp would give 0 at the bound
    with torch.no_grad():
        tau.value.fill_(5.0)  # set by hand, past the bound: used clamped, still with a gradient
    tau.value.grad = None
    (3.0 * tau()).backward()
    assert tau().item() == pytest.approx(HIGH) and tau.value.grad.item() == 3.0


def test_fixed_temperature_and_other_parameters_are_left_alone():
    tau, fixed = Temperature(0.05, LOW, HIGH), Temperature(0.5, 0.1, 1.0, learnable=False)
    other = torch.nn.Parameter(torch.tensor([7.0]))
    opt = torch.optim.SGD([tau.value, other], lr=1.0)
    (-10.0 * tau() - 10.0 * other.sum()).backward()
    opt.step()
    assert tau.value.item() == pytest.approx(HIGH) and other.item() == pytest.approx(17.0)
    assert fixed.value.requires_grad is False and fixed().item() == pytest.approx(0.5)


# ------------------------------------------------------------------------------------ DeepSpeed

ENGINES = [(0, "fp32"), (0, "bf16"), (0, "fp16"), (2, "bf16"), (3, "fp32"), (3, "bf16")]


class TemperatureModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = Temperature(0.05, LOW, HIGH)
        self.bias = Bounded(-0.05, -HIGH, -LOW)  # τ's mirror image: driven below its min as τ above its max
        self.linear = torch.nn.Linear(4, 4)  # something for ZeRO to partition beside τ

    def forward(self, x, push):
        return push * (self.temperature() - self.bias()) + 0.0 * self.linear(x).sum()


def _deepspeed_worker(rank, world):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from pairsim.train.engine import clamp_temperatures

    results = {}
    for stage, precision in ENGINES:
        torch.manual_seed(0)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1.0, "weight_decay": 0.0, "torch_adam": True}},
                  "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=TemperatureModel(), config=config)
        x = torch.ones(1, 4, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
        biases = []

        def step(loss, engine=engine, biases=biases):
            engine.backward(loss)
            engine.step()
            clamp_temperatures(engine)
            biases.append(stored(engine.module.bias)[0])

        def stored(scalar):
            master = safe_get_full_fp32_param(scalar.value)  # None at ZeRO-0: the module's copy is read instead
            return float(master) if master is not None else scalar.value.item(), scalar().item()

        temperature = engine.module.temperature
        results[stage, precision] = drive(step, lambda push, engine=engine, x=x: engine(x, push),
                                          lambda temperature=temperature: stored(temperature))
        results[stage, precision, "bias"] = biases
        clamp_temperatures(engine, to_init=True)  # a PBT clone with a mutated τ init: collective at ZeRO-3
        forward = engine(x, 1.0).item() + engine.module.bias().item()  # the next forward's τ: (τ − b) + b
        results[stage, precision, "reset"] = (*stored(temperature), forward)
        results[stage, precision, "bias reset"] = stored(engine.module.bias)
    return results


@pytest.fixture(scope="module")
def deepspeed_results():
    return on_gloo_ranks(_deepspeed_worker)


@pytest.mark.parametrize("stage,precision", ENGINES)
def test_temperature_returns_from_its_bound_in_a_deepspeed_engine(stage, precision, deepspeed_results):
    digits = 1e-6 if stage > 0 or precision == "fp32" else 4e-3  # ZeRO-0: the bf16/fp16 module copy is read
    for rank, results in deepspeed_results.items():
        (master_at_bound, used_at_bound), (master_after, used_after) = results[stage, precision]
        assert master_at_bound == pytest.approx(HIGH, rel=digits), f"rank {rank}: stored τ not clamped"
        assert used_at_bound == pytest.approx(HIGH, rel=1e-6)
        assert LOW <= master_after < HIGH * 0.9, f"rank {rank}: τ did not come back ({master_after})"
        assert used_after == pytest.approx(master_after, rel=1e-2)  # bf16 module copy: 3 digits
        # the bias, τ's mirror image in [−0.1, −0.01], clamped below its min and back as τ is
        assert results[stage, precision, "bias"] == pytest.approx([-master_at_bound, -master_after], rel=digits)


@pytest.mark.parametrize("stage,precision", ENGINES)
def test_temperature_is_set_back_to_its_init_in_a_deepspeed_engine(stage, precision, deepspeed_results):
    """``clamp_temperatures(engine, to_init=True)`` after training moved τ: the stored value
    (fp32 master, or the module's copy at ZeRO-0) and the value the next forward uses are the
    configured init (0.05) on every rank."""
    digits = 1e-6 if stage > 0 or precision == "fp32" else 4e-3
    for rank, results in deepspeed_results.items():
        master, used, forward = results[stage, precision, "reset"]
        assert master == pytest.approx(0.05, rel=digits), f"rank {rank}: stored τ {master}"
        assert used == pytest.approx(0.05, rel=1e-2) and forward == pytest.approx(0.05, rel=1e-2), (rank, used, forward)
        assert results[stage, precision, "bias reset"] == pytest.approx((-0.05, -0.05), rel=max(digits, 1e-2))
