"""A third-party base loss registered by an entry point (tests/toy_loss.py, listed in
tests/pairsim_toy_plugin-0.1.dist-info/entry_points.txt) is configured, validated, logged and
trained exactly like the built-in ones: its own parameter, refused parameters of other losses,
MLflow params, and an end-to-end run on the Ray workers, which find it the same way."""

import math

import pytest
import torch
import yaml

import toy_loss
from pairsim.cli import DEMO_CONFIG, main
from pairsim.config import ConfigError, RunConfig, load_config
from pairsim.build import build_objective
from pairsim.losses import ImageTextLoss
from pairsim.config import BASE_LOSSES


def test_toy_loss_validates_by_name_with_its_own_param():
    assert "cos_hinge" in BASE_LOSSES.names() and BASE_LOSSES.plugin("cos_hinge") is toy_loss.CosineHinge
    cfg = load_config(None, ["loss.base=cos_hinge", "loss.base.cos_margin=0.4"])
    assert cfg.loss.base == toy_loss.CosineHinge.Params(name="cos_hinge", cos_margin=0.4)
    flat = cfg.flat()
    assert flat["loss.base.name"] == "cos_hinge" and flat["loss.base.cos_margin"] == 0.4
    assert "loss.base.margin" not in flat and "loss.base.gamma" not in flat
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    # demo.yaml's unified margin and gamma give way to the loss that replaces unified
    assert load_config(DEMO_CONFIG, ["loss.base=cos_hinge"]).loss.base.cos_margin == 0.3


def test_toy_loss_builds_and_matches_its_formula():
    objective = build_objective(load_config(None, ["loss.base=cos_hinge", "loss.base.cos_margin=0.5"]).loss)
    assert isinstance(objective.structure, ImageTextLoss)
    assert isinstance(objective.structure.base, toy_loss.CosineHinge)
    g = torch.Generator().manual_seed(0)
    image, text = (torch.nn.functional.normalize(torch.randn(6, 8, generator=g, dtype=torch.float64), dim=-1)
                   for _ in range(2))
    out = objective(image=image, text=text)
    s = (image @ text.T).tolist()
    expected = 0.0
    for rows in (s, [list(c) for c in zip(*s)]):  # image→text, text→image
        expected += sum(sum(max(rows[i][j] - rows[i][i] + 0.5, 0.0) for j in range(6) if j != i) / 5
                        for i in range(6)) / 6
    assert out["loss/base"].item() == pytest.approx(expected, rel=1e-12)
    assert not any(k.startswith("temperature/") for k in out)


@pytest.mark.parametrize("overrides,names", [
    (["loss.base=cos_hinge", "loss.base.gamma=10"], ["loss.base.gamma", "cos_hinge", "cos_margin"]),
    (["loss.base=cos_hinge", "loss.base.margin=0.1"], ["loss.base.margin", "cos_hinge"]),
    (["loss.base=unified", "loss.base.cos_margin=0.1"], ["loss.base.cos_margin", "unified", "'cos_hinge'"]),
    (["loss.base=cos_hinge", "loss.base.cos_margin=3"], ["loss.base.cos_margin"]),
])
def test_train_refuses_a_param_of_another_loss(tmp_path, capsys, overrides, names):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"train": {"epochs": 1}}))
    assert main(["train", "--config", str(path), *(a for o in overrides for a in ("--set", o))]) == 2
    err = capsys.readouterr().err
    lines = [line.strip() for line in err.splitlines() if line.strip().startswith(names[0] + ":")]
    assert len(lines) == 1 and all(n in lines[0] for n in names), err


def test_unknown_base_lists_the_registered_ones_with_the_toy():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["loss.base=cos_hinges"])
    assert exc.value.keys == ("loss.base.name",) and "'cos_hinges'" in str(exc.value)
    assert "cos_hinge," in str(exc.value) or "cos_hinge)" in str(exc.value)  # the toy plugin among the registered


@pytest.mark.slow
def test_toy_loss_trains_on_the_ray_workers(ray_instance, tiny_dataset, tmp_path):
    from mlflow.tracking import MlflowClient

    from pairsim.train import driver

    cfg = load_config(DEMO_CONFIG, [
        f"data.path={tiny_dataset}", "loss.base=cos_hinge", "loss.base.cos_margin=0.2", "train.num_workers=2",
        "train.micro_batch_size=16", "train.epochs=1", "train.log_every_n_steps=1", "optim.warmup_steps=2",
        "eval.batch_size=64", "data.test_split=null", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"ray.storage_path={tmp_path}/ray"])
    result = driver.fit(cfg)
    client = MlflowClient(result.tracking_uri)
    base = [m.value for m in client.get_metric_history(result.mlflow_run_id, "loss/base")]
    assert base and all(math.isfinite(v) for v in base), base
    params = client.get_run(result.mlflow_run_id).data.params
    assert params["loss.base.name"] == "cos_hinge" and float(params["loss.base.cos_margin"]) == 0.2
    assert "loss.base.margin" not in params


def test_every_built_in_part_of_the_config_is_built():
    """The config names the parts (pairsim.config.components), pairsim.build and the fusions
    module make them: the two agree, so no name validates that cannot be built."""
    from pairsim import build
    from pairsim.config import components
    from pairsim.models import fusion

    for family in (components.BASE_LOSSES, components.STRUCTURES, components.TEACHERS):
        assert set(family.builtins.values()) <= set(build.FACTORIES), family.key
    assert list(components.FUSIONS.builtins) == list(fusion.BUILT_IN)


BROKEN_PLUGINS = {  # entry point name -> (the module it names, that module's code, the cause its error names)
    "loss_missing_dependency": ("toy_needs_missing:Loss", "import pairsim_no_such_dependency\n",
                                "ModuleNotFoundError: No module named 'pairsim_no_such_dependency'"),
    "loss_raising_at_import": ("toy_raises:Loss", "raise RuntimeError('the plugin is broken')\n",
                               "RuntimeError: the plugin is broken"),
    "loss_missing_name": ("toy_empty:Loss", "", "AttributeError"),
    "loss_a_function": ("toy_function:Loss", "def Loss():\n    pass\n", "names function 'Loss', not a class"),
    "loss_foreign_params": ("toy_foreign:Loss", "class Loss:\n    class Params:\n        pass\n",
                            "its Params must subclass pairsim.config.components.BaseLossParams"),
}


@pytest.fixture
def broken_plugins(tmp_path, monkeypatch):
    """A package installed beside the tests (a dist-info on the path, as a wheel installs one)
    whose base-loss entry points name a module that fails to import, one that raises as it runs,
    a name its module lacks, a function, and a class whose Params is not pairsim's."""
    info = tmp_path / "pairsim_broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pairsim-broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pairsim.base_losses]\n" + "".join(
        f"{name} = {target}\n" for name, (target, _, _) in BROKEN_PLUGINS.items()))
    for target, code, _ in BROKEN_PLUGINS.values():
        (tmp_path / f"{target.split(':')[0]}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("name", list(BROKEN_PLUGINS))
def test_a_plugin_that_does_not_load_is_one_config_error_naming_the_key_entry_point_and_cause(broken_plugins, name):
    target, _, cause = BROKEN_PLUGINS[name]
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"loss.base={name}"])
    line = refused.value.args[0].splitlines()[1].strip()
    assert refused.value.keys == ("loss.base.name",) and line.startswith("loss.base.name:")
    assert f"{name} = '{target}'" in line and "pairsim.base_losses" in line and "pairsim-broken-plugin" in line
    assert cause in line


def test_a_broken_plugin_exits_2_in_train_and_doctor_and_leaves_other_errors_as_they_were(broken_plugins, tmp_path,
                                                                                           capsys):
    for command in (["train", "--config", str(DEMO_CONFIG)], ["doctor"]):
        assert main([*command, "--set", "loss.base=loss_raising_at_import"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "loss_raising_at_import" in err and "the plugin is broken" in err
    with pytest.raises(ConfigError) as refused:  # listing the parts that have a key loads every plugin
        load_config(None, ["loss.base=unified", "loss.base.cos_margin=0.1"])
    assert refused.value.keys == ("loss.base.cos_margin",) and "'cos_hinge'" in str(refused.value)
