"""Pair-similarity losses: functions of similarity matrices (:mod:`.functional`) and modules over
the global batch that own their temperatures and compose into one objective (:mod:`.modules`)."""

from pairsim.losses import functional
from pairsim.losses.modules import (
    BatchLoss,
    CUSALoss,
    GCLLoss,
    ImageTextLoss,
    InfoNCE,
    Objective,
    Temperature,
    TripletHN,
    Unified,
    build_objective,
)

__all__ = ["functional", "BatchLoss", "CUSALoss", "GCLLoss", "ImageTextLoss", "InfoNCE", "Objective",
           "Temperature", "TripletHN", "Unified", "build_objective"]
