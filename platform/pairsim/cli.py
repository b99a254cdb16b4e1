"""``pairsim`` command line: ``demo``, ``train``, ``tune``, ``extract-teacher``, ``shards build|inspect|verify``,
``evaluate``, ``export``, ``embed``, ``index``, ``search``, ``checkpoints list|verify``, ``doctor``, ``registry``,
``data synth``."""

from __future__ import annotations

import argparse
import contextlib
import sys

from pairsim import log
from pairsim.commands import datasets, runs, trained
from pairsim.commands.arguments import add_overrides, int_at_least, location_arg, name_arg, path_arg
from pairsim.commands.datasets import add_shards_parser
from pairsim.commands.embed import add_embed_parser
from pairsim.commands.search import add_search_parsers
from pairsim.commands.runs import (DEMO_CONFIG, DEMO_SWEEP, OBJECTIVES, SweepFailed, objective_config,
                                   shipped_objectives)
from pairsim.commands.runs import demo as _demo  # looked up here when the parser is built: a test stands in for it
from pairsim.config import ConfigError, load_config
from pairsim.data.builder import BuildError
from pairsim.data.synth import MAX_IMAGE_SIZE, MAX_SPLIT_IMAGES, MIN_IMAGE_SIZE
from pairsim.errors import InputError
from pairsim.locks import NameInUse
from pairsim.signals import JobStopped, stop_on_signals
from pairsim.storage import NotARegularFile

__all__ = ["DEMO_CONFIG", "DEMO_SWEEP", "OBJECTIVES", "add_shards_parser", "build_parser", "exit_status", "main",
           "objective_config", "shipped_objectives"]  # the names other code and tests take from here


def _doctor(args: argparse.Namespace) -> int:
    from pairsim import doctor

    findings = doctor.diagnose(load_config(args.config, args.overrides))
    print(doctor.report(findings))
    return 1 if any(f.blocking for f in findings) else 0


def _registry(args: argparse.Namespace) -> None:
    from pairsim import registry

    print(registry.markdown())


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
    train.set_defaults(func=lambda args: runs.train_and_report(load_config(args.config, args.overrides), args.resume))

    sweep = sub.add_parser("tune", help="a Ray Tune sweep from a search-space file (tune_spaces/*.yaml)")
    sweep.add_argument("--space", type=path_arg, required=True, help="sweep file: base config, space, sweep settings")
    add_overrides(sweep, help="override: sweep.* and space.* keys change the sweep file (e.g. sweep.num_samples=4), "
                              "others its base run config (e.g. train.epochs=3)")
    names = sweep.add_mutually_exclusive_group()
    names.add_argument("--name", help="sweep name (default sweep-<date>-<time>); an existing one is resumed")
    names.add_argument("--resume", metavar="NAME", help="continue the sweep NAME after a crash (it must exist)")
    sweep.set_defaults(func=lambda args: runs.sweep_and_report(args.space, args.overrides, args.name, args.resume))

    extract = sub.add_parser("extract-teacher", help="embed a dataset with the run's CUSA teachers, to train from disk")
    extract.add_argument("--config", type=path_arg, action="append", required=True,
                         help="YAML run config with loss.cusa teachers; repeat to layer files")
    extract.add_argument("--out", type=path_arg, required=True, help="directory for the teacher features")
    extract.add_argument("--splits", type=name_arg, nargs="+", default=None, help="splits to embed (default: data.train_split)")
    extract.add_argument("--batch-size", type=int_at_least(1), default=64)
    extract.add_argument("--concurrency", type=int_at_least(1), default=1, help="Ray Data actors running the teachers")
    add_overrides(extract)
    extract.set_defaults(func=runs.extract_teacher)

    add_shards_parser(sub)

    evaluate = sub.add_parser("evaluate", help="the evaluation suite on a split, printed and logged to MLflow")
    trained.add_model_source_flags(evaluate)
    evaluate.add_argument("--data", type=location_arg, required=True,
                          help="dataset directory holding manifest.json (a path or a URI, s3://…)")
    evaluate.add_argument("--split", type=name_arg, default="test")
    evaluate.add_argument("--batch-size", type=int_at_least(1), default=256)
    evaluate.add_argument("--concurrency", type=int_at_least(1), default=1, help="Ray Data actors embedding the split")
    add_overrides(evaluate, help="run-config override, e.g. --set eval.ks=[1,5]")
    evaluate.set_defaults(func=trained.evaluate)

    export = sub.add_parser("export", help="open_clip weights (+ heads side file) from a checkpoint or run")
    trained.add_model_source_flags(export)
    export.add_argument("--out", type=path_arg, required=True, help="weights file, e.g. model.pt")
    export.add_argument("--register", type=name_arg, metavar="NAME", help="also register it under NAME in MLflow's model registry "
                                                             "as a pyfunc model serving embeddings (`mlflow models "
                                                             "serve`), with its mlflow.pytorch model logged beside it")
    export.set_defaults(func=trained.export)

    add_embed_parser(sub)
    add_search_parsers(sub)

    ckpts = sub.add_parser("checkpoints", help="a run's checkpoints: list them, or verify files and checksums "
                                               "(exit 1 when one fails)").add_subparsers(dest="checkpoints_command",
                                                                                         required=True)
    for name, help_text in (("list", "epoch, step, val metric and state of each checkpoint, newest first"),
                            ("verify", "every file there, matching its checksum, loadable without running code")):
        command = ckpts.add_parser(name, help=help_text)
        command.add_argument(
            "path", type=location_arg,
            help="a run directory (<ray.storage_path>/<run name>) or one checkpoint_* in it (path or URI)")
        command.set_defaults(func=trained.list_or_verify_checkpoints)

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
    synth.add_argument("--num-train", type=int_at_least(0, MAX_SPLIT_IMAGES), default=10_000, help="0: no train split")
    synth.add_argument("--num-val", type=int_at_least(0, MAX_SPLIT_IMAGES), default=500, help="0: no val split")
    synth.add_argument("--num-test", type=int_at_least(0, MAX_SPLIT_IMAGES), default=500, help="0: no test split")
    synth.add_argument("--image-size", type=int_at_least(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE), default=64)
    synth.add_argument("--rows-per-shard", type=int_at_least(1), default=2_000)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--hard-negatives", nargs="+", choices=["val", "test"], default=[],
                       help="build these splits of hard-negative families: a scene and variants of it that differ in "
                            "one object's colour, one object's shape or the relation, with near-duplicate captions")
    synth.add_argument("--captions", choices=["scene", "object_labels"], default="scene",
                       help="scene: 5 captions an image; object_labels: one text naming its objects' colours and shapes")
    synth.set_defaults(func=datasets.synth)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its expected failures end in one line on stderr and :func:`exit_status`'s
    status (a traceback only with ``--debug``, or for a bug)."""
    args = build_parser().parse_args(argv)
    ray_before = _RayBaseline()
    try:
        with stop_on_signals(sigint=True):
            log.setup(args.log_level)
            return args.func(args) or 0
    except JobStopped as exc:  # Ctrl-C or SIGTERM at any moment; a run has ended KILLED
        print(f"pairsim: {exc}", file=sys.stderr)
        ray_before.stop_instance_started_since()
        return 128 + exc.signum
    except Exception as exc:
        status = exit_status(exc)
        if status is None or args.debug:
            raise
        # first: Ray's forwarding of its workers' tracebacks ends, so the line below is the last printed
        ray_before.stop_instance_started_since()
        print(f"pairsim: {_message(exc)}", file=sys.stderr)
        return status


USER_PATH_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError,
                    NotARegularFile)


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


class _RayBaseline:
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

    def stop_instance_started_since(self) -> None:
        """Disconnect from Ray, ending the local instance the command started (a cluster it joined
        keeps running), and kill the processes of that instance still left (its agents, when it
        was stopped while starting); nothing when Ray was connected before the command."""
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
    """The one line a reported error prints: a config error's prefixed ``config error:`` (a name
    in use's not), an OS error's as the OS said it, with its path; a Ray task's is its cause's,
    and a failed shard read's is its checksum failure, without what Ray Data appends (its retry
    advice)."""
    from pairsim.data.shard_reader import checksum_failure

    if isinstance(exc, ConfigError) and not isinstance(exc, NameInUse):
        return f"config error: {exc}"
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:  # as the OS said it, with the path
        return f"{exc.filename}: {exc.strerror}"
    return str(checksum_failure(exc) or getattr(exc, "cause", None) or exc)


def _reported_errors() -> tuple[type[Exception], ...]:
    """Runtime failures the CLI reports in one line (exit 1) rather than as a traceback; imported
    when a failure is reported, as :mod:`pairsim.cluster` imports Ray, which a command need not
    load before it runs."""
    from pairsim.cluster import WorkersNotStarting
    from pairsim.data.shards import ShardError

    return BuildError, ShardError, SweepFailed, WorkersNotStarting


if __name__ == "__main__":
    sys.exit(main())
