"""The sweep driver: sweep file → checks → Ray → ``Tuner`` → table, ``best.yaml``, plots, MLflow.

Ray Train V2 with Tune: each trial is a function trainable (:func:`pairsim.tune.trial.run_trial`)
that runs :func:`pairsim.train.driver.fit` on the trial's run config, so a trial is exactly a
``pairsim train`` run (its own ``TorchTrainer``, DeepSpeed, Ray Data stream and MLflow run).
Each epoch's val metrics go from the run's Ray Train callback to Tune: Ray's
``TuneReportCallback``, or under PBT and PB2, which clone a trial's Tune checkpoint,
:class:`pairsim.train.callbacks.TrialReporter` over a Ray queue to the trial function, which
reports them with the checkpoint (:func:`pairsim.tune.trial.fit_reporting_checkpoints`); the
search (Optuna) and scheduler (ASHA, PBT, PB2) read those reports, and the driver's
:class:`SweepProgress` prints them. A warm sweep (``sweep.warm``) trains each one-worker trial in
its Tune trial actor, reused from trial to trial (:func:`trial_function_resources`).

MLflow: one parent run per sweep (the space, the settings, the results and plots), one child run
per trial (``mlflow.parentRunId``; the trial's full config as params, its curves), ended
FINISHED, FAILED or KILLED (stopped early by ASHA) with a ``pairsim.trial_status`` tag.

Resume: the Tune experiment lives at ``<ray.storage_path>/<name>``; running the same name again
(or ``--resume NAME``) restores it (``Tuner.restore``): finished trials are kept, unfinished
ones continue from their Ray Train checkpoints into the same child runs. Tune's restore
unpickles its state files (:data:`TUNE_STATE_FILES`), which would run any code put in them: when
the sweep runs (every few seconds) and when its driver stops, pairsim records their SHA-256s in
:data:`STATE_FILE`, and the SHA-256 of that record (:func:`state_digest`) on the sweep's MLflow
parent run (:data:`TUNE_STATE_TAG`), outside the sweep directory: whoever can rewrite the
directory cannot vouch for a record of their own. A resume unpickles the state only when the
parent run holds the digest of the record, and every file still has its recorded SHA-256. A
driver killed outright resumes from its last record; Tune state written after it is refused
(the sweep then runs again under a new name, its trials' directories and MLflow runs left as
they are).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated

import ray
from mlflow.exceptions import MlflowException
from pydantic import BaseModel, ConfigDict, Field
from ray import tune

from pairsim import cluster, locks, log, signals, tracking, untrusted
from pairsim.config import ConfigError
from pairsim.errors import described
from pairsim.storage import Location, masked
from pairsim.train import driver
from pairsim.tune import results
from pairsim.tune.space import Sweep
from pairsim.tune.trial import TrialJob, TrialName, run_trial, trial_run_name

logger = log.get_logger("tune")
STATE_FILE = "pairsim-sweep.json"  # beside Tune's state: the sweep's digest, parent run and Tune's state digests
STATE_MAX_BYTES = 64 * 2**20  # of STATE_FILE: a digest or two per trial
TUNE_STATE_FILES = ("*.pkl", "*.json", "*/*.pkl")
"""Tune's files in a sweep's directory that its restore unpickles (:data:`STATE_FILE` aside):
``tuner.pkl``; ``experiment_state-*.json`` (each trial's fields as embedded pickles); the search
algorithm's and callbacks' state (``searcher-state-*.pkl``, ``basic-variant-state-*.json``, ...,
pickles whatever their suffix); a trial's ``error.pkl``."""
RECORD_EVERY_S = 5.0  # how often a running sweep records its Tune state's digests (TuneStateRecorder)
TUNE_STATE_TAG = "pairsim.tune_state_sha256"  # on the sweep's MLflow parent run: state_digest of its record
SWEEP_LOCK = "pairsim-sweep.lock"  # in the sweep's directory while it runs (pairsim.locks)
TUNE_CHECKPOINTS_KEPT = 4  # per PBT trial (Ray warns that 2 or fewer can delete what a clone needs)
TRIAL_MEMORY = 256 * 2**20  # bytes the trial function itself reserves
TRIAL_LOG_LEVEL = "WARNING"  # trials' own pairsim logs (the sweep prints its table)


class SweepState(BaseModel):
    """:data:`STATE_FILE`, read back as untrusted input (:func:`read_state`)."""

    model_config = ConfigDict(extra="forbid")

    digest: str  # Sweep.digest() of the sweep run here: a resume must match it
    parent_run_id: str = Field(pattern=r"^[0-9a-f]{32}$")  # an MLflow run id: the record of TUNE_STATE_TAG
    source: str  # the sweep file
    tune_state: dict[str, Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = {}
    """Each of Tune's state files (:func:`tune_state_files`) → its SHA-256 when the driver last stopped."""


class UnvouchedTuneState(untrusted.UntrustedFileError):
    """A file of Tune's sweep state whose bytes pairsim did not record: resuming would unpickle it."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}. Tune unpickles its state to resume the sweep, which would run any code put in "
                         "it, so pairsim resumes only the state whose SHA-256s it recorded as the sweep ran, that "
                         f"record vouched for by the sweep's MLflow run ({TUNE_STATE_TAG}). Run the sweep under a new "
                         "--name; the trials run so far stay in their directories and MLflow")


def read_state(exp_dir: Path) -> SweepState:
    """The sweep's :data:`STATE_FILE`; :class:`pairsim.untrusted.UntrustedFileError` naming it when
    it is not one pairsim writes."""
    return untrusted.read_model(exp_dir / STATE_FILE, SweepState, STATE_MAX_BYTES)


def state_digest(tune_state: dict[str, str]) -> str:
    """One SHA-256 of a record of Tune's state files (each name with its SHA-256, in name order):
    what the sweep's MLflow parent run keeps of it (:data:`TUNE_STATE_TAG`), 64 characters however
    many files there are (MLflow bounds a tag's value)."""
    return hashlib.sha256(json.dumps(sorted(tune_state.items())).encode()).hexdigest()


def write_state(exp_dir: Path, state: SweepState, tracking_uri: str) -> None:
    """``state`` as the sweep's :data:`STATE_FILE`, atomically, after the digest of its record of
    Tune's state (:func:`state_digest`) as its MLflow parent run's :data:`TUNE_STATE_TAG`. A driver
    stopped between the two leaves them differing: that state is not resumed."""
    tracking.tag_run(tracking_uri, state.parent_run_id, {TUNE_STATE_TAG: state_digest(state.tune_state)})
    Location.of(exp_dir / STATE_FILE).write_text(state.model_dump_json(indent=2))


def tune_state_files(exp_dir: Path) -> dict[str, Path]:
    """Tune's state files in ``exp_dir`` (:data:`TUNE_STATE_FILES`) by their path under it."""
    return {path.relative_to(exp_dir).as_posix(): path for pattern in TUNE_STATE_FILES
            for path in sorted(exp_dir.glob(pattern)) if path.name != STATE_FILE and path.is_file()}


def record_tune_state(exp_dir: Path, state: SweepState, tracking_uri: str) -> None:
    """``state`` into :data:`STATE_FILE` (:func:`write_state`) with the SHA-256 of each of Tune's
    state files as they are now, unless the file already records those: the sweep's MLflow run is
    tagged when Tune's state changed, not every few seconds. (A record rewritten to match is not
    rewritten here, and its tag then differs: its resume is refused.)"""
    digests = {name: untrusted.sha256(path) for name, path in tune_state_files(exp_dir).items()}
    with contextlib.suppress(untrusted.UntrustedFileError):
        if read_state(exp_dir).tune_state == digests:
            return
    write_state(exp_dir, state.model_copy(update={"tune_state": digests}), tracking_uri)


def record_or_warn(exp_dir: Path, state: SweepState, tracking_uri: str) -> None:
    """:func:`record_tune_state`, with a warning instead of an error when MLflow or the directory
    cannot be written: the sweep goes on, and a resume refuses the state it could not record."""
    try:
        record_tune_state(exp_dir, state, tracking_uri)
    except (MlflowException, OSError) as exc:  # requests' errors are OSErrors
        logger.warning("sweep %s: Tune's state could not be recorded (%s); a resume would refuse it", exp_dir.name,
                       described(exc))


def check_record(exp_dir: Path, state: SweepState, name: str, tracking_uri: str) -> None:
    """:class:`UnvouchedTuneState` unless ``state`` (the sweep's :data:`STATE_FILE`) names the
    MLflow parent run of sweep ``name`` and that run holds the digest of its record of Tune's
    state (:data:`TUNE_STATE_TAG`): the file lies in the sweep directory, the run does not."""
    record = exp_dir / STATE_FILE
    tags = tracking.run_tags(tracking_uri, state.parent_run_id)
    if tags is None:
        raise UnvouchedTuneState(f"{record}: its parent run {state.parent_run_id} is not in {masked(tracking_uri)}, "
                                 "so nothing vouches for its record of Tune's state")
    if tags.get(tracking.SWEEP_TAG) != name:
        raise UnvouchedTuneState(f"{record}: its parent run {state.parent_run_id} is not sweep {name!r}'s")
    held = tags.get(TUNE_STATE_TAG)
    if held != state_digest(state.tune_state):
        raise UnvouchedTuneState(f"{record}: its record of Tune's state " + (
            f"differs from the one the sweep's MLflow run {state.parent_run_id} holds" if held else
            f"has no copy in the sweep's MLflow run {state.parent_run_id} (a sweep of an earlier pairsim)"))


def verify_tune_state(exp_dir: Path, recorded: dict[str, str]) -> None:
    """:class:`UnvouchedTuneState` naming the first of Tune's state files in ``exp_dir`` that has no
    digest in ``recorded`` or another one."""
    for name, path in tune_state_files(exp_dir).items():
        if name not in recorded:
            raise UnvouchedTuneState(f"{path}: pairsim recorded no SHA-256 of it")
        untrusted.verify_digest(path, recorded[name], UnvouchedTuneState)


class SweepProgress(tune.Callback):
    """On the sweep driver: a table row as each trial ends, a progress line with an ETA, and the
    child run's final MLflow status (a trial ASHA stops is killed: its run is ended here)."""

    def __init__(self, sweep: Sweep, name: str, tracking_uri: str, total_trials: int):
        self.sweep, self.name, self.tracking_uri, self.total = sweep, name, tracking_uri, total_trials
        self.started = time.time()
        self.epochs: dict[str, int] = {}
        self.best: dict[str, float] = {}
        self.last: dict[str, dict[str, float]] = {}  # each objective at the trial's latest epoch
        self.ended: dict[str, str] = {}

    def setup(self, **info) -> None:
        self.started = time.time()
        print(results.table_header(self.sweep), flush=True)

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        self.epochs[trial.trial_id] = int(result.get("epoch", 0))
        value = result.get(self.sweep.metric)
        if value is not None:
            old = self.best.get(trial.trial_id)
            better = max if self.sweep.mode == "max" else min
            self.best[trial.trial_id] = value if old is None else better(old, value)
        self.last[trial.trial_id] = {m: float(result[m]) for m, _ in self.sweep.objectives if result.get(m) is not None}

    def _end(self, trials, trial, status: str, error: str = "") -> None:
        self.ended[trial.trial_id] = status
        run_id = tracking.find_run(self.tracking_uri, trial_run_name(self.name, trial.trial_id))
        if run_id:
            tags = {results.STATUS_TAG: status.replace(" ", "_")} | ({tracking.ERROR_TAG: error[:5000]} if error else {})
            tracking.set_run_status(self.tracking_uri, run_id, results.MLFLOW_STATUS[status], tags)
        row = results.TrialRow(trial.trial_id, status, self.epochs.get(trial.trial_id, 0),
                               self.sweep.point_of(trial.config), self.best.get(trial.trial_id), run_id, error,
                               values=self.last.get(trial.trial_id, {}))
        print(results.format_row(row, self.sweep), flush=True)
        print(self._progress(trials), flush=True)

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        done = self.epochs.get(trial.trial_id, 0) >= self.sweep.epochs
        self._end(trials, trial, "finished" if done else "stopped early")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._end(trials, trial, "failed", results.trial_error(trial.error_file))

    def _progress(self, trials) -> str:
        running = [t for t in trials if t.status == "RUNNING" and t.trial_id not in self.ended]
        done = len(self.ended)
        pending = max(self.total - done - len(running), 0)
        spent = sum(self.epochs.values())
        elapsed = time.time() - self.started
        left = pending * self.sweep.epochs + sum(self.sweep.epochs - self.epochs.get(t.trial_id, 0) for t in running)
        eta = f"ETA ≤ {log.duration(elapsed / spent * left)}" if spent else "ETA: after the first epoch"
        stopped = sum(s == "stopped early" for s in self.ended.values())
        failed = sum(s == "failed" for s in self.ended.values())
        return (f"  [{done}/{self.total} done ({stopped} stopped early, {failed} failed), {len(running)} running, "
                f"{pending} pending; {spent} trial-epochs in {log.duration(elapsed)}; {eta}]")


class TuneStateRecorder(tune.Callback):
    """On the sweep driver: Tune's state files' SHA-256s recorded (:func:`record_tune_state`) every
    :data:`RECORD_EVERY_S` while the sweep runs, so that a driver killed outright (SIGKILL, a lost
    machine) leaves a record its resume can check. State Tune wrote after the last record (a few
    seconds' worth) does not match it: such a resume is refused, never run unchecked."""

    def __init__(self, exp_dir: Path, state: SweepState, tracking_uri: str):
        self.exp_dir, self.state, self.tracking_uri, self.recorded = exp_dir, state, tracking_uri, 0.0

    def on_step_end(self, iteration, trials, **info) -> None:
        if time.monotonic() - self.recorded >= RECORD_EVERY_S:
            record_or_warn(self.exp_dir, self.state, self.tracking_uri)
            self.recorded = time.monotonic()


def total_trials(sweep: Sweep) -> int:
    """The trials the sweep starts (a point two grids of a union share, once)."""
    return sweep.settings.num_samples * len(sweep.grid_points()) if sweep.union else sweep.trials_at_most()


def trial_resources(sweep: Sweep) -> dict[str, float]:
    """What one trial reserves: its workers' CPUs (and GPUs) plus its Ray Data share."""
    train = sweep.base.train
    return {"CPU": cluster.run_cpus(sweep.base), "GPU": train.num_workers * train.gpus_per_worker * train.use_gpu}


def concurrency(sweep: Sweep) -> int:
    """Trials run at once: ``max_concurrent_trials``, else as many as the cluster holds.
    Refuses a sweep whose trials do not fit, naming what to change."""
    cluster = ray.cluster_resources()
    need = trial_resources(sweep)
    fits = min(math.floor(cluster.get(r, 0.0) / n + 1e-9) for r, n in need.items() if n > 0)
    if fits < 1:
        raise ConfigError("sweep.resources: one trial needs " + ", ".join(f"{n:g} {r}" for r, n in need.items() if n)
                          + " (workers × per-worker + ray.data_cpus); the cluster has "
                          + ", ".join(f"{cluster.get(r, 0.0):g} {r}" for r in need if need[r]))
    wanted = sweep.settings.max_concurrent_trials
    if wanted is not None and wanted > fits:
        raise ConfigError(f"sweep.max_concurrent_trials: {wanted} trials × " + " + ".join(
            f"{n:g} {r}" for r, n in need.items() if n) + f" do not fit the cluster ({fits} do)")
    return wanted or fits


HEAD_NODE = "node:__internal_head__"  # a resource every Ray head node has one of
HEAD_NODE_FOR_TRIALS = 0.9  # of it; Ray Train's own head-node actors take 0.001 each


def trial_function_resources(sweep: Sweep, trials_at_once: int) -> dict[str, float]:
    """What a trial function reserves. A cold trial's waits on its TorchTrainer: no CPU of its
    own (Ray wants some resource: memory). A warm trial's trains in it: its worker's CPUs (and
    GPU share), as the TorchTrainer's worker would. Either way Ray Data's tasks, which Ray Data
    schedules outside the trial's placement group (``SPREAD``), take ``ray.data_cpus`` of the
    cluster's free CPUs (the trial's cap: ``data.max_cpus``). Under PBT either adds a
    1/``trials_at_once`` share of :data:`HEAD_NODE_FOR_TRIALS` of the head node's
    :data:`HEAD_NODE` unit, so that the whole population can exist (PBT compares it) while only
    ``trials_at_once`` trials run; the others wait as Tune's pending or paused trials and take
    turns."""
    share = ({HEAD_NODE: math.floor(1e4 * HEAD_NODE_FOR_TRIALS / trials_at_once) / 1e4}
             if sweep.settings.pbt else {})
    train = sweep.base.train
    worker = {"CPU": train.cpus_per_worker} | ({"GPU": train.gpus_per_worker} if train.use_gpu else {})
    return (worker if sweep.settings.warm else {"CPU": 0}) | {"memory": TRIAL_MEMORY} | share


def check_warm_placement(sweep: Sweep) -> None:
    """Tune places a warm trial's actor, where the trial trains, by its resources alone: refused
    on a cluster whose nodes carry roles (``ray.node_roles``), which it could not follow."""
    if not sweep.settings.warm:
        return
    roles = cluster.node_roles(sweep.base.ray.node_roles)
    if roles.train or roles.data:
        raise ConfigError(f"sweep.warm: the cluster's nodes carry roles ({roles.train} trains, {roles.data} reads "
                          "data), and Tune places a warm trial's actor, where it trains, without them: set "
                          "sweep.warm: false, or ray.node_roles.placement: off")


@dataclass
class SweepResult:
    name: str
    parent_run_id: str
    tracking_uri: str
    rows: list[results.TrialRow]
    best: results.TrialRow | None
    out_dir: Path


def run_sweep(sweep: Sweep, name: str | None = None, resume: bool = False) -> SweepResult:
    """Run (or, if ``<storage>/<name>`` holds it, resume) the sweep; returns its trials. The sweep
    holds its name while it runs (:data:`SWEEP_LOCK`): a second ``tune`` of the same name is
    refused before Ray starts (:class:`pairsim.locks.NameInUse`)."""
    name = datetime.now().strftime("sweep-%Y%m%d-%H%M%S") if name is None else name
    base = sweep.base
    if isinstance(base.ray.storage_path, str):  # a URI (pairsim.storage): Tune's state and results.csv are files here
        raise ConfigError(f"ray.storage_path: a sweep keeps its state and results on a local or mounted path, "
                          f"not {base.ray.storage_path}; single runs take object storage")
    storage = Path(base.ray.storage_path).resolve()
    exp_dir = Path(driver.run_directory(storage, name, "--name").path)  # the sweep stays in storage
    restoring = tune.Tuner.can_restore(exp_dir)
    if resume and not restoring:
        raise ConfigError(f"--resume: no sweep {name!r} to resume in {storage}")
    recorded = read_state(exp_dir) if restoring else None
    if recorded and recorded.digest != sweep.digest():
        raise ConfigError(f"sweep {name!r} in {storage} was started with another base config, space or settings; "
                          "resume it with the same file and --set options, or give a new --name")
    driver.plan_run(base)
    for point in sweep.points_to_check()[:2]:
        driver.plan_run(sweep.trial_config(point))
    tracking_uri = tracking.resolve_tracking_uri(base.tracking.tracking_uri)
    tracking.check_reachable(tracking_uri)  # in seconds, before Ray starts, as a run checks it
    with locks.hold(exp_dir / SWEEP_LOCK, f"sweep {name!r}"):
        if recorded:  # under the lock: no driver of this sweep is writing Tune's state
            check_record(exp_dir, recorded, name, tracking_uri)
            verify_tune_state(exp_dir, recorded.tune_state)
        return _run(sweep, name, exp_dir, recorded, tracking_uri)


def _run(sweep: Sweep, name: str, exp_dir: Path, recorded: SweepState | None, tracking_uri: str) -> SweepResult:
    """The sweep under its lock: new, or restored from Tune's state that ``recorded`` vouches for."""
    base, restoring = sweep.base, recorded is not None
    cluster.init_ray(base, concurrent_runs=sweep.settings.max_concurrent_trials or 1,
                    log_to_driver=sweep.settings.verbose_trials)
    trials_at_once = concurrency(sweep)
    check_warm_placement(sweep)
    parent_run_id, reopened = tracking.open_sweep_run(
        tracking_uri, base.tracking.experiment, name, sweep.params(),
        {"pairsim.search": sweep.settings.search, "pairsim.scheduler": sweep.settings.scheduler,
         "pairsim.sweep_sha256": sweep.digest()})
    if not reopened:
        results.log_inputs(tracking_uri, parent_run_id, sweep)
    state = SweepState(digest=sweep.digest(), parent_run_id=parent_run_id, source=sweep.source,
                       tune_state=recorded.tune_state if recorded else {})
    write_state(exp_dir, state, tracking_uri)
    logger.info("sweep %s: %d trials of up to %d epochs, %d at a time, ranked by %s (%s); %s",
                name, total_trials(sweep), sweep.epochs, trials_at_once, sweep.metric, sweep.mode,
                "resumed" if restoring else "new")

    job = TrialJob(sweep, name, parent_run_id, str(exp_dir / "runs"), tracking_uri,
                   logging.getLevelName(logger.getEffectiveLevel()) if sweep.settings.verbose_trials
                   else TRIAL_LOG_LEVEL, tracking.context_tags())
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")  # trials see the driver's directory, as a run does
    trainable = tune.with_resources(tune.with_parameters(run_trial, job=job), trial_function_resources(sweep, trials_at_once))
    try:  # Tune writes its state from here on: recorded however the driver stops (but SIGKILL)
        tuner = (tune.Tuner.restore(str(exp_dir), trainable, resume_unfinished=True, resume_errored=False)
                 if restoring else _new_tuner(sweep, exp_dir, trainable, trials_at_once, tracking_uri, state))
        with tracking.ending_run(tracking_uri, parent_run_id) as outcome, signals.stop_on_signals():
            grid = tuner.fit()
            children = tracking.child_runs(tracking_uri, parent_run_id)
            rows = results.trial_rows(grid, sweep, children, name)
            best = results.best_row(rows, sweep)
            results.write(rows, best, sweep, exp_dir, tracking_uri, parent_run_id, children)
            outcome.succeeded = best is not None
    finally:
        record_or_warn(exp_dir, state, tracking_uri)
    return SweepResult(name, parent_run_id, tracking_uri, rows, best, exp_dir)


def _new_tuner(sweep: Sweep, exp_dir: Path, trainable, trials_at_once: int, tracking_uri: str,
               state: SweepState) -> tune.Tuner:
    """A new sweep's ``Tuner`` (its experiment in ``exp_dir``): its search algorithm and scheduler,
    its trials named after it, its callbacks (restored with it)."""
    from ray.tune.search.basic_variant import BasicVariantGenerator

    name, settings = exp_dir.name, sweep.settings
    if settings.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        metrics, modes = (list(x) for x in zip(*sweep.objectives))  # several: Optuna's multi-objective TPE
        search_alg = OptunaSearch(metric=metrics if sweep.multi_objective else metrics[0],
                                  mode=modes if sweep.multi_objective else modes[0], seed=settings.seed)
        searcher_limit = trials_at_once  # Tune wraps a Searcher in a ConcurrencyLimiter
    else:  # the variant generator limits itself
        search_alg = BasicVariantGenerator(random_state=settings.seed,  # PBT: the whole population exists
                                           max_concurrent=0 if settings.pbt else trials_at_once)
        searcher_limit = None
    from pairsim.tune.schedulers import scheduler_of  # imports scikit-learn (PB2), which trials need not

    scheduler = scheduler_of(sweep)
    return tune.Tuner(
        trainable, param_space=sweep.param_space(),
        tune_config=tune.TuneConfig(metric=None if sweep.multi_objective else sweep.metric,  # Tune takes one
                                    mode=None if sweep.multi_objective else sweep.mode, search_alg=search_alg,
                                    scheduler=scheduler, num_samples=settings.num_samples,
                                    max_concurrent_trials=searcher_limit, trial_name_creator=TrialName(name),
                                    trial_dirname_creator=TrialName(name), reuse_actors=settings.warm),
        run_config=tune.RunConfig(name=name, storage_path=str(exp_dir.parent), verbose=0,
                                  # a cold trial's Ray Train retries its workers; Tune retries a warm one
                                  failure_config=tune.FailureConfig(max_failures=sweep.base.ray.max_failures
                                                                    if settings.warm else 0),
                                  callbacks=[SweepProgress(sweep, name, tracking_uri, total_trials(sweep)),
                                             TuneStateRecorder(exp_dir, state, tracking_uri)],
                                  checkpoint_config=tune.CheckpointConfig(
                                      num_to_keep=TUNE_CHECKPOINTS_KEPT if settings.pbt else None)))
