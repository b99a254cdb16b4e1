"""Training: the driver (:mod:`.driver`: config → checks → Ray → ``TorchTrainer`` → result), the
per-worker loop (:mod:`.worker`) and the DeepSpeed engine with its checkpoints (:mod:`.engine`)."""
