"""One optimizer step over ``train.accumulate_steps`` micro-batches.

A contrastive loss over micro-batches accumulated one by one is not the loss over their union:
each micro-batch only sees its own rows as negatives. ``accumulate_mode: cache_features`` keeps
the union's loss with the gradient cache of Gao et al., "Scaling Deep Contrastive Learning
Batch Size under Memory Limited Setup" (RepL4NLP 2021, arXiv 2101.06983):

1. embed micro-batches 2..K without autograd and keep their features F₂..F_K;
2. micro-batch 1 forwards with autograd, and the objective scores [F₁, F₂, …, F_K] (the cached
   ones as leaves): its backward gives the parameters ∂L/∂F₁·∂F₁/∂θ, the temperatures ∂L/∂τ,
   and the cached leaves G_k = ∂L/∂F_k;
3. micro-batch k re-embeds with autograd (same RNG state as in 1) and backpropagates the
   surrogate Σ F_k·G_k, whose gradient is ∂L/∂F_k·∂F_k/∂θ.

The sum over the K backwards is the gradient of L on the union, exactly; memory is one
micro-batch's activations plus the K·B cached features. Cost: K − 1 extra forwards without
autograd. The towers' forward must be a function of their inputs and the RNG state (dropout is
replayed; BatchNorm statistics are updated twice).

The engine is a DeepSpeed engine over :class:`~pairsim.train.engine.TrainingModule` (or anything
with its ``__call__``, ``backward(loss, scale_wrt_gas)`` and ``step()``): features come from
``engine(image=..., text=...)``, loss terms from ``engine(method="loss", ...)``, and each
micro-batch's backward is followed by ``engine.step()``, which steps the optimizer at the K-th.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")

MicroBatch = dict[str, torch.Tensor]
"""Engine inputs of one micro-batch: ``image``, ``text``, ``group_ids`` and, for CUSA,
``teacher_image`` / ``teacher_text``."""

MODEL_INPUTS = ("image", "text")


def groups(batches: Iterable[T], size: int) -> Iterator[list[T]]:
    """``batches`` in lists of ``size`` (one optimizer step each); a last, shorter list is dropped."""
    group: list[T] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []


def train_step(engine, micro_batches: list[MicroBatch], cache_features: bool = True) -> dict[str, torch.Tensor]:
    """Forward, backward and ``engine.step()`` over ``micro_batches`` (one optimizer step);
    returns the objective's outputs — of the union with ``cache_features``, else averaged over
    the micro-batches, each of which is then its own contrastive batch (DeepSpeed scales each
    loss by 1/K)."""
    if cache_features and len(micro_batches) > 1:
        return _cached_features_step(engine, micro_batches)
    outputs = []
    for batch in micro_batches:
        out = engine(method="loss", **batch)
        terms = TermsOnHost(out)
        engine.backward(out["loss"])
        engine.step()
        terms.check()
        outputs.append({k: v.detach() for k, v in out.items()})
    if len(outputs) == 1:  # no accumulation: the step as it always was
        return outputs[0]
    return {k: torch.stack([out[k] for out in outputs]).mean(0) for k in outputs[0]}


def _cached_features_step(engine, micro_batches: list[MicroBatch]) -> dict[str, torch.Tensor]:
    first, rest = micro_batches[0], micro_batches[1:]
    rng_states, cached = [], []
    with torch.no_grad():
        for batch in rest:
            rng_states.append(_rng_state())
            cached.append(engine(**{k: batch[k] for k in MODEL_INPUTS}))
    leaves = {k: torch.cat([c[k] for c in cached]).requires_grad_() for k in cached[0]}
    targets = {k: torch.cat([b[k] for b in micro_batches]) for k in first if k not in MODEL_INPUTS}
    out = engine(method="loss", **{k: first[k] for k in MODEL_INPUTS}, cached_features=leaves, **targets)
    terms = TermsOnHost(out)
    engine.backward(out["loss"], scale_wrt_gas=False)
    engine.step()
    terms.check()
    offset = 0
    for batch, state in zip(rest, rng_states):
        _set_rng_state(state)
        features = engine(**{k: batch[k] for k in MODEL_INPUTS})
        rows = next(iter(features.values())).shape[0]
        surrogate = sum((features[k] * leaves[k].grad[offset:offset + rows]).sum() for k in features)
        engine.backward(surrogate, scale_wrt_gas=False)
        engine.step()
        offset += rows
    return {k: v.detach() for k, v in out.items()}


class TermsOnHost:
    """The objective's loss terms (``loss/...``), copied to host memory as soon as the forward has
    queued them, and checked after the step: a NaN or infinite term stops the run before its
    next step. The host waits for the copy, if at all, only once the step's backward and
    optimizer are queued behind it, so the device never idles for the check."""

    def __init__(self, out: dict[str, torch.Tensor]):
        self.names = [k for k in out if k.startswith("loss/")]
        values = torch.stack([out[k].detach().float() for k in self.names])
        self.values = values.to("cpu", non_blocking=True)
        self.copied = None
        if values.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def check(self) -> None:
        """Raise ``FloatingPointError`` naming each non-finite term."""
        if self.copied is not None:
            self.copied.synchronize()
        if not torch.isfinite(self.values).all():
            bad = {name: float(v) for name, v in zip(self.names, self.values) if not torch.isfinite(v)}
            raise FloatingPointError(f"non-finite loss terms {bad}; stopping the run")


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])
