"""Job entry point of CUSA teacher extraction (Ray Data batch inference on an actor pool):

    python pipelines/extract_teacher.py --config run.yaml --out teacher_features [--concurrency 4]

Embeds every image and caption of the run's train split (or ``--splits``) with the teachers in
``loss.cusa`` and writes them per shard, keyed by image id and caption index. Then train with
``--set loss.cusa.teacher_features=teacher_features``: the batch streams its teacher embeddings
instead of running the teachers in the workers.
"""

import sys

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
from pairsim.cli import main

if __name__ == "__main__":
    sys.exit(main(["extract-teacher", *sys.argv[1:]]))
