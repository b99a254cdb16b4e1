"""pairsim: CLIP-style image/text retrieval encoders trained on Ray with pair-similarity losses."""

import os

# Each Train controller, training worker and Ray Data actor is a Ray worker process of its own,
# so a run (and more so a sweep) starts more of them than the machine has cores, and the raylet
# warns again each time the count grows ("N PYTHON worker processes have been started …").
# Ray's own knob drops that line in this driver's console (it stays in the raylet's log); it is
# read when ray is first imported, and a value the user set is kept.
os.environ.setdefault("RAY_DEDUP_LOGS_SKIP_REGEX", r"PYTHON worker processes have been started on node")
