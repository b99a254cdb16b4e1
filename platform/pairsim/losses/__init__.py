"""Pair-similarity losses: functions of similarity matrices (:mod:`.functional`), modules over
the global batch that own their temperatures and compose into one objective (:mod:`.modules`),
and the learnable temperatures that stay in their range under any optimizer (:mod:`.temperature`)."""

from pairsim.losses import functional
from pairsim.losses.modules import (
    BaseLoss,
    BatchLoss,
    CUSALoss,
    GCLLoss,
    ImageTextLoss,
    InfoNCE,
    Objective,
    Sigmoid,
    Structure,
    TripletHN,
    Unified,
)
from pairsim.losses.temperature import Bounded, Temperature, temperatures

__all__ = ["functional", "BaseLoss", "BatchLoss", "Bounded", "CUSALoss", "GCLLoss", "ImageTextLoss", "InfoNCE",
           "Objective", "Sigmoid", "Structure", "Temperature", "TripletHN", "Unified", "temperatures"]

