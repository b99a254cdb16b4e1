"""The commands on datasets: ``shards build|inspect|verify`` (Parquet shards from a dataset) and
``data synth`` (the generated shapes dataset)."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pairsim import storage
from pairsim.commands.arguments import int_at_least, location_arg, path_arg
from pairsim.data.build_config import BuildConfig
from pairsim.registry import DATA_FORMATS

SHARD_SIZE_FIELDS = ("rows_per_shard", "shard_mb")  # one or the other
MAX_SAMPLES_SHOWN = 1000  # rows shards inspect prints: a look at the data, not a dump of it


def inspect_shards(args: argparse.Namespace) -> None:
    from pairsim.data import shards

    print(shards.inspect(args.dir, samples=args.samples, sheet=args.sheet))


def verify_shards(args: argparse.Namespace) -> int:
    from pairsim.data import shards

    found = shards.verify_dataset(args.dir)
    manifest = shards.read_manifest(args.dir, check_hashes=False)  # its hashes are among what verify reports
    for split, problems in found.items():
        info = manifest.splits.get(split)
        size = f": {info.shards} shards, {info.images:,} images" if info else ""
        print(f"{split}{size} — " + ("verified" if not problems else "FAILED"))
        for problem in problems:
            print(f"  {problem}")
    failed = sum(bool(p) for p in found.values())
    print(f"{failed} of {len(found)} failed verification" if failed else f"{args.dir}: every split verified")
    return 1 if failed else 0


def build_shards(args: argparse.Namespace) -> None:
    from pairsim.data import builder, shards

    cfg = BuildConfig.from_args(**{name: getattr(args, name) for name in BuildConfig.model_fields})
    if args.ray_address:
        from pairsim import cluster

        cluster.join_cluster(args.ray_address)
    manifest = builder.build(cfg)
    print(f"wrote {cfg.out}: " + ", ".join(f"{s} {c.images:,} images / {c.captions:,} captions in "
                                           f"{c.shards} shards" for s, c in sorted(manifest.splits.items()))
          + f"; {manifest.rejected} rejected (listed in {storage.Location.of(cfg.out) / shards.REJECTS})")


def field_arg_type(annotation: Any) -> Callable[[str], Any]:
    """The argparse type of a config field's annotation: a path or URI, a path, int, float or str
    (through unions, ``Optional`` and ``Annotated``)."""
    kinds, pending = set(), [annotation]
    while pending:
        kind = pending.pop()
        if typing.get_origin(kind) in (typing.Union, types.UnionType, typing.Annotated):
            pending.extend(typing.get_args(kind)[:1] if typing.get_origin(kind) is typing.Annotated
                           else typing.get_args(kind))
        else:
            kinds.add(kind)
    if {Path, str} <= kinds:
        return location_arg
    kind = next(kind for kind in (Path, int, float, str) if kind in kinds)
    return path_arg if kind is Path else kind


def add_shards_parser(sub) -> None:
    """``shards build``, ``inspect`` and ``verify`` (also used by pipelines/prepare_data.py). ``build``'s
    flags are :class:`~pairsim.data.build_config.BuildConfig`'s fields (``--images-root`` for
    ``images_root``), their types, help and defaults read from it."""
    shards = sub.add_parser("shards", help="build Parquet shards from a dataset, inspect or verify them")
    commands = shards.add_subparsers(dest="shards_command", required=True)
    build = commands.add_parser("build", help="COCO/Flickr30K split files, CSV, WebDataset tars or an image "
                                              "folder → DIR/<split>/part-NNNNN.parquet + manifest.json")
    size = build.add_mutually_exclusive_group()
    for name, field in BuildConfig.model_fields.items():
        default = "" if field.is_required() or field.default is None else f" (default {field.default!r})"
        options = {"help": field.description + default, "type": field_arg_type(field.annotation)}
        if name == "format":
            options = {"choices": DATA_FORMATS.names(),
                       "help": "; ".join(f"{name}: {fmt.description}" for name, fmt in DATA_FORMATS.items())}
        (size if name in SHARD_SIZE_FIELDS else build).add_argument(
            "--" + name.replace("_", "-"), required=field.is_required(), **options)
    build.add_argument("--ray-address", help="join this Ray cluster (default: RAY_ADDRESS, else a local instance)")
    build.set_defaults(func=build_shards)
    inspect = commands.add_parser("inspect", help="counts, schema, sample rows and a contact-sheet PNG")
    inspect.add_argument("dir", type=location_arg)
    inspect.add_argument("--samples", type=int_at_least(0, MAX_SAMPLES_SHOWN), default=4,
                         help=f"rows to print (at most {MAX_SAMPLES_SHOWN})")
    inspect.add_argument("--sheet", type=path_arg, help="write a contact sheet PNG of the first split here (none by default: "
                                                   "nothing is written into the dataset)")
    inspect.set_defaults(func=inspect_shards)
    verify = commands.add_parser("verify", help="read every shard in full: files, rows and SHA-256s against the "
                                                "manifest (exit 1 naming what differs)")
    verify.add_argument("dir", type=location_arg)
    verify.set_defaults(func=verify_shards)


def synth(args: argparse.Namespace) -> None:
    from pairsim.data import synth

    manifest = synth.generate(args.out, num_train=args.num_train, num_val=args.num_val, num_test=args.num_test,
                              image_size=args.image_size, seed=args.seed, rows_per_shard=args.rows_per_shard,
                              hard_negatives=args.hard_negatives, captions=args.captions)
    print(f"wrote {args.out}: " + ", ".join(f"{s} {c.images} images" for s, c in manifest.splits.items()))
