"""The ``sweep:`` section of a sweep file: metrics and modes, the search, the scheduler and its
settings (ASHA; PBT and PB2, with the keys they may change mid-run), trial resources and limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pairsim.config import Bool, Float, Int, Section
from pairsim.tune.space.distributions import Distribution

MAX_TRIALS = 10_000  # a sweep's trials unless sweep.max_trials says more: Tune holds every one on the driver


class ASHASettings(Section):
    """Asynchronous successive halving (Li et al., MLSys 2020) over epochs: at epochs
    grace_period·rfᵏ a trial goes on only if its metric is in the top 1/rf of what trials
    reported there."""

    grace_period: Int = Field(1, ge=1, description="epochs every trial runs before it can be stopped")
    reduction_factor: Float = Field(2.0, gt=1.0, description="rf: the share 1/rf of trials kept at each rung")
    max_t: Int | None = Field(None, ge=1, description="epochs of the longest trial (default: the base's train.epochs)")


MUTABLE_KEYS = (r"optim\.lr", r"loss\.base\.(margin|gamma)", r"loss\.cusa\.(alpha|beta|teacher_temperature)",
                r"loss(\.cusa\.(cross|image|text)_temperature|\.base\.temperature)\.(init|min|max)")
"""Run-config keys (regular expressions) PBT may change mid-run: what a checkpoint does not fix.
The loss's parameters are read from the config each step; the learning rate's schedule restarts
from its new peak (DeepSpeed's scheduler keeps its step, not its base rate); a temperature's
bounds clamp it from the next step, and a changed ``init`` sets it (see :class:`PBTSettings`)."""


POPULATION_SCHEDULERS = ["pbt", "pb2"]  # the schedulers that clone one trial's checkpoint into another
PBT_ONLY = {"resample_probability", "perturbation_factors", "burn_in"}  # settings Ray's PB2 does not take


class PBTSettings(Section):
    """Population Based Training (Jaderberg et al., 2017, arXiv 1711.09846), Ray Tune's
    ``PopulationBasedTraining`` over epochs: every ``perturbation_interval`` epochs a trial in the
    bottom ``quantile_fraction`` of the population (by the sweep's metric) continues from the
    checkpoint of one in the top fraction, with that trial's hyperparameters *explored*: each
    mutated key is resampled from its distribution with ``resample_probability``, else
    multiplied by one of ``perturbation_factors``, then kept inside its distribution's bounds.

    A population that does not fit the cluster at once takes turns: a trial pauses at each
    interval while others run, and resumes from its checkpoint (each resume costs a run's
    start-up). ``synch`` (the default) compares the population when every trial has reached the
    interval — what a population taking turns does anyway, and deterministic; ``synch: false``
    is Ray's asynchronous PBT, which compares a trial with the others' last reports (its first
    round exploits nothing: no trial has yet been saved as a top one).

    A trial that clones another with a mutated ``init`` of a temperature starts from the new τ;
    everything else of the clone's state (weights, optimizer moments, step) is the donor's.

    Under ``scheduler: pb2`` (Population Based Bandits, Parker-Holder et al., NeurIPS 2020, arXiv
    2002.02518; Ray Tune's ``PB2``) the exploit is the same and the explore is a bandit's: a
    Gaussian process fitted to every trial's change of the metric per epoch, against its epoch,
    its metric before and its hyperparameters, proposes the point of the mutations' [low, high]
    box with the highest upper confidence bound (GP-UCB; the box searched on a linear scale,
    a loguniform's too). The mutations must be ranges (uniform, loguniform, quniform, randint);
    ``resample_probability``, ``perturbation_factors`` and ``burn_in`` are PBT's alone. PB2
    records each trial at each comparison and learns from a trial's change between two records
    with the same values: at the first comparison there is none, and a clone takes the donor's
    values (kept inside the bounds)."""

    perturbation_interval: Int = Field(1, ge=1, description="epochs between a trial's exploit/explore decisions")
    mutations: dict[str, Distribution] = Field(
        description="key -> distribution, as in space; a key not in space also starts there (its first value drawn "
                    "from this distribution); only keys a checkpoint does not fix (tune.space.MUTABLE_KEYS)")
    quantile_fraction: Float = Field(0.25, gt=0.0, le=0.5,
                                     description="share of the population at the top and at the bottom")
    resample_probability: Float = Field(0.25, ge=0.0, le=1.0,
                                        description="chance a mutated key is drawn anew rather than perturbed")
    perturbation_factors: tuple[Float, Float] = Field((1.2, 0.8), description="what a perturbed value is multiplied by")
    burn_in: Int = Field(0, ge=0, description="epochs before a trial is first compared")
    synch: Bool = Field(True, description="compare the whole population at each interval (false: Ray's asynchronous PBT)")

    @model_validator(mode="after")
    def _mutations(self) -> PBTSettings:
        if not self.mutations:
            raise ValueError("mutations: needs at least one key, e.g. optim.lr: {loguniform: [1.0e-4, 1.0e-3]}")
        return self


class TrialResources(Section):
    """What one trial reserves; each field left out keeps the base config's value."""

    num_workers: Int | None = Field(None, ge=1, description="train.num_workers")
    cpus_per_worker: Float | None = Field(None, gt=0.0, description="train.cpus_per_worker")
    gpus_per_worker: Float | None = Field(
        None, ge=0.0, description="train.gpus_per_worker; 0 trains on CPU, a fraction lets trials share a GPU")
    data_cpus: Float | None = Field(None, gt=0.0, description="ray.data_cpus: the trial's cap on Ray Data's CPUs")

    def overrides(self) -> dict[str, Any]:
        """The run-config keys these settings stand for."""
        out = {"train.num_workers": self.num_workers, "train.cpus_per_worker": self.cpus_per_worker,
               "ray.data_cpus": self.data_cpus}
        if self.gpus_per_worker is not None:
            out["train.use_gpu"] = self.gpus_per_worker > 0
            if self.gpus_per_worker > 0:
                out["train.gpus_per_worker"] = self.gpus_per_worker
        return {k: v for k, v in out.items() if v is not None}


class SweepSettings(Section):
    """How the space is searched and trials are scheduled."""

    metric: str | list[str] | None = Field(
        None, description="the val metric trials are ranked by (it also picks each trial's best checkpoint); default: "
                          "the base's eval.select_metric. A list searches several at once (multi-objective: the first "
                          "picks checkpoints and best.yaml, the sweep reports their Pareto front)")
    mode: Literal["max", "min"] | list[Literal["max", "min"]] | None = Field(
        None, description="default: each metric's own (min for median ranks)")
    num_samples: Int = Field(8, ge=1, description="trials drawn (random, optuna); repeats of the grid (grid)")
    search: Literal["random", "grid", "optuna"] = Field(
        "random", description="random: Tune's variant generator; grid: every combination of the grid values; "
                              "optuna: TPE (ray.tune.search.optuna.OptunaSearch)")
    scheduler: Literal["fifo", "asha", "pbt", "pb2"] = Field(
        "asha", description="fifo: every trial runs all its epochs; asha: ASHA stops the weak early; pbt: Population "
                            "Based Training; pb2: its bandit variant (new values from a GP-UCB over the mutations' "
                            "bounds, Parker-Holder et al., 2020)")
    asha: ASHASettings | None = Field(None, description="ASHA's rungs (scheduler asha only)")
    pbt: PBTSettings | None = Field(None, description="Population Based Training (scheduler pbt or pb2)")
    max_concurrent_trials: Int | None = Field(
        None, ge=1, description="default: as many as the cluster's CPUs and GPUs hold (1 on a local instance)")
    resources: TrialResources = TrialResources()
    seed: Int | None = Field(0, description="seeds the search (random and optuna); null: unseeded")
    warm: Bool = Field(
        False, description="train each trial in its Tune trial actor, which Tune reuses for the next trial "
                           "(reuse_actors): torch, DeepSpeed and open_clip are imported once per actor, not once per "
                           "trial. For trials of one worker (train.num_workers 1) on a cluster without node roles; "
                           "a failed trial is retried by Tune (ray.max_failures times) from its last checkpoint")
    verbose_trials: Bool = Field(False, description="show the trials' own logs (training progress) on the console")
    max_trials: Int = Field(
        MAX_TRIALS, ge=1, description="the most trials the sweep may start (num_samples × its grid points); a larger "
                                      "sweep is refused before Ray starts. Raise it for a sweep that large: Tune "
                                      "keeps every trial on the driver")

    @property
    def metrics(self) -> list[str] | None:
        """The metric names as the evaluation reports them (a ``val/`` prefix dropped), or None."""
        if self.metric is None:
            return None
        return [m.removeprefix("val/") for m in ([self.metric] if isinstance(self.metric, str) else self.metric)]

    @model_validator(mode="after")
    def _scheduler_options(self) -> SweepSettings:
        if isinstance(self.metric, list) and len(self.metric) > 1 and "scheduler" not in self.model_fields_set:
            self.scheduler = "fifo"  # ASHA and PBT rank by one metric
        if isinstance(self.metric, list) and not self.metric:
            raise ValueError("metric: an empty list; name one metric or several, e.g. [rsum, i2i_mAP@R]")
        for name, schedulers in (("asha", ["asha"]), ("pbt", POPULATION_SCHEDULERS)):
            if self.scheduler not in schedulers and getattr(self, name) is not None:
                raise ValueError(f"{name}: only for scheduler {' or '.join(schedulers)}, not {self.scheduler}")
        if self.scheduler == "asha" and self.asha is None:
            self.asha = ASHASettings()
        if self.scheduler in POPULATION_SCHEDULERS and self.pbt is None:
            raise ValueError(f"pbt: scheduler {self.scheduler} needs its settings, at least pbt.mutations (the keys it "
                             "may change)")
        if self.scheduler == "pb2" and (pbt_only := sorted(PBT_ONLY & self.pbt.model_fields_set)):
            raise ValueError(f"pbt.{pbt_only[0]}: PBT's alone; PB2 draws a clone's values from its bandit, within "
                             "the mutations' bounds, and compares trials from their first report")
        return self


class SweepFile(Section):
    base: dict[str, Any] = Field(default_factory=dict, description="config: run YAML(s), plus inline run-config keys")
    space: dict[str, Distribution] | list[dict[str, Distribution]] = Field(
        default_factory=dict, description="dotted key -> distribution; or a list of such grids, run as their union")
    sweep: SweepSettings = SweepSettings()
