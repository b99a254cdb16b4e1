"""pairsim: CLIP-style image/text retrieval encoders trained on Ray with pair-similarity losses."""

from pairsim import compat

compat.ray.quiet_worker_count_warning()  # before ray is first imported: it reads the setting then
