"""Job entry point of the demo: ``python pipelines/demo.py [--set KEY=VALUE ...]``.

Also what ``ray job submit --working-dir . -- python pipelines/demo.py`` runs on a cluster.
"""

import sys

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
from pairsim.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
