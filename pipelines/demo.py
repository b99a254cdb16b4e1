"""Job entry point of the demo: ``python pipelines/demo.py [--set KEY=VALUE ...]``.

Also what ``ray job submit --working-dir . -- python pipelines/demo.py`` runs on a cluster.
"""

import sys

from pairsim.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
