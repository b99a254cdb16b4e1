"""Gradient accumulation (pairsim.train.accumulation), locked towers, gradient checkpointing and
the DeepSpeed passthrough: the gradient-cache step equals the big batch in float64, on one
process and on two gloo ranks, and inside DeepSpeed engines (ZeRO-2 and 3)."""

import numpy as np
import pytest
import torch

from conftest import on_gloo_ranks
from pairsim.cli import objective_config
from pairsim.config import ConfigError, load_config
from pairsim.build import build_objective
from pairsim.models import clip
from pairsim.models.retrieval import create_retrieval_model
from pairsim.train import accumulation
from pairsim.train.engine import TrainingModule, check_deepspeed_config, deepspeed_config

K, B = 3, 4  # micro-batches per step, rows per micro-batch
OBJECTIVES = {"infonce": [], "gcl_unified": [],  # CUSA: soft labels from teacher embeddings that come with the batch
              "cusa_unified": ["loss.cusa.image_teacher={kind: initial_student}"]}


def run_config(objective: str, *overrides: str):
    return load_config([objective_config(objective)], ["model.crossmodal_heads=true", *overrides])


def training_module(cfg, rank: int = 0, world: int = 1, dtype=torch.float64) -> TrainingModule:
    torch.manual_seed(0)
    objective = build_objective(cfg.loss, rank, world)
    model = create_retrieval_model(cfg.model, fused="fused" in objective.needs,
                                   unimodal_heads="image_unimodal" in objective.needs)
    return TrainingModule(model, objective).to(dtype)


def micro_batches(seed: int, dtype=torch.float64, count: int = K, rows: int = B, first_group: int = 0):
    """``count`` micro-batches of random images and tokens; image ids repeat across micro-batches
    (two captions of one image in different micro-batches are positives of each other)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        tokens = torch.randint(1, 1000, (rows, 32), generator=g)
        tokens[:, 12:] = 0
        tokens[:, 11] = 49407  # the end-of-text token open_clip pools at
        groups = torch.arange(rows) + first_group + k * rows
        groups[0] = first_group  # shares an image with the first row of micro-batch 0
        out.append({"image": torch.randn(rows, 3, 64, 64, generator=g, dtype=dtype), "text": tokens,
                    "group_ids": groups, "teacher_image": torch.randn(rows, 6, generator=g, dtype=dtype),
                    "teacher_text": torch.randn(rows, 6, generator=g, dtype=dtype)})
    return out


def union(batches):
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def only_needed(module, batch):
    return {k: v for k, v in batch.items() if not k.startswith("teacher_") or k in module.objective.needs}


class TorchEngine:
    """What the accumulation step calls on a DeepSpeed engine, with plain autograd and
    DeepSpeed's gradient-accumulation scaling: backward divides the loss by K unless told not to."""

    def __init__(self, module: torch.nn.Module, accumulate_steps: int):
        self.module, self.accumulate_steps = module, accumulate_steps

    def __call__(self, **inputs):
        return self.module(**inputs)

    def backward(self, loss, scale_wrt_gas=True):
        (loss / self.accumulate_steps if scale_wrt_gas else loss).backward()

    def step(self):
        pass


def gradients(module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


def assert_same_gradients(got, expected, rtol=1e-9, atol=1e-12):
    assert got.keys() == expected.keys() and len(got) > 10
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_cached_features_step_is_the_big_batch_in_float64(objective):
    cfg = run_config(objective, *OBJECTIVES[objective])
    module = training_module(cfg)
    batches = [only_needed(module, b) for b in micro_batches(seed=1)]
    big = module.loss(**union(batches))
    big["loss"].backward()
    expected = gradients(module)

    out = accumulation.train_step(TorchEngine(module, K), batches, cache_features=True)
    torch.testing.assert_close(out["loss"], big["loss"].detach(), rtol=1e-12, atol=0)
    assert_same_gradients(gradients(module), expected)
    assert any("temperature" in name for name in expected) or objective == "gcl_unified"

    # each micro-batch its own contrastive batch: another gradient (what the cache is for)
    accumulation.train_step(TorchEngine(module, K), batches, cache_features=False)
    independent = gradients(module)
    assert not all(torch.allclose(independent[n], expected[n]) for n in expected)
    for batch in batches:  # ... which is the mean of the micro-batches' own gradients
        (module.loss(**batch)["loss"] / K).backward()
    assert_same_gradients(independent, gradients(module))


def _cached_step_on_rank(rank, world, objective):
    cfg = run_config(objective, *OBJECTIVES[objective])
    module = training_module(cfg, rank, world)
    batches = [only_needed(module, b) for b in micro_batches(seed=10 + rank, first_group=1000 * rank)]
    out = accumulation.train_step(TorchEngine(module, K), batches, cache_features=True)
    grads = gradients(module)
    for grad in grads.values():  # the data-parallel average DeepSpeed applies
        torch.distributed.all_reduce(grad)
        grad /= world
    return float(out["loss"]), {n: g.numpy() for n, g in grads.items()}


@pytest.mark.parametrize("objective", ["infonce", "cusa_unified"])
def test_cached_features_step_on_two_ranks_is_the_global_big_batch(objective):
    cfg = run_config(objective, *OBJECTIVES[objective])
    module = training_module(cfg)
    batches = [only_needed(module, b) for rank in range(2)
               for b in micro_batches(seed=10 + rank, first_group=1000 * rank)]
    big = module.loss(**union(batches))  # rank 0's micro-batches, then rank 1's: the gathered order
    big["loss"].backward()
    expected = gradients(module)
    for loss, grads in on_gloo_ranks(_cached_step_on_rank, objective).values():
        assert loss == pytest.approx(big["loss"].item(), rel=1e-12)
        assert_same_gradients({n: torch.from_numpy(g) for n, g in grads.items()}, expected)


class CountingEngine(TorchEngine):
    """A :class:`TorchEngine` that counts its optimizer steps."""

    steps = 0

    def step(self):
        self.steps += 1


@pytest.mark.parametrize("cache_features", [True, False])
def test_a_non_finite_term_stops_the_run_after_its_step_naming_the_term(cache_features):
    cfg = run_config("cusa_unified", *OBJECTIVES["cusa_unified"])
    module = training_module(cfg)
    batches = [only_needed(module, b) for b in micro_batches(seed=3)]
    batches[0]["teacher_text"][1] = float("nan")  # CUSA's uni-modal soft labels: loss/usa, not loss/base
    engine = CountingEngine(module, K)
    with pytest.raises(FloatingPointError) as failed:
        accumulation.train_step(engine, batches, cache_features=cache_features)
    assert "loss/usa" in str(failed.value) and "loss/base" not in str(failed.value)
    assert engine.steps == 1  # the first micro-batch's; no later one ran
    finite = [only_needed(module, b) for b in micro_batches(seed=3)]
    assert torch.isfinite(accumulation.train_step(CountingEngine(module, K), finite, cache_features)["loss"])


def test_groups_drop_a_short_last_group():
    assert list(accumulation.groups(range(7), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(accumulation.groups(range(2), 1)) == [[0], [1]]


# ------------------------------------------------------------------ locked towers, checkpointing

def test_locked_towers_leave_only_the_unlocked_parts_trainable():
    def trainable(*overrides):
        cfg = run_config("infonce", *overrides)
        model = create_retrieval_model(cfg.model)
        clip.lock_towers(model.clip, cfg.model)
        return {n.removeprefix("clip.") for n, p in model.named_parameters() if p.requires_grad}

    free = trainable()
    last = f"transformer.resblocks.{len(create_retrieval_model(run_config('infonce').model).clip.transformer.resblocks) - 1}."
    # open_clip's text groups from the end: the projection, then the last block with the final LayerNorm, ...
    for unlocked, text_trainable in ((0, set()), (1, {"text_projection"}),
                                     (2, {"text_projection", "ln_final.weight", "ln_final.bias"}
                                      | {n for n in free if n.startswith(last)})):
        got = trainable("model.lock_image=true", "model.lock_text=true", f"model.lock_text_unlocked_layers={unlocked}")
        assert not any(n.startswith("visual.") for n in got)
        assert {n for n in got if not n.startswith("cross_heads.")} == text_trainable
        assert any(n.startswith("cross_heads.") for n in got)  # pairsim's heads are not the towers

    visual = {n for n in trainable("model.lock_image=true", "model.lock_image_unlocked_groups=2") if n.startswith("visual.")}
    assert any(n.startswith("visual.transformer.resblocks.") for n in visual) and "visual.conv1.weight" not in visual
    assert visual < {n for n in free if n.startswith("visual.")}


def test_unlocked_groups_need_a_locked_tower():
    with pytest.raises(ConfigError) as exc:
        run_config("infonce", "model.lock_image_unlocked_groups=1")
    assert exc.value.keys == ("model.lock_image_unlocked_groups",) and "model.lock_image" in str(exc.value)


def test_gradient_checkpointing_gives_the_same_gradients():
    cfg = run_config("gcl_unified")
    module = training_module(cfg)
    batch = only_needed(module, union(micro_batches(seed=3)))
    module.loss(**batch)["loss"].backward()
    expected = gradients(module)
    module.model.clip.set_grad_checkpointing(True)
    module.loss(**batch)["loss"].backward()
    assert_same_gradients(gradients(module), expected)


# ------------------------------------------------------------------ DeepSpeed

def test_deepspeed_passthrough_is_merged_and_parsed_by_deepspeed():
    cfg = run_config("infonce", "train.accumulate_steps=4",
                     "train.deepspeed={zero_optimization: {overlap_comm: false, reduce_bucket_size: 1000000}}")
    ds = deepspeed_config(cfg.train, cfg.optim, total_steps=10)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": False, "reduce_bucket_size": 1000000}
    assert ds["gradient_accumulation_steps"] == 4
    check_deepspeed_config(ds)
    bad = run_config("infonce", "train.deepspeed={zero_optimization: {overlap_comms: true}}")
    with pytest.raises(ConfigError) as exc:
        check_deepspeed_config(deepspeed_config(bad.train, bad.optim, total_steps=10))
    assert exc.value.keys == ("train.deepspeed",) and "overlap_comms" in str(exc.value)  # the key, the bad one


@pytest.mark.parametrize("key,field", [("zero_optimization: {stage: 3}", "train.zero_stage"),
                                       ("gradient_accumulation_steps: 2", "train.accumulate_steps"),
                                       ("optimizer: {type: SGD}", "optim"),
                                       ("torch_autocast: {enabled: true}", "train.precision")])
def test_deepspeed_passthrough_refuses_keys_pairsim_sets(key, field):
    with pytest.raises(ConfigError, match=rf"train.deepspeed: .*\(set {field}"):
        run_config("infonce", f"train.deepspeed={{{key}}}")


def _deepspeed_gradients(rank, world):
    """Full gradients at the optimizer step of a DeepSpeed engine accumulating K micro-batches
    with the gradient cache, and of one engine taking their union as one micro-batch."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    class Probe:  # keeps the full gradients at the accumulation boundary, before the step
        def __init__(self, engine):
            self.engine, self.grads = engine, None

        def __call__(self, **inputs):
            return self.engine(**inputs)

        def backward(self, loss, **kwargs):
            self.engine.backward(loss, **kwargs)

        def step(self):
            if self.engine.is_gradient_accumulation_boundary():
                self.grads = {n: safe_get_full_grad(p).float().numpy().copy()
                              for n, p in self.engine.module.named_parameters() if p.requires_grad}
            self.engine.step()

    results = {}
    for stage, accumulate, rows in ((stage, *run) for stage in (2, 3) for run in ((K, B), (1, K * B))):
        cfg = run_config("gcl_unified", f"train.zero_stage={stage}", f"train.accumulate_steps={accumulate}",
                         f"train.micro_batch_size={rows}", "model.lock_text=true", "train.grad_checkpointing=true")
        module = training_module(cfg, rank, world, torch.float32)
        clip.lock_towers(module.model.clip, cfg.model)
        module.model.clip.set_grad_checkpointing(True)
        engine, *_ = deepspeed.initialize(model=module, config=deepspeed_config(cfg.train, cfg.optim, 10),
                                          model_parameters=[p for p in module.parameters() if p.requires_grad])
        batches = [only_needed(module, b) for b in micro_batches(20 + rank, torch.float32, first_group=1000 * rank)]
        probe = Probe(engine)
        accumulation.train_step(probe, batches if accumulate > 1 else [union(batches)])
        assert engine.global_steps == 1
        results[stage, accumulate] = probe.grads
    return results


@pytest.mark.slow
def test_deepspeed_accumulation_equals_the_big_batch_at_zero_2_and_3():
    for grads in on_gloo_ranks(_deepspeed_gradients).values():
        for stage in (2, 3):
            accumulated, big = grads[stage, K], grads[stage, 1]
            assert accumulated.keys() == big.keys() and not any(n.startswith("model.clip.transformer.") for n in big)
            for name in big:
                np.testing.assert_allclose(accumulated[name], big[name], rtol=1e-3, atol=1e-6, err_msg=f"{stage} {name}")
