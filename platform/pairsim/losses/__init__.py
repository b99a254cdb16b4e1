"""Pair-similarity losses: functions of similarity matrices (:mod:`.functional`) and modules over
the global batch that own their temperatures and compose into one objective (:mod:`.modules`)."""

from pairsim.losses import functional
from pairsim.losses.modules import (
    BaseLoss,
    BatchLoss,
    CUSALoss,
    GCLLoss,
    ImageTextLoss,
    InfoNCE,
    Objective,
    Structure,
    Temperature,
    TripletHN,
    Unified,
    build_base,
    build_objective,
)

__all__ = ["functional", "BaseLoss", "BatchLoss", "CUSALoss", "GCLLoss", "ImageTextLoss", "InfoNCE", "Objective",
           "Structure", "Temperature", "TripletHN", "Unified", "build_base", "build_objective"]
