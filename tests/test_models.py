import open_clip
import pytest
import torch

from conftest import on_gloo_ranks
from pairsim.config import ConfigError, ModelConfig
from pairsim.models import clip, retrieval


def test_exported_weights_are_a_pretrained_file_for_both_open_clip_and_pairsim(tmp_path):
    torch.manual_seed(0)
    source = clip.create_model(ModelConfig())
    path = clip.save_open_clip_weights(source.state_dict(), tmp_path / "w.pt")
    assert torch.load(path)["logit_scale"].shape == ()  # open_clip's own scalar shape

    reloaded = clip.create_model(ModelConfig(pretrained=str(path)))
    plain, _, preprocess = open_clip.create_model_and_transforms("pairsim-tiny", pretrained=str(path))
    pixels = torch.randn(2, 3, 64, 64)
    tokens = clip.tokenizer("pairsim-tiny")(["a red circle", "a blue square above a green cross"])
    def embed(model):  # what open_clip's forward returns as image and text features
        model.eval()
        return model.encode_image(pixels, normalize=True), model.encode_text(tokens, normalize=True)

    with torch.no_grad():
        expected = embed(source)
        for model in (reloaded, plain):
            for got, want in zip(embed(model), expected):
                torch.testing.assert_close(got, want)


def test_unknown_arch_and_missing_weights_name_their_field(tmp_path):
    with pytest.raises(ConfigError, match="model.arch"):
        clip.check_model_config(ModelConfig(arch="ViT-Nope"))
    with pytest.raises(ConfigError, match="model.pretrained"):
        clip.check_model_config(ModelConfig(pretrained=str(tmp_path / "missing.pt")))
    clip.check_model_config(ModelConfig(arch="ViT-B-32", pretrained="openai"))  # a known tag passes


def test_uint8_transforms_then_normalizing_equal_open_clips_transforms():
    """Ray Data ships uint8 pixels; PixelNormalizer finishes open_clip's transform on the device."""
    import numpy as np
    from open_clip.transform import image_transform_v2
    from PIL import Image

    cfg = ModelConfig()
    pp = clip.preprocess_cfg(cfg)
    train_tf, eval_tf = clip.image_transforms(cfg, augment=True)
    pixels = np.random.default_rng(0).integers(0, 256, (80, 100, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    assert train_tf(image).shape == eval_tf(image).shape == pp.input_size
    assert eval_tf(image).dtype == np.uint8
    ours = clip.PixelNormalizer(cfg)(torch.from_numpy(eval_tf(image))[None])[0]
    torch.testing.assert_close(ours, image_transform_v2(pp, is_train=False)(image), rtol=0, atol=1e-6)
    torch.manual_seed(3)
    augmented = clip.PixelNormalizer(cfg)(torch.from_numpy(train_tf(image))[None])[0]
    torch.manual_seed(3)
    torch.testing.assert_close(augmented, image_transform_v2(pp, is_train=True)(image), rtol=0, atol=1e-6)
    assert clip.PixelNormalizer(cfg)(torch.from_numpy(eval_tf(image))[None], torch.bfloat16).dtype == torch.bfloat16


def _tiny_inputs(seed: int, rows: int = 4):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 1000, (rows, 32), generator=g)
    tokens[:, 12:] = 0
    tokens[:, 11] = 49407  # the end-of-text token open_clip pools at
    return torch.randn(rows, 3, 64, 64, generator=g, dtype=torch.float64), tokens


def test_raw_sum_is_uniirs_sum_of_unnormalised_tower_outputs_in_float64():
    torch.manual_seed(0)
    model = retrieval.create_retrieval_model(ModelConfig(fusion="raw_sum"), fused=True).double().eval()
    with torch.no_grad():
        model.clip.text_projection.mul_(3)  # text outputs three times longer: the fusions must differ
    normalized = retrieval.create_retrieval_model(ModelConfig(fusion="normalized_sum"), fused=True).double().eval()
    normalized.load_state_dict(model.state_dict())
    pixels, tokens = _tiny_inputs(0)
    with torch.no_grad():
        out, plain = model(image=pixels, text=tokens), normalized(image=pixels, text=tokens)
        # the transcription: UniIR's CLIP-SF on open_clip's un-normalised tower outputs
        image, text = model.clip.encode_image(pixels), model.clip.encode_text(tokens)
        fused = (image + text) / (image + text).norm(dim=-1, keepdim=True)
        normalised = model.clip(image=pixels, text=tokens)  # what open_clip's forward returns
    torch.testing.assert_close(out["fused"], fused, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["image"], image, rtol=1e-12, atol=1e-12)
    for modality in ("image", "text"):  # normalised, the outputs are open_clip's features
        torch.testing.assert_close(torch.nn.functional.normalize(out[modality], dim=-1),
                                   normalised[f"{modality}_features"], rtol=1e-12, atol=1e-12)
    assert (text.norm(dim=-1) > 2 * image.norm(dim=-1)).all()
    text_unit = torch.nn.functional.normalize(text, dim=-1)  # raw_sum leans to the longer output
    assert ((out["fused"] * text_unit).sum(-1) > (plain["fused"] * text_unit).sum(-1) + 0.05).all()


def _zero3_gcl_raw_sum(rank, world):
    """The fused embeddings and the gradients of the CLIP module's direct parameters on two
    ranks under ZeRO-3 (each rank its own rows), and the loss of one process over all rows."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from pairsim.cli import objective_config
    from pairsim.config import load_config
    from pairsim.build import build_objective
    from pairsim.train.engine import TrainingModule, deepspeed_config

    cfg = load_config([objective_config("gcl_infonce")], ["train.zero_stage=3", "train.micro_batch_size=4"])
    assert cfg.model.fusion == "raw_sum"
    torch.manual_seed(0)
    module = TrainingModule(retrieval.create_retrieval_model(cfg.model, fused=True), build_objective(cfg.loss, rank, world))
    engine, *_ = deepspeed.initialize(model=module, config=deepspeed_config(cfg.train, cfg.optim, 10),
                                      model_parameters=[p for p in module.parameters() if p.requires_grad])
    pixels, tokens = _tiny_inputs(rank)
    out = engine(method="loss", image=pixels.float(), text=tokens, group_ids=torch.arange(4) + 4 * rank)
    engine.backward(out["loss"])
    names = ("model.clip.positional_embedding", "model.clip.text_projection")
    grads = {n: safe_get_full_grad(p).numpy().copy() for n, p in engine.module.named_parameters() if n in names}
    with torch.no_grad():
        fused = engine(image=pixels.float(), text=tokens)["fused"].numpy()
    return fused, grads, out["loss"].item()


@pytest.mark.slow
def test_raw_sum_under_zero3_on_two_ranks_equals_one_process():
    import numpy as np

    from pairsim.cli import objective_config
    from pairsim.config import load_config
    from pairsim.build import build_objective

    results = on_gloo_ranks(_zero3_gcl_raw_sum)
    cfg = load_config([objective_config("gcl_infonce")], [])
    torch.manual_seed(0)
    model = retrieval.create_retrieval_model(cfg.model, fused=True)
    objective = build_objective(cfg.loss)
    inputs = [_tiny_inputs(rank) for rank in range(2)]
    pixels, tokens = torch.cat([p for p, _ in inputs]).float(), torch.cat([t for _, t in inputs])
    loss = objective(**model(image=pixels, text=tokens), group_ids=torch.arange(8))["loss"]
    loss.backward()
    with torch.no_grad():
        fused = model(image=pixels, text=tokens)["fused"].numpy()
    for rank, (rank_fused, grads, rank_loss) in results.items():
        np.testing.assert_allclose(rank_fused, fused[4 * rank:4 * rank + 4], rtol=1e-4, atol=1e-5)
        assert rank_loss == pytest.approx(loss.item(), rel=1e-4)
        for name, param in (("model.clip.positional_embedding", model.clip.positional_embedding),
                            ("model.clip.text_projection", model.clip.text_projection)):
            assert np.abs(grads[name]).max() > 0, name
            np.testing.assert_allclose(grads[name], param.grad.numpy(), rtol=1e-3, atol=1e-6, err_msg=name)


def test_compiled_towers_keep_their_parameter_names_and_the_rest_stays_eager():
    """``train.compile``: the towers compile in place, so checkpoints and exports keep their
    keys; compilation itself waits for the first forward (on a GPU worker)."""
    model = clip.create_model(ModelConfig(arch="pairsim-tiny"))
    keys = list(model.state_dict())
    clip.compile_towers(model)
    assert list(model.state_dict()) == keys
    assert model.visual._compiled_call_impl is not None and model.transformer._compiled_call_impl is not None
    assert model._compiled_call_impl is None and model.ln_final._compiled_call_impl is None


def test_pixel_normaliser_works_on_the_pixels_device_and_copies_its_constants_once():
    normalize = clip.PixelNormalizer(ModelConfig(arch="pairsim-tiny"))
    pixels = torch.zeros(2, 3, 4, 4, dtype=torch.uint8, device="meta")
    out = normalize(pixels, torch.bfloat16)
    assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == pixels.shape
    mean = normalize._on_device[pixels.device][0]
    normalize(pixels)
    assert normalize._on_device[pixels.device][0] is mean  # no host→device copy per step
