"""Learnable temperatures (and a loss's other bounded scalars, SigLIP's bias) kept inside their
range by clamping the stored value after each step.

A temperature that is only clamped where it is used gets a zero gradient once the optimizer has
pushed its parameter past a bound, and stays stuck there. As the CUSA authors' code does
(``clamp_tau`` in ``unire/model.py``), :class:`Temperature` instead clamps the *stored* value after
every optimizer step, so a τ driven past a bound sits on it with a live gradient and leaves it
as soon as the gradient points back:

- any ``torch.optim`` optimizer holding a temperature's parameter: a post-step hook common to
  all optimizers (``register_optimizer_step_post_hook``) clamps it, nothing to call;
- a DeepSpeed engine, whose optimizer steps fp32 master copies (ZeRO-1/2/3 partitions, the bf16
  optimizer) rather than the module's parameter: :func:`pairsim.train.engine.clamp_temperatures`
  after ``engine.step()`` clamps both (pairsim's training loop calls it).

Between a step and its clamp the value in use is clamped too, with a straight-through gradient,
so the gradient is never zero at or beyond a bound.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from pairsim.losses.functional import fp32

_LIVE: weakref.WeakSet[Bounded] = weakref.WeakSet()


class Bounded(nn.Module):
    """A scalar in [min, max], learnable or fixed: a loss's temperature or bias.

    ``forward()`` returns it in float32 (a 0-dim tensor; bf16 engines included). The parameter
    ``value`` has shape [1] (DeepSpeed cannot broadcast 0-dim tensors). Stays in range under
    any optimizer (see the module docstring); :meth:`clamp_` clamps it by hand.
    """

    def __init__(self, init: float, min: float, max: float, learnable: bool = True):
        super().__init__()
        if not min <= init <= max:
            raise ValueError(f"{type(self).__name__.lower()} needs min <= init <= max, got {min}, {init}, {max}")
        self.init, self.min, self.max = init, min, max
        self.value = nn.Parameter(torch.tensor([float(init)]), requires_grad=learnable)
        _LIVE.add(self)

    def forward(self) -> torch.Tensor:
        value = fp32(self.value)
        # straight-through: the clamped value, the gradient of the stored one
        return (value + (value.clamp(self.min, self.max) - value).detach()).squeeze(0)

    @torch.no_grad()
    def clamp_(self) -> None:
        """Clamp the stored value into [min, max] (a no-op on a parameter ZeRO-3 has partitioned away)."""
        self.value.clamp_(self.min, self.max)

    def extra_repr(self) -> str:
        return f"min={self.min}, max={self.max}, learnable={self.value.requires_grad}"


class Temperature(Bounded):
    """A temperature τ ∈ [min, max], 0 < min: a :class:`Bounded` scalar that divides similarities."""

    def __init__(self, init: float, min: float, max: float, learnable: bool = True):
        if not 0 < min:
            raise ValueError(f"temperature needs 0 < min <= init <= max, got {min}, {init}, {max}")
        super().__init__(init, min, max, learnable)


def temperatures(module: nn.Module, fixed: bool = False) -> list[Bounded]:
    """The learnable :class:`Bounded` scalars of ``module`` — temperatures and biases — (``fixed``: all of them)."""
    return [m for m in module.modules() if isinstance(m, Bounded) and (fixed or m.value.requires_grad)]


def _clamp_after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not _LIVE:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for temperature in list(_LIVE):
        if id(temperature.value) in stepped:
            temperature.clamp_()


register_optimizer_step_post_hook(_clamp_after_step)
