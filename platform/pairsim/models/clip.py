"""open_clip models: any registered architecture by name plus pairsim's own small ones, their
image preprocessing (split so that the float work runs on the worker's device), tokenizers
and weight files.

pairsim ships ``pairsim-tiny`` (64 px ViT, 3+3 layers, d=128) for tests and the demo; it is
registered in open_clip's model registry on import, so ``open_clip.create_model_and_transforms(
"pairsim-tiny", pretrained=<exported file>)`` works anywhere pairsim is imported.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import open_clip
import torch
from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict
from torchvision import transforms

from pairsim.config import ConfigError, ModelConfig

BUILTIN_CONFIGS = Path(__file__).parent / "model_configs"
SCALAR_PARAMS = {"logit_scale", "logit_bias"}  # 0-dim in open_clip models
open_clip.add_model_config(BUILTIN_CONFIGS)


def check_model_config(cfg: ModelConfig) -> None:
    """Fail on the driver, naming the field, if the architecture or weights cannot be found."""
    if open_clip.get_model_config(cfg.arch) is None:
        raise ConfigError(f"model.arch: unknown open_clip architecture {cfg.arch!r}")
    if cfg.pretrained and not os.path.isfile(cfg.pretrained):
        tags = open_clip.list_pretrained_tags_by_model(cfg.arch)
        if cfg.pretrained not in tags:
            raise ConfigError(
                f"model.pretrained: {cfg.pretrained!r} is neither a file (there is none at "
                f"{os.path.abspath(cfg.pretrained)}) nor an open_clip tag of {cfg.arch} (tags: {tags or 'none'})"
            )


def create_model(cfg: ModelConfig) -> torch.nn.Module:
    """The open_clip model, fp32 on CPU; DeepSpeed moves and casts it.

    open_clip's scalar parameters (``logit_scale``, ``logit_bias``) become shape [1]: DeepSpeed
    0.19 broadcasts parameters as byte views, which 0-dim tensors do not allow.
    :func:`save_open_clip_weights` gives them back their scalar shape.
    """
    model = open_clip.create_model(cfg.arch, pretrained=cfg.pretrained, output_dict=True)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim == 0:
                setattr(module, name, torch.nn.Parameter(param.detach().reshape(1), param.requires_grad))
    return model


def lock_towers(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Freeze the towers ``cfg`` locks, the last ``lock_image_unlocked_groups`` /
    ``lock_text_unlocked_layers`` left trainable, with open_clip's own ``lock_image_tower`` /
    ``lock_text_tower`` (LiT: Zhai et al., "LiT: Zero-Shot Transfer with Locked-image text
    Tuning", CVPR 2022)."""
    if cfg.lock_image:
        model.lock_image_tower(unlocked_groups=cfg.lock_image_unlocked_groups)
    if cfg.lock_text:
        model.lock_text_tower(unlocked_layers=cfg.lock_text_unlocked_layers)


def compile_towers(model: torch.nn.Module) -> None:
    """``torch.compile`` the image and text towers in place (``nn.Module.compile``: parameter
    names and checkpoints unchanged); the projections, pooling and heads around them run eagerly.
    Compilation happens at the first forward of each input shape."""
    for tower in (model.visual, model.transformer if hasattr(model, "transformer") else model.text):
        tower.compile()


def preprocess_cfg(cfg: ModelConfig) -> PreprocessCfg:
    """The model's image preprocessing, derived as open_clip does, without building the model."""
    model_cfg = open_clip.get_model_config(cfg.arch)
    merged = merge_preprocess_dict(PreprocessCfg(size=model_cfg["vision_cfg"]["image_size"]),
                                   model_cfg.get("preprocess_cfg", {}))
    if cfg.pretrained and not os.path.isfile(cfg.pretrained):
        merged = merge_preprocess_dict(merged, open_clip.get_pretrained_cfg(cfg.arch, cfg.pretrained))
    return PreprocessCfg(**merged)


def _uint8_chw(image) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


def image_transforms(cfg: ModelConfig, augment: bool):
    """(train, eval) PIL image → uint8 [3, H, W] array: open_clip's random-resized-crop train
    transform or its resize + centre-crop eval transform, up to (not including) its
    ``ToTensor`` and ``Normalize``, which :class:`PixelNormalizer` applies on the worker's
    device — so a quarter of the bytes go through Ray's object store."""
    pp = preprocess_cfg(cfg)
    out = []
    for is_train in (augment, False):
        steps = image_transform_v2(pp, is_train=is_train).transforms
        names = [type(t).__name__ for t in steps[-2:]]
        if names != ["MaybeToTensor", "Normalize"]:
            raise RuntimeError(f"open_clip's transform no longer ends in ToTensor + Normalize: {steps}")
        out.append(transforms.Compose([*steps[:-2], _uint8_chw]))
    return tuple(out)


class PixelNormalizer:
    """The end of open_clip's transform on the device: uint8 pixels → ``(x / 255 − mean) / std``
    in float32, then cast to the model's ``dtype``."""

    def __init__(self, cfg: ModelConfig):
        pp = preprocess_cfg(cfg)
        self.mean = torch.tensor(pp.mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(pp.std, dtype=torch.float32).view(1, -1, 1, 1)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, pixels: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if pixels.device not in self._on_device:  # copied once: a blocking host→GPU copy per step stalls it
            self._on_device[pixels.device] = (self.mean.to(pixels.device), self.std.to(pixels.device))
        mean, std = self._on_device[pixels.device]
        return ((pixels.float() / 255.0 - mean) / std).to(dtype)


@functools.lru_cache(maxsize=4)
def tokenizer(arch: str):
    """The architecture's open_clip tokenizer, built once per process."""
    return open_clip.get_tokenizer(arch)


def save_open_clip_weights(state_dict: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write fp32 weights that ``open_clip.create_model_and_transforms(arch, pretrained=path)`` loads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().float().cpu().contiguous() for k, v in state_dict.items()}
    for key in SCALAR_PARAMS & weights.keys():
        weights[key] = weights[key].reshape(())
    torch.save(weights, path)
    return path



def embed_dim(arch: str) -> int:
    """The width of the architecture's joint embedding."""
    return open_clip.get_model_config(arch)["embed_dim"]
