"""open_clip models: any registered architecture by name, plus pairsim's own small ones,
wrapped as a :class:`RetrievalModel` with a fusion module and optional heads.

pairsim ships ``pairsim-tiny`` (64 px ViT, 3+3 layers, d=128) for tests and the demo; it is
registered in open_clip's model registry on import, so ``open_clip.create_model_and_transforms(
"pairsim-tiny", pretrained=<exported file>)`` works anywhere pairsim is imported.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
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
                f"model.pretrained: {cfg.pretrained!r} is neither a file nor an open_clip tag "
                f"of {cfg.arch} (tags: {tags or 'none'})"
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

    def __call__(self, pixels: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        mean, std = self.mean.to(pixels.device), self.std.to(pixels.device)
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


class ScoreSumFusion(torch.nn.Module):
    """The fused image+text embedding of UniIR's CLIP-SF (score fusion), as GCL uses for dual
    encoders: normalize(normalize(image) + normalize(text))."""

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return F.normalize(F.normalize(image, dim=-1) + F.normalize(text, dim=-1), dim=-1)


# Fusion modules by ``model.fusion`` name: each maps (image [B, d], text [B, d]) to fused [B, d].
# A model with a native fused encoder (VISTA-like) registers its own here.
FUSIONS: dict[str, type[torch.nn.Module]] = {"score_sum": ScoreSumFusion}


def projection_head(dim: int) -> torch.nn.Sequential:
    """LayerNorm + Linear(d, d): CUSA's per-tower head."""
    return torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim))


class RetrievalModel(torch.nn.Module):
    """An open_clip model plus the pieces pairsim's objectives read.

    ``forward(image=None, text=None)`` returns a dict with ``image`` and ``text`` (cross-modal
    embeddings, after the optional cross-modal heads), ``fused`` (when both are given and the
    model has a fusion module: only GCL reads it) and
    ``image_unimodal`` / ``text_unimodal`` (when uni-modal heads exist). open_clip's own
    ``logit_scale`` is frozen: the losses own their temperatures and scales.

    The open_clip forward is what runs (not ``encode_*`` alone), so DeepSpeed ZeRO-3 gathers the
    parameters the CLIP module holds directly (positional embedding, text projection).
    """

    def __init__(self, clip: torch.nn.Module, dim: int, fusion: str | None = None, crossmodal_heads: bool = False,
                 unimodal_heads: bool = False):
        super().__init__()
        self.clip = clip
        for name in SCALAR_PARAMS:
            if isinstance(getattr(clip, name, None), torch.nn.Parameter):
                getattr(clip, name).requires_grad_(False)
        self.fusion = FUSIONS[fusion]() if fusion else None
        self.cross_heads = torch.nn.ModuleDict(
            {"image": projection_head(dim), "text": projection_head(dim)}) if crossmodal_heads else None
        self.unimodal_heads = torch.nn.ModuleDict(
            {"image": projection_head(dim), "text": projection_head(dim)}) if unimodal_heads else None

    def forward(self, image: torch.Tensor | None = None, text: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        clip_out = self.clip(image=image, text=text)
        out = {}
        for modality, features in (("image", clip_out.get("image_features")), ("text", clip_out.get("text_features"))):
            if features is None:
                continue
            out[modality] = self.cross_heads[modality](features) if self.cross_heads is not None else features
            if self.unimodal_heads is not None:
                out[f"{modality}_unimodal"] = self.unimodal_heads[modality](features)
        if self.fusion is not None and image is not None and text is not None:
            out["fused"] = self.fusion(out["image"], out["text"])
        return out


def create_retrieval_model(cfg: ModelConfig, fused: bool = False, unimodal_heads: bool = False) -> RetrievalModel:
    """The configured open_clip model with its heads, and ``cfg.fusion`` when the objective reads
    fused embeddings (GCL) and uni-modal heads when it reads those (CUSA)."""
    dim = open_clip.get_model_config(cfg.arch)["embed_dim"]
    return RetrievalModel(create_model(cfg), dim, cfg.fusion if fused else None, cfg.crossmodal_heads, unimodal_heads)


def open_clip_state(state_dict: dict[str, torch.Tensor], prefix: str = "clip.") -> dict[str, torch.Tensor]:
    """The open_clip part of a :class:`RetrievalModel` state dict, with open_clip's own key names."""
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def model_card(cfg: ModelConfig, model: RetrievalModel, **extra: Any) -> dict[str, Any]:
    """What rebuilds ``model`` around exported weights (JSON-ready), plus ``extra`` facts."""
    return {"model": cfg.model_dump(mode="json"), "fused": model.fusion is not None,
            "unimodal_heads": model.unimodal_heads is not None, **extra}


def exported_files(weights: str | Path) -> tuple[Path, Path, Path]:
    """(open_clip weights, heads side file, model card) of an export: ``model.pt``,
    ``model.heads.pt``, ``model.json``."""
    weights = Path(weights)
    return weights, weights.with_suffix(".heads.pt"), weights.with_suffix(".json")


def write_exported(card: dict[str, Any], state_dict: dict[str, torch.Tensor], weights: str | Path) -> list[Path]:
    """Write a :class:`RetrievalModel` state dict as open_clip weights (loadable by
    ``open_clip.create_model_and_transforms(arch, pretrained=weights)``), its heads in a side
    file (when it has any) and its card; returns the files written."""
    weights, heads_file, card_file = exported_files(weights)
    written = [save_open_clip_weights(open_clip_state(state_dict), weights)]
    heads = {k: v.detach().float().cpu() for k, v in state_dict.items() if not k.startswith("clip.")}
    if heads:
        torch.save(heads, heads_file)
        written.append(heads_file)
    card_file.write_text(json.dumps(card, indent=2))
    return written + [card_file]


def load_exported(weights: str | Path) -> tuple[RetrievalModel, dict[str, Any]]:
    """The :class:`RetrievalModel` (eval mode, fp32) and card of an export written by
    :func:`write_exported`; the open_clip weights go through open_clip's own loader."""
    weights, heads_file, card_file = exported_files(weights)
    if not card_file.is_file():
        raise FileNotFoundError(f"{card_file}: no model card beside {weights} (not a pairsim export?)")
    card = json.loads(card_file.read_text())
    cfg = ModelConfig.model_validate(card["model"] | {"pretrained": str(weights)})
    model = create_retrieval_model(cfg, fused=card["fused"], unimodal_heads=card["unimodal_heads"])
    if heads_file.is_file():
        missing, unexpected = model.load_state_dict(torch.load(heads_file, map_location="cpu"), strict=False)
        missing = [k for k in missing if not k.startswith("clip.")]
        if missing or unexpected:
            raise ValueError(f"{heads_file}: heads do not fit the model card (missing {missing}, "
                             f"unexpected {unexpected})")
    elif model.cross_heads is not None or model.unimodal_heads is not None:
        raise FileNotFoundError(f"{heads_file}: the model card names heads, but their file is missing")
    return model.eval(), card


def fusion_module(model: RetrievalModel, cfg: ModelConfig) -> torch.nn.Module:
    """The model's own fusion module, else the configured one (the evaluation's image+text items)."""
    return model.fusion if model.fusion is not None else FUSIONS[cfg.fusion]()
