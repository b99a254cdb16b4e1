"""Sweep-file validation (``pairsim.tune.space``): fast, no Ray instance, no training.

Every sweep YAML is written into ``tmp_path``; bases layer the shipped configs
(``pairsim:demo.yaml``, ``pairsim:objectives/*.yaml``). Errors are checked by the path each
line of the :class:`ConfigError` starts with (``space.loss.base.margin: ...``, ``sweep.search: ...``).
"""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from pairsim.config import ConfigError, load_config
from pairsim.tune.space import SHIPPED_CONFIGS, Distribution, load_sweep

REPO = Path(__file__).parents[1]
TUNE_SPACES = sorted((REPO / "tune_spaces").glob("*.yaml"))
DEMO = {"config": ["pairsim:demo.yaml"]}  # unified loss, margin 0.1, gamma 20, train.epochs 6
INFONCE = {"config": ["pairsim:demo.yaml"], "loss": {"base": "infonce"}}


def write_sweep(tmp_path: Path, base=None, space=None, sweep=None, name: str = "sweep.yaml", **extra) -> Path:
    tree = {"base": DEMO if base is None else base}
    if space is not None:
        tree["space"] = space
    if sweep is not None:
        tree["sweep"] = sweep
    tree |= extra
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def sweep_error(path: Path, overrides=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_sweep(path, overrides)
    return str(err.value)


def error_lines(message: str) -> list[str]:
    """The problem lines under the ``N error(s) in FILE:`` header, stripped."""
    return [line.strip() for line in message.splitlines()[1:]]


def line_of(message: str, prefix: str) -> str:
    """The one problem line starting with ``prefix`` (fails listing the message if none)."""
    found = [line for line in error_lines(message) if line.startswith(prefix)]
    assert found, f"no line starting with {prefix!r} in:\n{message}"
    return found[0]


def error_count(message: str) -> int:
    match = re.match(r"(\d+) error\(s\) in ", message)
    assert match, message
    return int(match.group(1))


# 1. the shipped sweep files -------------------------------------------------------------------


def test_tune_spaces_directory_holds_the_shipped_sweeps():
    assert {p.stem for p in TUNE_SPACES} >= {"cusa", "gcl", "gcl_unified", "infonce_temperature", "unified"}


@pytest.mark.parametrize("path", TUNE_SPACES + [SHIPPED_CONFIGS / "demo_sweep.yaml"],
                         ids=[p.stem for p in TUNE_SPACES] + ["configs/demo_sweep"])
def test_shipped_sweep_file_loads_and_every_checked_point_is_a_valid_trial(path):
    sweep = load_sweep(path)
    flat = sweep.base.flat()
    assert sweep.keys, path
    assert set(sweep.keys) <= set(flat), set(sweep.keys) - set(flat)
    points = sweep.points_to_check()
    assert len(points) > 16  # corners + the seeded random points
    for point in points:
        trial = sweep.trial_config(point).flat()
        for key, value in point.items():
            assert trial[key] == value, (key, value, trial[key])


# 2, 9. keys the base config does not have -----------------------------------------------------


def test_parameter_of_another_base_loss_is_not_a_key_of_the_base(tmp_path):
    path = write_sweep(tmp_path, base=INFONCE, space={"loss.base.margin": {"uniform": [0.0, 0.3]}})
    line = line_of(sweep_error(path), "space.loss.base.margin:")
    assert "not a key of the base config" in line
    assert "infonce" in line


def test_unknown_key_in_space_is_named(tmp_path):
    path = write_sweep(tmp_path, space={"loss.magrin": {"uniform": [0.0, 0.3]}})
    line = line_of(sweep_error(path), "space.loss.magrin:")
    assert "not a key of the base config" in line and "unknown key" in line


def test_key_of_an_unset_optional_section_says_the_section_is_not_set(tmp_path):
    path = write_sweep(tmp_path, space={"loss.cusa.alpha": {"uniform": [0.05, 0.2]}})
    line = line_of(sweep_error(path), "space.loss.cusa.alpha:")
    assert "not a key of the base config" in line
    assert "loss.cusa is not set there" in line


# 3-5. one key's distribution --------------------------------------------------------------------


def test_bound_outside_the_field_limits_is_named_with_the_bound(tmp_path):
    path = write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.0, 3.0]}})
    message = sweep_error(path)
    line = line_of(message, "space.loss.base.margin:")
    assert "high 3.0" in line
    assert "less than or equal to 2" in line
    assert "low 0.0" not in message  # the valid bound is not blamed


@pytest.mark.parametrize("key, spec, expected", [
    ("loss.base.margin", {"uniform": [0.4, 0.1]}, r"uniform needs low < high, got low=0\.4, high=0\.1"),
    ("loss.base.gamma", {"loguniform": [0, 100]}, r"loguniform needs 0 < low"),
    ("loss.base.gamma", {"loguniform": [-1.0, 100]}, r"loguniform needs 0 < low"),
    ("optim.lr", {"quniform": [0.001, 0.01, 0]}, r"quniform needs q > 0"),
    ("optim.lr", {"quniform": [0.001, 0.01, -0.001]}, r"quniform needs q > 0"),
    ("optim.lr", {"quniform": [0.001, 0.01]}, r"quniform needs \[low, high, q\]"),
    ("train.epochs", {"randint": [1.0, 3.0]}, r"randint needs integer bounds"),
    ("optim.weight_decay", {"normal": [0.0, 1.0]}, r"'uniform', 'loguniform', 'quniform', 'randint'"),
    ("optim.eps", {"choice": []}, r"choice needs at least one value"),
    ("optim.eps", {"grid": []}, r"grid needs at least one value"),
    ("loss.base.margin", {"uniform": [True, 1]}, r"uniform needs \[low, high\] as numbers"),
    ("loss.base.margin", {"uniform": [0.1, 0.2], "choice": [0.3]}, r"write one distribution"),
], ids=["uniform-unordered", "loguniform-zero-low", "loguniform-negative-low", "quniform-zero-q",
        "quniform-negative-q", "quniform-no-q", "randint-float-bounds", "unknown-distribution", "empty-choice",
        "empty-grid", "bool-bound", "two-distributions"])
def test_malformed_distribution_is_named_by_its_key(tmp_path, key, spec, expected):
    path = write_sweep(tmp_path, space={key: spec})
    message = sweep_error(path)
    assert re.search(expected, line_of(message, f"space.{key}:")), message
    assert error_count(message) == 1, message


def test_infinite_bound_is_refused(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("base: {config: [pairsim:demo.yaml]}\nspace: {loss.base.margin: {uniform: [0.0, .inf]}}\n")
    assert "bounds must be finite" in line_of(sweep_error(path), "space.loss.base.margin:")


def test_uniform_over_an_integer_key_is_refused(tmp_path):
    path = write_sweep(tmp_path, space={"train.epochs": {"uniform": [1, 3]}}, sweep={"asha": {"max_t": 3}})
    line = line_of(sweep_error(path), "space.train.epochs:")
    assert "valid integer" in line
    assert line.startswith("space.train.epochs: sampled ")  # both corners (1, 3) are integers


def test_randint_over_an_integer_key_is_valid(tmp_path):
    path = write_sweep(tmp_path, space={"train.epochs": {"randint": [1, 3]}}, sweep={"asha": {"max_t": 3}})
    sweep = load_sweep(path)
    assert sweep.epochs == 3
    assert sweep.base.train.epochs == 6  # a swept train.epochs is not overwritten by max_t
    assert sweep.trial_config({"train.epochs": 2}).train.epochs == 2


def test_swept_epochs_need_asha_max_t(tmp_path):
    path = write_sweep(tmp_path, space={"train.epochs": {"randint": [1, 3]}})
    assert "needed when train.epochs is swept" in line_of(sweep_error(path), "sweep.asha.max_t:")


# 6. the space as a whole ------------------------------------------------------------------------


def test_corner_with_init_above_max_is_refused_as_a_point(tmp_path):
    space = {"loss.base.temperature.init": {"uniform": [0.02, 0.09]}, "loss.base.temperature.max": {"uniform": [0.05, 0.2]}}
    message = sweep_error(write_sweep(tmp_path, base=INFONCE, space=space))
    lines = error_lines(message)
    assert lines and all(line.startswith("space: the point ") for line in lines), message
    assert "'loss.base.temperature.init': 0.09, 'loss.base.temperature.max': 0.05" in message  # the bad corner
    assert "need min <= init <= max" in lines[0]


def test_space_whose_every_point_is_ordered_is_valid(tmp_path):
    space = {"loss.base.temperature.init": {"uniform": [0.02, 0.09]}, "loss.base.temperature.max": {"uniform": [0.1, 0.2]}}
    sweep = load_sweep(write_sweep(tmp_path, base=INFONCE, space=space))
    assert sweep.base.loss.base.name == "infonce"


# 7. sweep settings -------------------------------------------------------------------------------


@pytest.mark.parametrize("space, sweep, prefix, expected", [
    ({"loss.base.margin": {"grid": [0.1, 0.2]}}, {"search": "optuna"}, "sweep.search:", r"optuna .*no grid.*loss\.base\.margin"),
    ({"loss.base.margin": {"grid": [0.1, 0.2]}, "loss.base.gamma": {"uniform": [10, 30]}}, {"search": "grid"},
     "sweep.search:", r"grid needs every space key to be a grid; not: loss\.base\.gamma$"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"scheduler": "fifo", "asha": {"grace_period": 1}},
     "sweep", r"asha: only for scheduler asha, not fifo"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"num_samples": 0}, "sweep.num_samples:", r"greater than or equal to 1"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"mode": "min"}, "sweep.mode:", r"'min', but val/rsum is ranked 'max'"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"metric": "t2i_median_rank", "mode": "max"}, "sweep.mode:",
     r"val/t2i_median_rank is ranked 'min'"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"search": "bayes"}, "sweep.search:", r"'random', 'grid' or 'optuna'"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"asha": {"grace_period": 3, "max_t": 2}},
     "sweep.asha.grace_period:", r"3 epochs is more than the 2 a trial runs"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"num_sample": 4}, "sweep.num_sample:", r"unknown key"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"warm": True}, "sweep.warm:", r"one worker.* have 2 train"),
    ({"train.num_workers": {"choice": [1, 2]}}, {"warm": True}, "sweep.warm:", r"have a swept train\.num_workers"),
], ids=["optuna-with-grid", "grid-with-uniform", "fifo-with-asha", "zero-samples", "min-for-rsum",
        "max-for-median-rank", "unknown-search", "grace-beyond-max-t", "misspelt-setting", "warm-with-two-workers",
        "warm-with-swept-workers"])
def test_bad_sweep_setting_is_named(tmp_path, space, sweep, prefix, expected):
    message = sweep_error(write_sweep(tmp_path, space=space, sweep=sweep))
    line = line_of(message, prefix)
    assert re.search(expected, line), message
    if prefix == "sweep":  # fifo-with-asha: the line names asha
        assert "asha" in line
    assert error_count(message) == 1, message


def test_unknown_metric_is_refused_under_sweep_metric(tmp_path):
    message = sweep_error(write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.1, 3.0]}},
                                      sweep={"metric": "nonsense"}))
    assert re.search(r"select_metric: 'nonsense' is not a metric", line_of(message, "sweep.metric:")), message
    assert "Value error" not in message
    assert line_of(message, "space.loss.base.margin:")  # the space is still checked


def test_one_bad_sweep_setting_does_not_hide_the_others(tmp_path):
    message = sweep_error(write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.1, 0.2]}},
                                      sweep={"num_samples": 0, "search": "grid", "mode": "min"}))
    assert line_of(message, "sweep.num_samples:") and line_of(message, "sweep.mode:")
    assert "grid" in line_of(message, "sweep.search:")


def test_quniform_bounds_must_be_multiples_of_q(tmp_path):
    message = sweep_error(write_sweep(tmp_path, space={"loss.base.margin": {"quniform": [0.05, 0.35, 0.1]}}))
    assert "multiples of q" in line_of(message, "space.loss.base.margin:")


def test_a_set_on_an_empty_space_or_sweep_section(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("base: {config: [pairsim:demo.yaml]}\nspace:\nsweep:\n")
    sweep = load_sweep(path, ["space.loss.base.margin={uniform: [0.0, 0.2]}", "sweep.num_samples=3"])
    assert sweep.settings.num_samples == 3 and sweep.keys == ["loss.base.margin"]


def test_a_space_of_the_last_releases_flat_loss_keys_reads_with_a_warning_naming_the_new_keys(tmp_path):
    old = {"loss.margin": {"uniform": [0.0, 0.3]}, "loss.gamma": {"grid": [20, 40]}}
    with pytest.warns(FutureWarning) as warned:
        sweep = load_sweep(write_sweep(tmp_path, space=old))
    assert any("loss.margin " in str(w.message) and "loss.base.margin" in str(w.message) for w in warned)  # old, new
    assert sweep.keys == ["loss.base.margin", "loss.base.gamma"]
    trial = sweep.trial_config({"loss.base.margin": 0.25, "loss.base.gamma": 40})
    assert (trial.loss.base.margin, trial.loss.base.gamma) == (0.25, 40)


def test_a_bad_base_config_entry_is_named_once(tmp_path):
    message = sweep_error(write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.1, 0.2]}},
                                      base={"config": [3]}))
    assert line_of(message, "base.config: expected a path") and "base.config: base.config" not in message


def test_known_metric_sets_the_sweeps_metric_and_mode(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.1, 0.2]}},
                                   sweep={"metric": "t2i_median_rank"}))
    assert (sweep.metric, sweep.mode) == ("val/t2i_median_rank", "min")
    assert sweep.base.eval.select_metric == "t2i_median_rank"


def test_unknown_top_level_section_and_empty_space_are_named(tmp_path):
    message = sweep_error(write_sweep(tmp_path, space={}, sweeps={"num_samples": 2}))
    assert "needs at least one key" in line_of(message, "space:")
    assert "unknown key" in line_of(message, "sweeps:")
    assert error_count(message) == 2


# 8. every problem at once -----------------------------------------------------------------------


def test_all_independent_problems_are_reported_in_one_error(tmp_path):
    path = write_sweep(tmp_path, space={
        "loss.base.margin": {"uniform": [0.0, 3.0]},      # a bound beyond the field's limit
        "loss.nope": {"uniform": [0.1, 0.2]},        # not a key
        "optim.lr": {"uniform": [0.4, 0.1]},         # unordered bounds
    }, sweep={"num_samples": 0})                     # a bad setting
    message = sweep_error(path)
    assert message.splitlines()[0] == f"4 error(s) in {path}:"
    assert error_count(message) == len(error_lines(message)) == 4
    assert "high 3.0" in line_of(message, "space.loss.base.margin:")
    assert "not a key of the base config" in line_of(message, "space.loss.nope:")
    assert "low < high" in line_of(message, "space.optim.lr:")
    assert line_of(message, "sweep.num_samples:")


# 10. --set overrides -----------------------------------------------------------------------------


def test_overrides_set_sweep_settings_and_base_keys(tmp_path):
    path = write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.0, 0.4]}}, sweep={"num_samples": 8})
    plain = load_sweep(path)
    assert (plain.settings.num_samples, plain.base.train.epochs) == (8, 6)
    sweep = load_sweep(path, ["sweep.num_samples=3", "train.epochs=2"])
    assert sweep.settings.num_samples == 3
    assert sweep.base.train.epochs == 2
    assert sweep.epochs == 2


def test_space_override_replaces_the_distribution(tmp_path):
    path = write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.0, 0.4]}, "loss.base.gamma": {"uniform": [10, 30]}})
    sweep = load_sweep(path, ["space.loss.base.margin={uniform: [0.0, 0.2]}"])
    [space] = sweep.spaces
    assert space["loss.base.margin"] == Distribution(kind="uniform", args=[0.0, 0.2])
    assert space["loss.base.gamma"].args == [10, 30]  # the other keys stay


def test_space_override_is_validated_like_the_file(tmp_path):
    path = write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.0, 0.4]}})
    message = sweep_error(path, ["space.loss.base.margin={uniform: [0.0, 3.0]}", "sweep.num_samples=0"])
    assert "high 3.0" in line_of(message, "space.loss.base.margin:")
    assert line_of(message, "sweep.num_samples:")


# 11. partly written CUSA temperatures ---------------------------------------------------------


def test_sweeping_a_cusa_temperature_init_keeps_its_own_defaults(tmp_path):
    base = {"config": ["pairsim:demo.yaml", "pairsim:objectives/cusa_unified.yaml"]}
    sweep = load_sweep(write_sweep(tmp_path, base=base,
                                   space={"loss.cusa.cross_temperature.init": {"uniform": [0.1, 0.99]},
                                          "loss.cusa.text_temperature.init": {"uniform": [0.1, 1.0]}}))
    assert (sweep.base.loss.cusa.cross_temperature.min, sweep.base.loss.cusa.cross_temperature.max) == (0.1, 0.99)
    for init in (0.1, 0.99):
        trial = sweep.trial_config({"loss.cusa.cross_temperature.init": init, "loss.cusa.text_temperature.init": 1.0})
        cross, text = trial.loss.cusa.cross_temperature, trial.loss.cusa.text_temperature
        assert (cross.init, cross.min, cross.max) == (init, 0.1, 0.99)  # the authors' τ_c range
        assert (text.init, text.min, text.max) == (1.0, 0.1, 1.0)


def test_load_config_with_a_partly_written_cusa_temperature_keeps_its_own_defaults():
    cfg = load_config(SHIPPED_CONFIGS / "objectives" / "cusa_unified.yaml", ["loss.cusa.cross_temperature.init=0.5",
                                                                             "loss.cusa.image_temperature.init=0.5"])
    cross, image = cfg.loss.cusa.cross_temperature, cfg.loss.cusa.image_temperature
    assert (cross.init, cross.min, cross.max) == (0.5, 0.1, 0.99)
    assert (image.init, image.min, image.max) == (0.5, 0.1, 1.0)
    assert cfg.loss.base.margin == 0.2  # the objective's own values stay


# 12. Distribution ----------------------------------------------------------------------------------


def test_randint_corners_exclude_high():
    assert Distribution.model_validate({"randint": [1, 5]}).corners() == [1, 4]


def test_quniform_corners_are_multiples_of_q():
    corners = Distribution.model_validate({"quniform": [0.1, 0.3, 0.1]}).corners()
    assert len(corners) == 2 and corners[0] < corners[1]
    for corner in corners:
        assert math.isclose(corner / 0.1, round(corner / 0.1), abs_tol=1e-9), corners


def test_choice_and_grid_corners_are_every_value():
    assert Distribution.model_validate({"choice": [16, 32, 64]}).corners() == [16, 32, 64]
    assert Distribution.model_validate({"grid": [True, False]}).corners() == [True, False]


@pytest.mark.parametrize("spec", [
    {"uniform": [0.1, 0.4]}, {"loguniform": [1e-4, 1e-1]}, {"quniform": [0.1, 0.5, 0.1]},
    {"randint": [1, 5]}, {"choice": [16, 32, 64]}, {"grid": ["a", "b"]},
], ids=lambda s: next(iter(s)))
def test_samples_stay_inside_the_bounds(spec):
    dist = Distribution.model_validate(spec)
    rng = np.random.default_rng(1)
    draws = [dist.sample(rng) for _ in range(200)]
    if dist.kind in ("choice", "grid"):
        assert set(draws) == set(dist.args)
        return
    low, high = dist.args[:2]
    if dist.kind == "randint":
        assert all(isinstance(d, int) for d in draws)
        assert set(draws) == set(range(low, high))  # high excluded, every other value drawn
        return
    assert all(isinstance(d, float) for d in draws)
    assert all(low - 1e-12 <= d <= high + 1e-12 for d in draws), (min(draws), max(draws))
    assert max(draws) - min(draws) > (high - low) / 2  # spread over the range, not stuck at one value
    if dist.kind == "quniform":
        q = dist.args[2]
        assert all(math.isclose(d / q, round(d / q), abs_tol=1e-9) for d in draws)
    if dist.kind == "loguniform":  # log-uniform: about half the draws below the geometric mean
        below = sum(d < math.sqrt(low * high) for d in draws)
        assert 60 < below < 140, below


def test_domain_gives_ray_tune_search_objects():
    from ray.tune.search import sample

    def domain(spec):
        return Distribution.model_validate(spec).domain()

    for spec in ({"uniform": [0.0, 0.4]}, {"loguniform": [10, 100]}, {"quniform": [0.1, 0.5, 0.1]}):
        dom = domain(spec)
        assert isinstance(dom, sample.Float), spec
        assert (dom.lower, dom.upper) == tuple(next(iter(spec.values()))[:2])
    assert isinstance(domain({"loguniform": [10, 100]}).get_sampler(), sample.LogUniform)
    integer = domain({"randint": [1, 5]})
    assert isinstance(integer, sample.Integer) and (integer.lower, integer.upper) == (1, 5)
    categorical = domain({"choice": [16, 32]})
    assert isinstance(categorical, sample.Categorical) and categorical.categories == [16, 32]
    assert domain({"grid": [0.1, 0.2]}) == {"grid_search": [0.1, 0.2]}


# 13, 14. digest, params, epochs ----------------------------------------------------------------


def test_digest_is_stable_for_the_same_file_and_changes_with_a_bound(tmp_path):
    space = {"loss.base.margin": {"uniform": [0.0, 0.4]}, "loss.base.gamma": {"loguniform": [10, 100]}}
    first = load_sweep(write_sweep(tmp_path, space=space, name="a.yaml"))
    again = load_sweep(write_sweep(tmp_path, space=space, name="b.yaml"))
    assert first.digest() == again.digest()
    assert len(first.digest()) == 64
    changed = dict(space, **{"loss.base.margin": {"uniform": [0.0, 0.3]}})
    assert load_sweep(write_sweep(tmp_path, space=changed, name="c.yaml")).digest() != first.digest()
    assert load_sweep(write_sweep(tmp_path, space=space, name="d.yaml"),
                      ["train.epochs=3"]).digest() != first.digest()  # the base counts too


def test_params_name_the_space_and_the_settings(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.0, 0.4]}},
                                   sweep={"search": "optuna", "num_samples": 5}))
    params = sweep.params()
    assert params["space.loss.base.margin"] == "uniform[0.0, 0.4]"
    assert params["sweep.search"] == "optuna"
    assert params["sweep.num_samples"] == 5
    assert (params["sweep.metric"], params["sweep.mode"]) == ("val/rsum", "max")
    assert params["base.sha256"] == sweep.digest()[:16]


def test_asha_max_t_caps_the_base_epochs(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.0, 0.4]}},
                                   sweep={"asha": {"max_t": 2}}))
    assert sweep.base.train.epochs == 2
    assert sweep.epochs == 2
    assert sweep.trial_config({"loss.base.margin": 0.2}).train.epochs == 2


def test_without_max_t_a_trial_runs_the_base_epochs(tmp_path):
    for settings in ({"scheduler": "fifo"}, {"asha": {"grace_period": 2}}):
        sweep = load_sweep(write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.0, 0.4]}}, sweep=settings))
        assert sweep.base.train.epochs == sweep.epochs == 6


# 15. a union of grids ------------------------------------------------------------------------------

FIG5_M = [{"loss.base.margin": m, "loss.base.gamma": 60} for m in (0.0, 0.1, 0.2, 0.3, 0.4)]
FIG5_GAMMA = [{"loss.base.margin": 0.2, "loss.base.gamma": g} for g in (20, 40, 80, 100)]  # (0.2, 60) is in FIG5_M


def union_sweep(tmp_path: Path, *grids: dict, base=None, sweep=None, overrides=None, name="union.yaml"):
    path = write_sweep(tmp_path, base=base, space=list(grids), sweep={"search": "grid", **(sweep or {})}, name=name)
    return path if overrides is False else load_sweep(path, overrides)


def test_figure5_sweep_runs_each_point_of_its_two_grids_once():
    from pairsim.tune.sweep import total_trials

    sweep = load_sweep(REPO / "tune_spaces" / "unified_figure5.yaml")
    assert sweep.union and sweep.keys == ["loss.base.margin", "loss.base.gamma"]
    assert sweep.grid_points() == FIG5_M + FIG5_GAMMA  # 9, not 10: the grids share (0.2, 60)
    assert total_trials(sweep) == 9
    assert (sweep.settings.search, sweep.settings.scheduler, sweep.settings.num_samples) == ("grid", "fifo", 1)
    assert (sweep.base.loss.base.name, sweep.base.model.arch) == ("unified", "pairsim-tiny")  # demo + the unified preset
    assert sweep.param_space() == {"point": {"grid_search": FIG5_M + FIG5_GAMMA}}
    for point in sweep.grid_points():
        assert sweep.point_of({"point": point}) == point
        trial = sweep.trial_config(point)
        assert (trial.loss.base.margin, trial.loss.base.gamma) == (point["loss.base.margin"],
                                                                                 point["loss.base.gamma"])


def test_a_key_a_grid_leaves_out_keeps_the_base_value_and_shared_points_run_once(tmp_path):
    sweep = union_sweep(tmp_path, {"loss.base.margin": {"grid": [0.1, 0.3]}}, {"loss.base.gamma": {"grid": [20, 40]}},
                        {"loss.base.gamma": {"grid": [40.0]}, "loss.base.margin": {"grid": [0.3]}})
    # the demo's base: margin 0.1, gamma 20; (0.1, 20) is in both grids, 40 and 40.0 are one value
    assert sweep.grid_points() == [{"loss.base.margin": 0.1, "loss.base.gamma": 20.0}, {"loss.base.margin": 0.3, "loss.base.gamma": 20.0},
                                   {"loss.base.margin": 0.1, "loss.base.gamma": 40}, {"loss.base.margin": 0.3, "loss.base.gamma": 40.0}]
    assert sweep.keys == ["loss.base.margin", "loss.base.gamma"]


def test_a_single_space_keeps_its_tune_config_and_digest(tmp_path):
    space = {"loss.base.margin": {"grid": [0.1, 0.3]}, "loss.base.gamma": {"grid": [20, 40]}}
    plain = load_sweep(write_sweep(tmp_path, space=space, sweep={"search": "grid"}, name="plain.yaml"))
    listed = union_sweep(tmp_path, space, name="listed.yaml")  # a list of one grid is that grid
    for sweep in (plain, listed):
        assert not sweep.union
        assert sweep.param_space() == {"loss.base.margin": {"grid_search": [0.1, 0.3]},
                                       "loss.base.gamma": {"grid_search": [20, 40]}}
        assert sweep.point_of({"loss.base.margin": 0.3, "loss.base.gamma": 40}) == {"loss.base.margin": 0.3, "loss.base.gamma": 40}
    assert listed.digest() == plain.digest()
    assert listed.params()["space.loss.base.margin"] == "grid[0.1, 0.3]"


def test_union_digest_and_params_name_each_grid(tmp_path):
    grids = ({"loss.base.margin": {"grid": [0.1, 0.3]}}, {"loss.base.gamma": {"grid": [20, 40]}})
    sweep = union_sweep(tmp_path, *grids, name="a.yaml")
    assert sweep.digest() == union_sweep(tmp_path, *grids, name="b.yaml").digest()
    assert sweep.digest() != union_sweep(tmp_path, grids[0], {"loss.base.gamma": {"grid": [20, 60]}},
                                         name="c.yaml").digest()
    assert sweep.digest() != union_sweep(tmp_path, grids[1], grids[0], name="d.yaml").digest()  # another order
    params = sweep.params()
    assert (params["space.0.loss.base.margin"], params["space.1.loss.base.gamma"]) == ("grid[0.1, 0.3]", "grid[20, 40]")


@pytest.mark.parametrize("search", ["random", "optuna"])
def test_other_searches_refuse_a_list_of_grids(tmp_path, search):
    path = union_sweep(tmp_path, {"loss.base.margin": {"grid": [0.1]}}, {"loss.base.gamma": {"grid": [20]}},
                       sweep={"search": search}, overrides=False)
    message = sweep_error(path)
    assert re.search(rf"list of grids, run as their union by search: grid only \(not {search}\)",
                     line_of(message, "sweep.search:")), message
    assert error_count(message) == 1, message


def test_union_errors_name_the_grid_and_the_key(tmp_path):
    path = union_sweep(tmp_path, {"loss.magrin": {"grid": [0.1]}},
                       {"loss.base.margin": {"grid": [0.1]}, "loss.base.gamma": {"grid": [20, 0.0]}},
                       {"loss.base.gamma": {"uniform": [20, 40]}}, {}, {"loss.base.margin": {"grid": []}}, overrides=False)
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    assert set(err.value.keys) == {"space.0.loss.magrin", "space.1.loss.base.gamma", "sweep.search", "space.3",
                                   "space.4.loss.base.margin"}  # each grid's key, as in the file
    message = str(err.value)
    assert "not a key of the base config" in line_of(message, "space.0.loss.magrin:")
    assert re.search(r"value 0\.0 gives an invalid run config: .*greater than 0", line_of(message, "space.1.loss.base.gamma:"))
    assert line_of(message, "sweep.search:").endswith("grid needs every space key to be a grid; not: "
                                                      "space.2.loss.base.gamma")
    assert "at least one key" in line_of(message, "space.3:")
    assert "grid needs at least one value" in line_of(message, "space.4.loss.base.margin:")
    assert error_count(message) == 5, message


def test_union_points_are_checked_grid_by_grid(tmp_path):
    path = union_sweep(tmp_path, {"loss.base.temperature.init": {"grid": [0.05]}},
                       {"loss.base.temperature.init": {"grid": [0.09]}, "loss.base.temperature.max": {"grid": [0.05, 0.1]}},
                       base=INFONCE, overrides=False)
    message = sweep_error(path)
    line = line_of(message, "space.1: the point ")
    assert "{'loss.base.temperature.init': 0.09, 'loss.base.temperature.max': 0.05}" in line and "min <= init <= max" in line
    assert error_count(message) == 1, message


def test_set_changes_a_key_of_one_grid(tmp_path):
    path = union_sweep(tmp_path, {"loss.base.margin": {"grid": [0.1]}}, {"loss.base.gamma": {"grid": [20, 40]}}, overrides=False)
    sweep = load_sweep(path, ["space.1.loss.base.gamma={grid: [60]}", "space.0.loss.base.gamma={grid: [80]}"])
    assert sweep.grid_points() == [{"loss.base.margin": 0.1, "loss.base.gamma": 80}, {"loss.base.margin": 0.1, "loss.base.gamma": 60}]
    message = sweep_error(path, ["space.loss.base.gamma={grid: [60]}", "space.2.loss.base.gamma={grid: [60]}"])
    line = line_of(message, "--set space.loss.base.gamma:")  # the grids there are, how to name one
    assert "2 grid(s)" in line and "(0 to 1)" in line and "space.<i>.<key>=" in line
    assert line_of(message, "--set space.2.loss.base.gamma:")


def test_results_table_csv_and_plots_of_a_union(tmp_path):
    """The rows of a union sweep (from Tune's configs, as :func:`results.trial_rows` reads
    them) in the table, ``results.csv`` and the three plots; no Ray instance."""
    import csv
    from types import SimpleNamespace

    import pandas as pd

    from pairsim.tune import results

    sweep = load_sweep(REPO / "tune_spaces" / "unified_figure5.yaml")
    epochs = list(range(1, sweep.epochs + 1))
    grid = [SimpleNamespace(path=f"/x/fig5-{i:05d}", error=None, config={"point": point},
                            metrics_dataframe=pd.DataFrame({"epoch": epochs, "val/rsum": [i + e for e in epochs]}))
            for i, point in enumerate(sweep.grid_points())]
    rows = results.trial_rows(grid, sweep, [], "fig5")
    assert [r.point for r in rows] == sweep.grid_points()[::-1]  # best first: the metric grows with the index
    assert [(r.metric, r.status) for r in rows[-2:]] == [(sweep.epochs + 1, "finished"), (sweep.epochs, "finished")]
    assert "margin" in results.table_header(sweep) and "gamma" in results.table_header(sweep)
    fifth = next(r for r in rows if r.trial_id == "00005")
    assert results.format_row(fifth, sweep).split()[1:3] == ["0.2", "20"]
    results.write_csv(rows, sweep, tmp_path / "results.csv")
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [(float(r["loss.base.margin"]), float(r["loss.base.gamma"])) for r in table] == [
        (p["loss.base.margin"], p["loss.base.gamma"]) for p in sweep.grid_points()[::-1]]
    assert all((tmp_path / name).stat().st_size > 0 for name in map(Path, results.plot(rows, sweep, tmp_path)))


# 8. Population Based Training ----------------------------------------------------------------------

PBT = {"scheduler": "pbt", "search": "random", "num_samples": 4,
       "pbt": {"perturbation_interval": 1, "mutations": {"optim.lr": {"loguniform": [1.0e-4, 3.0e-3]}}}}
PB2 = PBT | {"scheduler": "pb2"}


@pytest.mark.parametrize("space, sweep, prefix, expected", [
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, PBT | {"search": "optuna"}, "sweep.search:", r"use random or grid"),
    ([{"loss.base.margin": {"grid": [0.1]}}, {"loss.base.gamma": {"grid": [40]}}], PBT | {"search": "grid"},
     "sweep.scheduler:", r"a list of grids runs with fifo or asha"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}},
     PBT | {"pbt": {"mutations": {"train.zero_stage": {"choice": [0, 2]}}}},
     "sweep.pbt.mutations.train.zero_stage:", r"cannot change mid-run.*checkpoint"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, PBT | {"pbt": {"mutations": {"loss.base.gamma": {"grid": [20, 40]}}}},
     "sweep.pbt.mutations.loss.base.gamma:", r"grid is not a mutation; write choice"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}},
     PBT | {"pbt": {"perturbation_interval": 6, "mutations": {"optim.lr": {"uniform": [1.0e-4, 1.0e-3]}}}},
     "sweep.pbt.perturbation_interval:", r"6 epochs, but a trial runs 6: no trial would ever be perturbed"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, PBT | {"pbt": {"mutations": {}}}, "sweep.pbt", r"at least one key"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"scheduler": "pbt"}, "sweep", r"pbt: scheduler pbt needs its settings"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, PBT | {"scheduler": "asha"}, "sweep", r"pbt: only for scheduler pbt"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}},
     PBT | {"pbt": {"mutations": {"loss.base.margin": {"uniform": [0.0, 3.0]}}}},
     "sweep.pbt.mutations.loss.base.margin:", r"high 3.0 gives an invalid run config"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, PB2 | {"pbt": {"mutations": {"loss.base.gamma": {"choice": [20, 40]}}}},
     "sweep.pbt.mutations.loss.base.gamma:", r"choice is not a range; PB2 proposes values inside \[low, high\]"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, PB2 | {"pbt": PB2["pbt"] | {"resample_probability": 0.5}}, "sweep",
     r"pbt.resample_probability: PBT's alone"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, PB2 | {"search": "optuna"}, "sweep.search:",
     r"use random or grid with scheduler pb2"),
    ({"loss.base.margin": {"uniform": [0.1, 0.2]}}, {"scheduler": "pb2"}, "sweep", r"pbt: scheduler pb2 needs its settings"),
], ids=["with-optuna", "with-a-union", "a-key-the-checkpoint-fixes", "grid-mutation", "interval-past-the-end",
        "no-mutations", "no-settings", "pbt-settings-under-asha", "mutation-out-of-range", "pb2-choice",
        "pb2-with-pbts-resampling", "pb2-with-optuna", "pb2-no-settings"])
def test_bad_pbt_setting_is_named(tmp_path, space, sweep, prefix, expected):
    message = sweep_error(write_sweep(tmp_path, space=space, sweep=sweep))
    assert re.search(expected, line_of(message, prefix)), message
    assert error_count(message) == 1, message


def test_pbt_mutations_start_in_the_space_and_explore_stays_inside(tmp_path):
    """A mutated key the space leaves out starts from its mutation's distribution; an explored
    config (PBT multiplies by 1.2 or 0.8) is clipped into each distribution, quantized where the
    distribution is, and gives a valid run config."""
    sweep = load_sweep(write_sweep(tmp_path, base=INFONCE, space={"optim.lr": {"loguniform": [1.0e-4, 1.0e-3]}},
                                   sweep=PBT | {"pbt": {"mutations": {
                                       "optim.lr": {"loguniform": [1.0e-4, 1.0e-3]},
                                       "loss.base.temperature.init": {"quniform": [0.02, 0.05, 0.01]},
                                       "loss.base.temperature.max": {"choice": [0.05, 0.1]}}}}))
    assert sweep.keys == ["optim.lr", "loss.base.temperature.init", "loss.base.temperature.max"]
    assert sweep.param_space()["loss.base.temperature.init"].lower == 0.02
    explored = sweep.explore({"optim.lr": 1.2e-3, "loss.base.temperature.init": 0.05 * 1.2, "loss.base.temperature.max": 0.05,
                              "other": "kept"})
    assert explored == {"optim.lr": 1.0e-3, "loss.base.temperature.init": 0.05, "loss.base.temperature.max": 0.05,
                        "other": "kept"}
    assert sweep.explore({"optim.lr": 0.8e-4, "loss.base.temperature.init": 0.03 * 0.8, "loss.base.temperature.max": 0.1}) == {
        "optim.lr": 1.0e-4, "loss.base.temperature.init": 0.02, "loss.base.temperature.max": 0.1}
    assert sweep.trial_config(sweep.point_of(explored)).loss.base.temperature.max == 0.05


def test_pbt_mutations_of_the_last_releases_flat_loss_keys_are_upgraded_as_the_spaces_are(tmp_path):
    """``loss.margin`` in the space and in ``pbt.mutations``: both read as ``loss.base.margin``,
    each with the FutureWarning naming the new key (its promise kept: no error for the same key);
    a key written both ways in one of them is named once, not silently replaced."""
    from pairsim.tune.schedulers import scheduler_of

    old = {"loss.margin": {"uniform": [0.0, 0.4]}, "loss.gamma": {"loguniform": [20, 125]}}
    with pytest.warns(FutureWarning) as warned:
        sweep = load_sweep(write_sweep(tmp_path, space={"loss.margin": {"uniform": [0.0, 0.4]}},
                                       sweep=PBT | {"pbt": {"perturbation_interval": 1, "mutations": old}}))
    assert sum("loss.gamma " in str(w.message) and "loss.base.gamma" in str(w.message) for w in warned) == 1
    assert list(sweep.settings.pbt.mutations) == ["loss.base.margin", "loss.base.gamma"]
    assert sweep.keys == ["loss.base.margin", "loss.base.gamma"]
    assert set(scheduler_of(sweep)._hyperparam_mutations) == {"loss.base.margin", "loss.base.gamma"}
    def both():
        return {"loss.margin": {"uniform": [0.0, 0.4]}, "loss.base.margin": {"uniform": [0.1, 0.2]}}

    with pytest.warns(FutureWarning):
        message = sweep_error(write_sweep(tmp_path, space=both(), sweep=PBT | {"pbt": {"mutations": both()}}))
    assert "loss.margin and loss.base.margin" in line_of(message, "space.loss.base.margin: written twice")
    assert "loss.margin and loss.base.margin" in line_of(message, "sweep.pbt.mutations.loss.base.margin: written twice")


def test_pb2_searches_the_mutations_bounds_and_pbt_its_distributions(tmp_path):
    """The same population settings under pbt give Ray's PBT over the mutations' distributions
    (its resampling and factors), under pb2 Ray's PB2 over their bounds as sampled (randint's
    high excluded); both report by epoch and keep a trial's last epoch from an exploit."""
    from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler, pb2 as ray_pb2

    from pairsim.tune.schedulers import scheduler_of

    mutations = {"optim.lr": {"loguniform": [1.0e-4, 1.0e-3]}, "loss.base.gamma": {"randint": [10, 61]}}
    space = {"loss.base.margin": {"uniform": [0.1, 0.2]}}
    pbt = scheduler_of(load_sweep(write_sweep(tmp_path, space=space, sweep=PBT | {"pbt": {
        "perturbation_interval": 1, "resample_probability": 0.5, "mutations": mutations}}), ["train.epochs=3"]))
    pb2 = scheduler_of(load_sweep(write_sweep(tmp_path, space=space, sweep=PB2 | {"pbt": {
        "perturbation_interval": 2, "quantile_fraction": 0.5, "mutations": mutations}}, name="pb2.yaml"),
        ["train.epochs=3"]))
    assert isinstance(pbt, PopulationBasedTraining) and not isinstance(pbt, ray_pb2.PB2) and isinstance(pb2, ray_pb2.PB2)
    assert pbt._resample_probability == 0.5 and set(pbt._hyperparam_mutations) == set(mutations)
    assert pb2._hyperparam_bounds == {"optim.lr": [1.0e-4, 1.0e-3], "loss.base.gamma": [10, 60]}
    assert (pb2._perturbation_interval, pb2._quantile_fraction, pb2._time_attr) == (2, 0.5, "epoch")
    assert pb2.on_trial_result(None, None, {"epoch": 3}) == TrialScheduler.CONTINUE


# 9. several metrics: a Pareto front ------------------------------------------------------------------


@pytest.mark.parametrize("sweep, prefix, expected", [
    ({"metric": ["rsum", "i2i_mAP@R"], "scheduler": "asha"}, "sweep.scheduler:",
     r"asha ranks trials by one metric; a sweep over several .* runs with fifo"),
    ({"metric": ["rsum", "i2i_mAP@R"], "scheduler": "pbt", "search": "random",
      "pbt": {"mutations": {"optim.lr": {"loguniform": [1.0e-4, 1.0e-3]}}}}, "sweep.scheduler:", r"pbt ranks"),
    ({"metric": ["rsum", "nonsense"]}, "sweep.metric.1:", r"'nonsense' is not a metric"),
    ({"metric": ["rsum", "val/rsum"]}, "sweep.metric:", r"names a metric twice"),
    ({"metric": ["rsum", "t2i_median_rank"], "mode": ["max", "max"]}, "sweep.mode:",
     r"'max', but val/t2i_median_rank is ranked 'min'"),
    ({"metric": ["rsum", "i2i_mAP@R"], "mode": ["max"]}, "sweep.mode:", r"1 mode\(s\) for 2 metric\(s\)"),
], ids=["asha", "pbt", "unknown-second-metric", "twice", "wrong-mode", "modes-short"])
def test_bad_multi_objective_setting_is_named(tmp_path, sweep, prefix, expected):
    message = sweep_error(write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.1, 0.2]}},
                                      sweep={"search": "optuna"} | sweep))
    assert re.search(expected, line_of(message, prefix)), message
    assert error_count(message) == 1, message


def test_several_metrics_run_fifo_and_the_first_picks_checkpoints(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.1, 0.2]}},
                                   sweep={"metric": ["val/i2i_mAP@R", "t2i_median_rank"], "search": "optuna"}))
    assert sweep.settings.scheduler == "fifo" and sweep.settings.asha is None
    assert sweep.objectives == [("val/i2i_mAP@R", "max"), ("val/t2i_median_rank", "min")]
    assert sweep.multi_objective and sweep.base.eval.select_metric == "i2i_mAP@R"
    assert sweep.params()["sweep.metric"] == "val/i2i_mAP@R,val/t2i_median_rank"
    single = load_sweep(write_sweep(tmp_path, space={"loss.base.margin": {"uniform": [0.1, 0.2]}},
                                    sweep={"metric": ["rsum"]}, name="one.yaml"))
    assert not single.multi_objective and single.settings.scheduler == "asha"


def test_pareto_front_is_what_no_trial_dominates():
    """Random trials on two objectives (one max, one min) and three (a tie): every trial off the
    front is dominated by one on it, none on it by any trial (checked pairwise here, apart from
    the implementation), and trials without every value take no part."""
    from pairsim.tune.results import TrialRow, pareto_front

    rng = np.random.default_rng(0)
    for objectives in ([("a", "max"), ("b", "min")], [("a", "max"), ("b", "max"), ("c", "min")]):
        rows = [TrialRow(f"t{i}", "finished", 1, {}, None, values={m: float(rng.integers(0, 6)) for m, _ in objectives})
                for i in range(40)] + [TrialRow("failed", "failed", 0, {}, None, values={"a": 99.0})]
        sign = {m: 1 if mode == "max" else -1 for m, mode in objectives}

        def dominates(p, q):
            better_or_equal = all(sign[m] * p.values[m] >= sign[m] * q.values[m] for m in sign)
            return better_or_equal and any(sign[m] * p.values[m] > sign[m] * q.values[m] for m in sign)

        front = pareto_front(rows, objectives)
        scored = rows[:-1]
        assert front and "failed" not in {r.trial_id for r in front}
        assert all(not any(dominates(q, p) for q in scored) for p in front)
        assert all(any(dominates(p, q) for p in front) for q in scored if q not in front)
        firsts = [sign["a"] * r.values["a"] for r in front]
        assert firsts == sorted(firsts, reverse=True)


def test_results_csv_reads_back_as_it_was_written(tmp_path):
    """``read_csv`` inverts ``write_csv`` for a multi-objective sweep (the CUSA trade-off's):
    points, best metric, last-epoch objectives, run ids and a failed trial's empty cells and
    error; the front computed from the file is the front of the rows."""
    from pairsim.tune.results import TrialRow, pareto_front, read_csv, write_csv

    sweep = load_sweep(REPO / "tune_spaces" / "cusa_tradeoff.yaml")
    rng = np.random.default_rng(1)
    rows = [TrialRow(f"{i:05d}", "finished", 3, {"loss.cusa.alpha": float(rng.uniform(0.01, 1)),
                                                  "loss.cusa.beta": float(rng.uniform(0.125, 2))},
                     float(rng.uniform(300, 450)), f"run{i}",
                     values={"val/rsum": float(rng.uniform(300, 450)), "val/i2i_mAP@R": float(rng.uniform(5, 20))})
            for i in range(6)]
    rows.append(TrialRow("00006", "failed", 0, {"loss.cusa.alpha": 0.5, "loss.cusa.beta": 1.0}, None,
                         error="RuntimeError: boom, with a comma"))
    rows.append(TrialRow("00007", "finished", 3, {"loss.cusa.alpha": 1e-05, "loss.cusa.beta": 2.0}, 400.0))
    write_csv(rows, sweep, tmp_path / "results.csv")
    back = read_csv(tmp_path / "results.csv", sweep)
    assert back == rows  # 1e-05 a float, as --set reads it (a string to YAML 1.1)
    assert pareto_front(back, sweep.objectives) == pareto_front(rows, sweep.objectives)


def test_a_pbt_clone_starts_its_run_directory_from_the_donors_checkpoint(tmp_path):
    """``adopt_clone`` on a Tune checkpoint as the trial function reports it: its own trial's is
    left alone (the run resumes from its directory); another's moves the run directory aside and
    seeds a new one with the donor's checkpoint; a checkpoint name that would leave the run
    directory is refused."""
    import json

    from ray import tune

    from pairsim.tune.trial import CLONE_INFO, adopt_clone
    from pairsim.untrusted import UntrustedFileError

    def tune_checkpoint(trial_id, name="checkpoint_2026-11-25_21-00-00.000001"):
        root = tmp_path / f"tune-{trial_id}-{len(list(tmp_path.iterdir()))}"
        (root / "checkpoint").mkdir(parents=True)
        (root / "checkpoint" / "weights.bin").write_bytes(b"donor")
        (root / CLONE_INFO).write_text(json.dumps({"trial_id": trial_id, "epoch": 1, "checkpoint": name}))
        return tune.Checkpoint.from_directory(root)

    run_dir = tmp_path / "runs" / "sweep-b"
    (run_dir / "checkpoint_own").mkdir(parents=True)
    assert adopt_clone(None, "b", run_dir) is None
    assert adopt_clone(tune_checkpoint("b"), "b", run_dir) is None and (run_dir / "checkpoint_own").is_dir()
    info = adopt_clone(tune_checkpoint("a"), "b", run_dir)
    assert info.trial_id == "a" and info.epoch == 1
    assert (tmp_path / "runs" / "sweep-b.before-epoch-1" / "checkpoint_own").is_dir()
    assert [p.name for p in run_dir.iterdir()] == ["checkpoint_2026-11-25_21-00-00.000001"]
    assert (run_dir / "checkpoint_2026-11-25_21-00-00.000001" / "weights.bin").read_bytes() == b"donor"
    with pytest.raises(ValueError, match="not a plain file or directory name"):
        adopt_clone(tune_checkpoint("a", "../escape"), "b", run_dir)
    assert not (tmp_path / "runs" / "escape").exists()
    garbled = tune_checkpoint("a")
    (Path(garbled.path) / CLONE_INFO).write_text('{"trial_id": "a", "epoch": "one"')
    with pytest.raises(UntrustedFileError, match=CLONE_INFO):
        adopt_clone(garbled, "b", run_dir)
