"""Ray Train callbacks, which run on the Train controller.

The controller unpickles them (and everything else the trainer hands it) before it asks for
workers, so this module imports Ray alone: importing torch, open_clip or DeepSpeed there would
delay every run's workers by the seconds those imports take.
"""

from __future__ import annotations

from typing import Any

from ray.train import UserCallback


class TrialReporter(UserCallback):
    """A PBT or PB2 trial's bridge to Tune (:func:`pairsim.tune.trial.fit_reporting_checkpoints`):
    each epoch's rank-0 report and its checkpoint's path, handed to the trial function through
    ``queue`` (one at a time: the run waits for Tune to take it), which reports the checkpoint as
    the trial's Tune checkpoint. Ray's ``TuneReportCallback``, which FIFO and ASHA trials use,
    passes on only the checkpoint's path, and PBT clones a trial's Tune checkpoint."""

    def __init__(self, queue):
        self.queue = queue

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        self.queue.put((dict(metrics[0]), checkpoint.path if checkpoint else None))
