"""Job entry point of a sweep: ``python pipelines/tune.py --space tune_spaces/unified.yaml [--set KEY=VALUE ...]
[--name NAME | --resume NAME]``.

Submit to a cluster with ``ray job submit --working-dir . -- python pipelines/tune.py --space
tune_spaces/unified.yaml --set ray.storage_path=/shared/ray_results``.
"""

import sys

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
from pairsim.cli import main

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
