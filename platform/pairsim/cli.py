"""``pairsim`` command line: ``demo``, ``train``, ``tune``, ``extract-teacher``, ``shards build|inspect|verify``,
``evaluate``, ``export``, ``checkpoints list|verify``, ``doctor``, ``registry``, ``data synth``."""

from __future__ import annotations

import argparse
import contextlib
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pairsim import log, storage
from pairsim.config import ConfigError, RunConfig, check_tracking_uri, load_config
from pairsim.data.build_config import BuildConfig
from pairsim.data.builder import BuildError
from pairsim.data.synth import MIN_IMAGE_SIZE
from pairsim.errors import InputError
from pairsim.jobs import JobStopped, stop_on_signals
from pairsim.locks import NameInUse
from pairsim.registry import DATA_FORMATS

logger = log.get_logger("cli")
DEMO_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"
OBJECTIVES = Path(__file__).parent / "configs" / "objectives"
DEMO_SWEEP = Path(__file__).parent / "configs" / "demo_sweep.yaml"
DEMO_SWEEP_SHAPES = {"num_train": 3000, "num_val": 500, "num_test": 0}  # scenes of the demo sweep's dataset


def path_arg(value: str) -> Path:
    """A local path argument: not empty (it would mean this directory) and without a NUL byte."""
    if not value.strip() or "\x00" in value:
        raise argparse.ArgumentTypeError(f"not a usable path: {value[:80]!r}")
    return Path(value)


def location_arg(value: str) -> str | Path:
    """An argument that is a local path (:func:`path_arg`) or an object-store URI
    (:func:`pairsim.storage.parse`)."""
    path_arg(value)
    try:
        return storage.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer argument of at least ``minimum`` (and at most ``maximum``): argparse refuses
    another, naming the flag."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {value[:80]!r}") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {number}")
        if maximum is not None and number > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,}, got {number:,}")
        return number

    return parse


def tracking_uri_arg(value: str) -> str:
    """``--tracking-uri``: refused with credentials in it (:func:`pairsim.config.check_tracking_uri`)."""
    try:
        return check_tracking_uri(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shipped_objectives() -> list[str]:
    """The names of the shipped objective presets (``configs/objectives/*.yaml``)."""
    return sorted(p.stem for p in OBJECTIVES.glob("*.yaml"))


def objective_config(name: str) -> Path:
    """A shipped objective preset (``configs/objectives/<name>.yaml``) to layer on a run config."""
    path = OBJECTIVES / f"{name}.yaml"
    if not path.is_file():
        known = shipped_objectives()
        raise ConfigError(f"--objective: unknown objective {name!r} (shipped: {', '.join(known)})")
    return path


def _print_run(run_id: str, tracking_uri: str) -> None:
    from pairsim.tracking import ui_url

    print(f"\nMLflow run {run_id} in {storage.masked(tracking_uri)}")
    if tracking_uri.startswith("sqlite:///"):
        print(f"look at it with:  mlflow ui --host 127.0.0.1 --backend-store-uri {storage.masked(tracking_uri)}")
    print(f"then open:  {storage.masked(ui_url(tracking_uri, run_id))}")


def _train(cfg: RunConfig, resume: bool = False) -> None:
    from pairsim.eval.report import format_report  # heavy imports only once the config is known to be good
    from pairsim.train.driver import fit

    result = fit(cfg, resume=resume)
    val = {k.removeprefix("val/"): v for k, v in result.metrics.items() if k.startswith("val/")}
    print(f"\nval retrieval after {result.metrics.get('epoch')} epochs (run {result.run_name}):")
    print(format_report(val, cfg.eval.ks))
    if result.test_metrics:
        print(f"\n{cfg.data.test_split} retrieval of the best checkpoint (by val {cfg.eval.select_metric}):")
        print(format_report(result.test_metrics, cfg.eval.ks))
    _print_run(result.mlflow_run_id, result.tracking_uri)
    print(f"best checkpoint: {result.best_checkpoint_path}\nlatest checkpoint: {result.checkpoint_path}")


def _tune(space: Path, overrides: list[str], name: str | None = None, resume: str | None = None) -> None:
    from pairsim.tune.space import load_sweep

    if resume and name and resume != name:
        raise ConfigError(f"--resume {resume} and --name {name}: give one sweep name")
    sweep = load_sweep(space, overrides)  # every error in the file, before Ray starts
    from pairsim.tune import results
    from pairsim.tune.sweep import run_sweep

    outcome = run_sweep(sweep, resume or name, resume=resume is not None)
    print(f"\nsweep {outcome.name}: {len(outcome.rows)} trials, ranked by {sweep.metric} ({sweep.mode})")
    print(results.table_header(sweep))
    for row in outcome.rows:
        print(results.format_row(row, sweep))
    if outcome.best:
        print(f"\nbest: trial {outcome.best.trial_id}, {sweep.metric} = {outcome.best.metric:.2f}; its config: "
              f"{outcome.out_dir / 'best.yaml'}\nreproduce it with:  pairsim train --config {outcome.out_dir / 'best.yaml'}")
    if sweep.multi_objective:
        front = results.pareto_front(outcome.rows, sweep.objectives)
        print(f"\nPareto front over {', '.join(m for m, _ in sweep.objectives)} (last epoch): "
              + "; ".join(f"{r.trial_id} (" + ", ".join(f"{r.values[m]:.2f}" for m, _ in sweep.objectives) + ")"
                          for r in front)
              + f"\nin {outcome.out_dir / 'pareto.csv'}, each point's config in {outcome.out_dir / 'front'}/")
    print(f"results.csv and plots in {outcome.out_dir}; resume or extend with:  pairsim tune --space {space} "
          f"--name {outcome.name}")
    _print_run(outcome.parent_run_id, outcome.tracking_uri)
    if outcome.best is None:
        raise SweepFailed("no trial reported a val metric: every trial failed (errors above and in results.csv)")


class SweepFailed(RuntimeError):
    """A sweep in which no trial reported a metric."""


def _model_source(args: argparse.Namespace, tracking_uri: str, out: Path) -> list[Path]:
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


def _evaluate(args: argparse.Namespace) -> None:
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
        model, card = retrieval.load_exported(_model_source(args, tracking_uri, Path(tmp) / "model.pt")[0])
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
    _print_run(run_id, tracking_uri)


def _export(args: argparse.Namespace) -> None:
    from pairsim import tracking

    tracking_uri = tracking.resolve_tracking_uri(args.tracking_uri)
    if args.run_id or args.register:
        tracking.check_reachable(tracking_uri)
    written = _model_source(args, tracking_uri, args.out)
    print("wrote " + ", ".join(str(p) for p in written))
    if args.register:
        version = tracking.register_model(args.out, args.register, tracking_uri, args.run_id)
        print(f"registered as {args.register} version {version} in {storage.masked(tracking_uri)}")


def _checkpoints(args: argparse.Namespace) -> int:
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


def _ensure_demo_data(path: Path, **sizes: int) -> None:
    from pairsim.data import synth

    logger.info("the shapes dataset in %s (generated if absent)", path)
    synth.ensure(path, **sizes)


def _demo(args: argparse.Namespace) -> None:
    if args.sweep:
        if args.objective:
            raise ConfigError("--objective: the demo sweep searches the Unified loss; drop --objective or --sweep")
        from pairsim.tune.space import load_sweep

        _ensure_demo_data(load_sweep(DEMO_SWEEP, args.overrides).base.data.path, **DEMO_SWEEP_SHAPES)
        _tune(DEMO_SWEEP, args.overrides)
        return
    cfg = load_config([DEMO_CONFIG] + ([objective_config(args.objective)] if args.objective else []), args.overrides)
    _ensure_demo_data(cfg.data.path)
    _train(cfg)


def _extract_teacher(args: argparse.Namespace) -> None:
    from pairsim.cluster import init_ray
    from pairsim.teachers import encoders, store

    cfg = load_config(args.config, args.overrides)
    encoders.check_teachers(cfg)
    store.claim_output(args.out)
    init_ray(cfg)
    out = store.extract(cfg, args.out, args.splits or [cfg.data.train_split], args.batch_size, args.concurrency)
    print(f"teacher features in {out}; train from them with --set loss.cusa.teacher_features={out}")


def _shards_inspect(args: argparse.Namespace) -> None:
    from pairsim.data import shards

    print(shards.inspect(args.dir, samples=args.samples, sheet=args.sheet))


def _shards_verify(args: argparse.Namespace) -> int:
    from pairsim.data import shards

    found = shards.verify_dataset(args.dir)
    manifest = shards.read_manifest(args.dir)
    for split, problems in found.items():
        info = manifest.splits.get(split)
        size = f": {info.shards} shards, {info.images:,} images" if info else ""
        print(f"{split}{size} — " + ("verified" if not problems else "FAILED"))
        for problem in problems:
            print(f"  {problem}")
    failed = sum(bool(p) for p in found.values())
    print(f"{failed} of {len(found)} failed verification" if failed else f"{args.dir}: every split verified")
    return 1 if failed else 0


def _shards_build(args: argparse.Namespace) -> None:
    from pairsim.data import builder, shards

    cfg = BuildConfig.from_args(**{name: getattr(args, name) for name in BuildConfig.model_fields})
    if args.ray_address:
        from pairsim import cluster

        cluster.join_cluster(args.ray_address)
    manifest = builder.build(cfg)
    print(f"wrote {cfg.out}: " + ", ".join(f"{s} {c.images:,} images / {c.captions:,} captions in "
                                           f"{c.shards} shards" for s, c in sorted(manifest.splits.items()))
          + f"; {manifest.rejected} rejected (listed in {storage.Location.of(cfg.out) / shards.REJECTS})")


SHARD_SIZE_FIELDS = ("rows_per_shard", "shard_mb")  # one or the other
MAX_SAMPLES_SHOWN = 1000  # rows shards inspect prints: a look at the data, not a dump of it


def _field_type(annotation: Any) -> Callable[[str], Any]:
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
        options = {"help": field.description + default, "type": _field_type(field.annotation)}
        if name == "format":
            options = {"choices": DATA_FORMATS.names(),
                       "help": "; ".join(f"{name}: {fmt.description}" for name, fmt in DATA_FORMATS.items())}
        (size if name in SHARD_SIZE_FIELDS else build).add_argument(
            "--" + name.replace("_", "-"), required=field.is_required(), **options)
    build.add_argument("--ray-address", help="join this Ray cluster (default: RAY_ADDRESS, else a local instance)")
    build.set_defaults(func=_shards_build)
    inspect = commands.add_parser("inspect", help="counts, schema, sample rows and a contact-sheet PNG")
    inspect.add_argument("dir", type=location_arg)
    inspect.add_argument("--samples", type=int_at_least(0, MAX_SAMPLES_SHOWN), default=4,
                         help=f"rows to print (at most {MAX_SAMPLES_SHOWN})")
    inspect.add_argument("--sheet", type=path_arg, help="write a contact sheet PNG of the first split here (none by default: "
                                                   "nothing is written into the dataset)")
    inspect.set_defaults(func=_shards_inspect)
    verify = commands.add_parser("verify", help="read every shard in full: files, rows and SHA-256s against the "
                                                "manifest (exit 1 naming what differs)")
    verify.add_argument("dir", type=location_arg)
    verify.set_defaults(func=_shards_verify)


def _add_model_source(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=location_arg,
                        help="a pairsim (Ray Train + DeepSpeed) checkpoint directory (a path or a URI, s3://…)")
    source.add_argument("--run-id", help="an MLflow training run: its exported best model")
    parser.add_argument("--tracking-uri", type=tracking_uri_arg,
                        help="MLflow store (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")


def add_overrides(parser: argparse.ArgumentParser,
                  help: str = "dotted override, e.g. --set loss.margin=0.3 (repeatable)") -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def _doctor(args: argparse.Namespace) -> int:
    from pairsim import doctor

    findings = doctor.diagnose(load_config(args.config, args.overrides))
    print(doctor.report(findings))
    return 1 if any(f.blocking for f in findings) else 0


def _registry(args: argparse.Namespace) -> None:
    from pairsim import registry

    print(registry.markdown())


def _synth(args: argparse.Namespace) -> None:
    from pairsim.data import synth

    manifest = synth.generate(args.out, num_train=args.num_train, num_val=args.num_val, num_test=args.num_test,
                              image_size=args.image_size, seed=args.seed, rows_per_shard=args.rows_per_shard,
                              hard_negatives=args.hard_negatives, captions=args.captions)
    print(f"wrote {args.out}: " + ", ".join(f"{s} {c.images} images" for s, c in manifest.splits.items()))


def build_parser() -> argparse.ArgumentParser:
    """The ``pairsim`` parser: each command's parser names the function that runs it (``func``)."""
    parser = argparse.ArgumentParser(prog="pairsim", description=__doc__)
    parser.add_argument("--log-level", type=str.upper, choices=log.LEVELS,
                        help=f"pairsim's log level (default: ${log.ENV_VAR}, else INFO)")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of any failure (by default an expected one is one line)")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate the shapes data if absent and train a tiny CLIP on it")
    demo.add_argument("--objective", help="layer a shipped objective preset: "
                                           + ", ".join(shipped_objectives()))
    demo.add_argument("--sweep", action="store_true", help="instead of one run, a small ASHA sweep over the Unified "
                                                           "loss's margin and scale (configs/demo_sweep.yaml)")
    add_overrides(demo)
    demo.set_defaults(func=_demo)

    train = sub.add_parser("train", help="train from a YAML run config")
    train.add_argument("--config", type=path_arg, action="append", required=True,
                       help="YAML run config; repeat to layer files left to right")
    add_overrides(train)
    train.add_argument("--resume", action="store_true",
                       help="continue the finished run ray.run_name names (e.g. with more train.epochs); a stopped or "
                            "failed run's name resumes it without")
    train.set_defaults(func=lambda args: _train(load_config(args.config, args.overrides), args.resume))

    sweep = sub.add_parser("tune", help="a Ray Tune sweep from a search-space file (tune_spaces/*.yaml)")
    sweep.add_argument("--space", type=path_arg, required=True, help="sweep file: base config, space, sweep settings")
    add_overrides(sweep, help="override: sweep.* and space.* keys change the sweep file (e.g. sweep.num_samples=4), "
                              "others its base run config (e.g. train.epochs=3)")
    names = sweep.add_mutually_exclusive_group()
    names.add_argument("--name", help="sweep name (default sweep-<date>-<time>); an existing one is resumed")
    names.add_argument("--resume", metavar="NAME", help="continue the sweep NAME after a crash (it must exist)")
    sweep.set_defaults(func=lambda args: _tune(args.space, args.overrides, args.name, args.resume))

    extract = sub.add_parser("extract-teacher", help="embed a dataset with the run's CUSA teachers, to train from disk")
    extract.add_argument("--config", type=path_arg, action="append", required=True,
                         help="YAML run config with loss.cusa teachers; repeat to layer files")
    extract.add_argument("--out", type=path_arg, required=True, help="directory for the teacher features")
    extract.add_argument("--splits", nargs="+", default=None, help="splits to embed (default: data.train_split)")
    extract.add_argument("--batch-size", type=int_at_least(1), default=64)
    extract.add_argument("--concurrency", type=int_at_least(1), default=1, help="Ray Data actors running the teachers")
    add_overrides(extract)
    extract.set_defaults(func=_extract_teacher)

    add_shards_parser(sub)

    evaluate = sub.add_parser("evaluate", help="the evaluation suite on a split, printed and logged to MLflow")
    _add_model_source(evaluate)
    evaluate.add_argument("--data", type=location_arg, required=True,
                          help="dataset directory holding manifest.json (a path or a URI, s3://…)")
    evaluate.add_argument("--split", default="test")
    evaluate.add_argument("--batch-size", type=int_at_least(1), default=256)
    evaluate.add_argument("--concurrency", type=int_at_least(1), default=1, help="Ray Data actors embedding the split")
    add_overrides(evaluate, help="run-config override, e.g. --set eval.ks=[1,5]")
    evaluate.set_defaults(func=_evaluate)

    export = sub.add_parser("export", help="open_clip weights (+ heads side file) from a checkpoint or run")
    _add_model_source(export)
    export.add_argument("--out", type=path_arg, required=True, help="weights file, e.g. model.pt")
    export.add_argument("--register", metavar="NAME", help="also log it with mlflow.pytorch.log_model and register "
                                                             "it under NAME in MLflow's model registry")
    export.set_defaults(func=_export)

    ckpts = sub.add_parser("checkpoints", help="a run's checkpoints: list them, or verify files and checksums "
                                               "(exit 1 when one fails)").add_subparsers(dest="checkpoints_command",
                                                                                         required=True)
    for name, help_text in (("list", "epoch, step, val metric and state of each checkpoint, newest first"),
                            ("verify", "every file there, matching its checksum, loadable without running code")):
        command = ckpts.add_parser(name, help=help_text)
        command.add_argument(
            "path", type=location_arg,
            help="a run directory (<ray.storage_path>/<run name>) or one checkpoint_* in it (path or URI)")
        command.set_defaults(func=_checkpoints)

    doctor = sub.add_parser("doctor", help="what this machine and cluster give a run, and whether the config's "
                                           "choices (GPUs, precision, optimizer, storage) can run; exit 1 if not")
    doctor.add_argument("--config", type=path_arg, action="append", help="YAML run config (default: the built-in "
                                                                      "defaults); repeat to layer files")
    add_overrides(doctor)
    doctor.set_defaults(func=_doctor)

    sub.add_parser("registry", help="every extension point (losses, structures, fusions, teachers, data "
                                    "formats, metric families) and what is registered in it").set_defaults(func=_registry)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="generate the compositional shapes dataset")
    synth.add_argument("--out", type=path_arg, required=True)
    synth.add_argument("--num-train", type=int_at_least(0), default=10_000, help="0: no train split")
    synth.add_argument("--num-val", type=int_at_least(0), default=500, help="0: no val split")
    synth.add_argument("--num-test", type=int_at_least(0), default=500, help="0: no test split")
    synth.add_argument("--image-size", type=int_at_least(MIN_IMAGE_SIZE), default=64)
    synth.add_argument("--rows-per-shard", type=int_at_least(1), default=2_000)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--hard-negatives", nargs="+", choices=["val", "test"], default=[],
                       help="build these splits of hard-negative families: a scene and variants of it that differ in "
                            "one object's colour, one object's shape or the relation, with near-duplicate captions")
    synth.add_argument("--captions", choices=["scene", "object_labels"], default="scene",
                       help="scene: 5 captions an image; object_labels: one text naming its objects' colours and shapes")
    synth.set_defaults(func=_synth)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its expected failures end in one line on stderr and :func:`exit_status`'s
    status (a traceback only with ``--debug``, or for a bug)."""
    args = build_parser().parse_args(argv)
    ray_before = _RayBefore()
    try:
        with stop_on_signals(sigint=True):
            log.setup(args.log_level)
            return args.func(args) or 0
    except JobStopped as exc:  # Ctrl-C or SIGTERM at any moment; a run has ended KILLED
        print(f"pairsim: {exc}", file=sys.stderr)
        ray_before.stop_what_came_since()
        return 128 + exc.signum
    except Exception as exc:
        status = exit_status(exc)
        if status is None or args.debug:
            raise
        ray_before.stop_what_came_since()  # first: Ray's forwarding of its workers' tracebacks ends, this line is last
        print(f"pairsim: {_message(exc)}", file=sys.stderr)
        return status


USER_PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)


def exit_status(exc: Exception) -> int | None:
    """2 for bad input (:class:`~pairsim.errors.InputError`: flags, configs, files, names in use;
    or a path given that is missing, of the wrong kind or not permitted), 1 for a failure of work
    that started (the reported runtime errors, other OS errors such as a full disk), None for
    anything else: a bug, shown with its traceback."""
    if isinstance(exc, (InputError, *USER_PATH_ERRORS)):
        return 2
    if isinstance(exc, _reported_errors() + (OSError,)):
        return 1
    return None


class _RayBefore:
    """Ray as a command found it (its own process's children; whether it was connected), so a
    stopped command ends the local instance it started, also when it was stopped while that
    instance was starting (nothing of it is left running), and nothing else: not a Ray
    connection or processes of a program that called :func:`main` (a test session), nor a
    cluster it joined."""

    def __init__(self):
        import psutil

        ray = sys.modules.get("ray")
        self.connected = ray is not None and ray.is_initialized()
        self.children = {p.pid for p in psutil.Process().children(recursive=True)}

    def stop_what_came_since(self) -> None:
        ray = sys.modules.get("ray")
        if ray is None or self.connected:
            return
        import psutil

        # taken before the raylet ends and its agents lose their parent
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in self.children]
        ray.shutdown(wait_for_processes=True)
        for process in psutil.wait_procs(started, timeout=5)[1]:  # agents of an instance stopped while it started
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def _message(exc: Exception) -> str:
    """A reported error's message; a Ray task's is its cause's, without what Ray Data appends
    to a failed read's (its retry advice)."""
    from pairsim.data.shard_reader import checksum_failure

    if isinstance(exc, ConfigError) and not isinstance(exc, NameInUse):
        return f"config error: {exc}"
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:  # as the OS said it, with the path
        return f"{exc.filename}: {exc.strerror}"
    return str(checksum_failure(exc) or getattr(exc, "cause", None) or exc)


def _reported_errors() -> tuple[type[Exception], ...]:
    """Runtime failures the CLI reports in one line (exit 1) rather than as a traceback; imported
    on use, as the engine's pulls in torch."""
    from pairsim.cluster import WorkersNotStarting
    from pairsim.data.shards import ShardError

    return BuildError, ShardError, SweepFailed, WorkersNotStarting


if __name__ == "__main__":
    sys.exit(main())
