"""``pairsim embed``: a dataset split's embeddings by a trained model, written as Parquet shards
with a manifest (:mod:`pairsim.serving.embeddings`); resumable."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pairsim.commands.arguments import add_overrides, int_at_least, location_arg, name_arg
from pairsim.commands.trained import add_model_source_flags, write_model
from pairsim.config import ConfigError, load_config


def add_embed_parser(sub) -> None:
    """The ``embed`` command in the ``pairsim`` subcommands ``sub``."""
    embed = sub.add_parser("embed", help="embeddings of a dataset split's images and captions by a trained model "
                                         "(Ray Data batch inference), as Parquet shards; resumable")
    add_model_source_flags(embed, export=True)
    embed.add_argument("--data", type=location_arg, required=True,
                       help="dataset directory holding manifest.json (a path or a URI, s3://…)")
    embed.add_argument("--split", type=name_arg, default="val")
    embed.add_argument("--out", type=location_arg, required=True,
                       help="embeddings directory: new, empty, or an earlier embed of the same model and split "
                            "(continued where it stopped)")
    embed.add_argument("--modality", choices=["image", "text", "both"], default="both")
    embed.add_argument("--batch-size", type=int_at_least(1), default=256)
    embed.add_argument("--concurrency", type=int_at_least(1), default=1,
                       help="with --use-gpu, Ray Data actors holding the model (on CPU the decoding tasks embed)")
    embed.add_argument("--use-gpu", action="store_true", help="one GPU for each of those actors")
    add_overrides(embed, help="run-config override, e.g. --set data.cpus_per_task=2")
    embed.set_defaults(func=embed_command)


def embed_command(args: argparse.Namespace) -> None:
    from pairsim import tracking
    from pairsim.data import shards
    from pairsim.models import retrieval
    from pairsim.serving import embeddings

    embeddings.claim_output(args.out)  # before any work
    if args.split not in shards.read_manifest(args.data).splits:
        raise ConfigError(f"--split: {args.data} has no split {args.split!r}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            weights, source = args.model.absolute(), str(args.model.absolute())
        else:
            tracking_uri = tracking.resolve_tracking_uri(args.tracking_uri)
            if args.run_id:
                tracking.check_reachable(tracking_uri)  # in seconds: MLflow's client retries for minutes
            weights = write_model(args, tracking_uri, Path(tmp) / "model.pt")[0]
            source = f"run {args.run_id} in {tracking_uri}" if args.run_id else f"checkpoint {args.checkpoint}"
        digest = retrieval.model_digest(weights)
        model, card = retrieval.load_exported(weights)
    overrides = [f"data.path={args.data}", f"eval.batch_size={args.batch_size}",
                 f"eval.concurrency={args.concurrency}", f"train.use_gpu={str(args.use_gpu).lower()}"] + args.overrides
    cfg = load_config(overrides=overrides).model_copy(update={"model": card.model})
    modalities = ["image", "text"] if args.modality == "both" else [args.modality]
    manifest = embeddings.embed_split(model, cfg, args.split, args.out, digest, source, modalities)
    rows = {m: sum(s.rows for s in manifest.shards if s.modality == m) for m in manifest.modalities}
    print(f"{', '.join(f'{n:,} {m} embeddings' for m, n in rows.items())} of {args.split} of {args.data} "
          f"(model {digest[:12]}, dim {manifest.dim}) in {args.out}"
          + (f"; {len(manifest.skipped)} unreadable images skipped, listed in {embeddings.MANIFEST}"
             if manifest.skipped else ""))
