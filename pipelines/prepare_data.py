"""Job entry point of the shard builder (a Ray Data job; ``ray job submit`` runs it on a cluster):

    python pipelines/prepare_data.py --format karpathy --input dataset_coco.json --images-root coco/ --out data/coco
    python pipelines/prepare_data.py --format csv --input train.csv --out data/cc --rows-per-shard 10000
    python pipelines/prepare_data.py --format webdataset --input tars/ --out data/laion --shard-mb 256
    python pipelines/prepare_data.py --format folder --input captions.jsonl --out data/mine

Same options as ``pairsim shards build``; re-running resumes (finished shards are kept).
"""

import sys

import checkout_path  # noqa: F401  (this checkout's pairsim, first on the path)
from pairsim.cli import main

if __name__ == "__main__":
    sys.exit(main(["shards", "build", *sys.argv[1:]]))
