import open_clip
import pytest
import torch

from pairsim.models import clip
from pairsim.config import ConfigError, ModelConfig


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
