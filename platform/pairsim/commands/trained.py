"""The commands on what a run trained: ``evaluate`` (the suite on a split), ``export`` (weights
from a checkpoint or run, optionally registered) and ``checkpoints list|verify``."""

from __future__ import annotations

import argparse
from pathlib import Path

from pairsim import storage
from pairsim.commands.arguments import location_arg, name_arg, path_arg, tracking_uri_arg
from pairsim.commands.runs import print_run
from pairsim.config import ConfigError, load_config


def add_model_source_flags(parser: argparse.ArgumentParser, export: bool = False) -> None:
    """Where the model comes from: ``--checkpoint`` or ``--run-id`` (with ``--tracking-uri``), and
    with ``export`` also ``--model``, an export already written."""
    source = parser.add_mutually_exclusive_group(required=True)
    if export:
        source.add_argument("--model", type=path_arg, help="an export's weights (model.pt beside its model.json)")
    source.add_argument("--checkpoint", type=location_arg,
                        help="a pairsim (Ray Train + DeepSpeed) checkpoint directory (a path or a URI, s3://…)")
    source.add_argument("--run-id", type=name_arg, help="an MLflow training run: its exported best model")
    parser.add_argument("--tracking-uri", type=tracking_uri_arg,
                        help="MLflow store (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")


def write_model(args: argparse.Namespace, tracking_uri: str, out: Path) -> list[Path]:
    """``--checkpoint`` consolidated, or ``--run-id``'s exported model, written to ``out``."""
    from pairsim import tracking
    from pairsim.models import retrieval
    from pairsim.models.saved import UnsafeCheckpointError
    from pairsim.train import checkpoints

    if args.checkpoint:
        retrieval.claim_export(out)  # before a remote checkpoint is downloaded
        if not checkpoints.is_checkpoint(args.checkpoint):
            raise UnsafeCheckpointError(f"{args.checkpoint}: {checkpoints.NOT_A_CHECKPOINT}")
        with storage.Location.of(args.checkpoint).local_copy() as checkpoint:
            return checkpoints.export_checkpoint(checkpoint, out)
    return tracking.download_run_model(args.run_id, tracking_uri, out)


def evaluate(args: argparse.Namespace) -> None:
    import functools
    import tempfile

    from pairsim import tracking
    from pairsim.data import shards
    from pairsim.eval import inference, report, suite
    from pairsim.models import retrieval
    from pairsim.cluster import init_ray

    tracking_uri = tracking.resolve_tracking_uri(args.tracking_uri)
    tracking.check_reachable(tracking_uri)  # in seconds: MLflow's client retries for minutes
    if args.split not in shards.read_manifest(args.data).splits:
        raise ConfigError(f"--split: {args.data} has no split {args.split!r}")
    with tempfile.TemporaryDirectory() as tmp:
        model, card = retrieval.load_exported(write_model(args, tracking_uri, Path(tmp) / "model.pt")[0])
    overrides = [f"data.path={args.data}", f"eval.batch_size={args.batch_size}",
                 f"eval.concurrency={args.concurrency}"] + args.overrides
    cfg = load_config(overrides=overrides).model_copy(update={"model": card.model})
    init_ray(cfg)
    embeddings = inference.embed_with_ray_data(model, cfg, args.split)
    result = suite.evaluate_split(embeddings, retrieval.fusion_module(model, cfg.model), cfg.eval.ks)
    print(f"{args.split} of {args.data}, model from {args.checkpoint or 'run ' + args.run_id}:")
    print(report.format_report(result.metrics, cfg.eval.ks))
    checkpoint = args.checkpoint and storage.Location.of(args.checkpoint)
    run_id = args.run_id or tracking.find_run(tracking_uri, checkpoint.parent.name)
    if run_id is None:
        run_id = tracking.create_run(tracking_uri, "pairsim-eval", f"eval-{checkpoint.name}",
                                     {"pairsim.checkpoint": str(checkpoint)})
    with tracking.RunLogger(tracking_uri, run_id) as run:
        report.log_report(run, result, embeddings, functools.partial(shards.read_rows, args.data, args.split),
                          args.split, card.step, title=f"{args.split}, epoch {card.epoch}")
    print_run(run_id, tracking_uri)


def export(args: argparse.Namespace) -> None:
    from pairsim import tracking

    tracking_uri = tracking.resolve_tracking_uri(args.tracking_uri)
    if args.run_id or args.register:
        tracking.check_reachable(tracking_uri)
    written = write_model(args, tracking_uri, args.out)
    print("wrote " + ", ".join(str(p) for p in written))
    if args.register:
        version = tracking.register_model(args.out, args.register, tracking_uri, args.run_id)
        print(f"registered as {args.register} version {version} in {storage.masked(tracking_uri)}: serve its "
              f"embeddings with: mlflow models serve -m models:/{args.register}/{version} --env-manager local")


def list_or_verify_checkpoints(args: argparse.Namespace) -> int:
    from pairsim.train import checkpoints

    failed = 0
    for checkpoint, card, problems in checkpoints.inventory(args.path):
        metric = f"rsum {card.val['val/rsum']:.2f}" if card and "val/rsum" in card.val else ""
        state = "ok" if not problems else "NOT VERIFIED: " + "; ".join(problems)
        failed += bool(problems)
        if args.checkpoints_command == "list" or problems:
            epoch, step = (card.epoch, card.step) if card else ("?", "?")
            print(f"{checkpoint.name}  epoch {epoch}  step {step}  {metric}  {state}")
    if args.checkpoints_command == "verify":
        print(f"{failed} of the checkpoints failed verification" if failed else "every checkpoint verified")
    return 1 if failed and args.checkpoints_command == "verify" else 0
