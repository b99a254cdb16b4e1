"""CUSA's frozen uni-modal teachers: the encoders (:mod:`.encoders`) and features extracted
from them ahead of training (:mod:`.store`)."""
