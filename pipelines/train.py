"""Job entry point of training: ``python pipelines/train.py --config run.yaml [--set KEY=VALUE ...]``.

Submit to a cluster with ``ray job submit --working-dir . -- python pipelines/train.py --config run.yaml``.
"""

import sys

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
from pairsim.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
