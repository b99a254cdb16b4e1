import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import pairsim.cli
from pairsim.cli import DEMO_CONFIG, main
from pairsim.config import ConfigError, RunConfig, load_config
from pairsim import cluster


def write(tmp_path, tree):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_defaults_validate():
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.flat()["loss.base.margin"] == 0.2


def test_every_bad_field_is_reported_with_its_dotted_path(tmp_path):
    path = write(tmp_path, {
        "loss": {"margin": -1, "gamma": 0, "colour": "red"},
        "train": {"zero_stage": 5, "precision": "fp8"},
        "optim": {"lr": "fast"},
        "bogus_section": {"x": 1},
    })
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    for expected in ["loss.base.margin", "loss.base.gamma", "loss.colour: unknown key", "train.zero_stage",
                     "train.precision", "optim.lr", "bogus_section: unknown key"]:
        assert expected in message, (expected, message)
    assert message.startswith("7 error(s)")


def test_overrides_are_applied_and_parsed_as_yaml(tmp_path):
    path = write(tmp_path, {"loss": {"margin": 0.1}})
    cfg = load_config(path, ["loss.base.margin=0.3", "optim.betas=[0.8, 0.9]", "train.precision=bf16",
                             "model.pretrained=weights.pt"])
    assert cfg.loss.base.margin == 0.3
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.train.precision == "bf16"
    assert cfg.model.pretrained == "weights.pt"


@pytest.mark.parametrize("overrides, precision", [([], "fp32"), (["train.use_gpu=true"], "amp_bf16"),
                                                   (["train.use_gpu=true", "train.precision=bf16"], "bf16"),
                                                   (["train.precision=amp_bf16"], "amp_bf16")])
def test_an_unset_precision_is_amp_bf16_on_gpus_and_fp32_on_cpus(overrides, precision):
    """Resolved when the config is read: the run logs, and the engine builds, the precision that ran."""
    cfg = load_config(None, overrides)
    assert cfg.train.precision == precision and cfg.model_dump()["train"]["precision"] == precision


def test_run_name_must_be_usable_as_a_directory_name():
    with pytest.raises(ConfigError, match="ray.run_name"):
        load_config(None, ["ray.run_name=it's/mine"])


def test_unknown_override_key_is_rejected():
    with pytest.raises(ConfigError, match=r"loss\.magrin: unknown key"):
        load_config(None, ["loss.magrin=0.3"])


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["loss.base.margin"])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


@pytest.fixture
def ray_never_starts(monkeypatch):
    """The command must stop before Ray: reaching ``init_ray`` (which starts or joins an
    instance) fails the test — whether or not another test left the session's instance up."""
    def reached(*args, **kwargs):
        raise AssertionError("init_ray was reached: the config error came after Ray started")

    monkeypatch.setattr(cluster, "init_ray", reached)


def test_cli_reports_config_errors_before_ray_starts(tmp_path, capsys, ray_never_starts):
    path = write(tmp_path, {"train": {"num_workers": 0}})
    assert main(["train", "--config", str(path)]) == 2
    assert "train.num_workers" in capsys.readouterr().err


def test_missing_dataset_is_named_before_ray_starts(tmp_path, capsys, ray_never_starts):
    path = write(tmp_path, {"data": {"path": str(tmp_path / "no-such-dataset")}})
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "data.path" in err and "no-such-dataset" in err


def test_unknown_architecture_is_named(tmp_path, tiny_dataset, capsys):
    path = write(tmp_path, {"data": {"path": str(tiny_dataset)}, "model": {"arch": "ViT-Nope"}})
    assert main(["train", "--config", str(path)]) == 2
    assert "model.arch" in capsys.readouterr().err


@pytest.mark.parametrize("override,field", [
    ("loss.base.temperature.init=-0.1", "loss.base.temperature.init"),
    ("loss.cusa={image_teacher: {kind: initial_student}, cross_temperature: {init: -1}}",
     "loss.cusa.cross_temperature.init"),
    ("loss.base.gamma=0", "loss.base.gamma"),
    ("loss.base.gamma=-5", "loss.base.gamma"),
    ("loss.base=circle", "loss.base.name"),
    ("loss.structure=triangle", "loss.structure.name"),
    ("loss.cusa={alpha: 0.1}", "loss.cusa"),
    ("loss.cusa={image_teacher: {kind: unicom}}", "loss.cusa.image_teacher.kind"),
    ("loss.cusa={image_teacher: {kind: open_clip, arch: ViT-B-32}}", "loss.cusa.image_teacher.path"),
    ("loss.base.temperature={init: 0.5, min: 0.01, max: 0.1}", "loss.base.temperature"),
])
def test_bad_loss_settings_are_rejected_naming_the_field(override, field):
    # the temperature is infonce's parameter
    base = ["loss.base=infonce"] if override.startswith("loss.base.temperature") else []
    with pytest.raises(ConfigError) as exc:
        load_config(None, base + [override])
    assert any(line.strip().startswith(field + ":") or line.strip().startswith(field + " ")
               for line in str(exc.value).splitlines()), str(exc.value)


def test_cusa_without_a_teacher_is_rejected_with_its_remedy():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["loss.cusa={alpha: 0.1}"])
    assert exc.value.keys == ("loss.cusa.image_teacher",) and "teacher_features" in str(exc.value)  # the remedy
    # teacher features from disk replace live teachers
    assert load_config(None, ["loss.cusa={teacher_features: /data/teacher}"]).loss.cusa.image_teacher is None


def test_credentials_in_the_ray_address_are_refused_and_masked():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["ray.address=ray://alice:ray-secret-3b7f@head:10001"])
    message = str(err.value)
    assert err.value.keys == ("ray.address",) and "ray://alice:***@head:10001" in message
    assert "ray-secret-3b7f" not in message
    assert load_config(None, ["ray.address=ray://head:10001"]).ray.address == "ray://head:10001"


def test_config_files_layer_left_to_right(tmp_path):
    base = write(tmp_path, {"loss": {"margin": 0.1, "gamma": 30}, "train": {"epochs": 2}})
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(yaml.safe_dump({"loss": {"structure": "gcl", "base": {"gamma": 40}}}))
    cfg = load_config([base, overlay], ["loss.base.margin=0.3"])
    assert (cfg.loss.structure.name, cfg.loss.base.gamma, cfg.loss.base.margin,
            cfg.train.epochs) == ("gcl", 40, 0.3, 2)


@pytest.mark.parametrize("metric", ["rsum", "t2i_R@1", "i2t_mAP@R", "t2t_R-P", "i2i_R@10", "i2t_median_rank",
                                    "grid_text2fused_R@1", "grid_fused2image_R@5"])
def test_selection_metric_accepts_what_the_evaluation_reports(metric):
    cfg = load_config(None, [f"eval.select_metric={metric}"])
    assert cfg.eval.select_mode == ("min" if metric.endswith("median_rank") else "max")


@pytest.mark.parametrize("metric", ["RSUM", "i2t_R@3", "grid_text2fused_R@10", "val/rsum", "t2i_recall"])
def test_selection_metric_that_is_never_reported_is_refused(metric):
    with pytest.raises(ConfigError, match="eval: Value error, select_metric"):
        load_config(None, [f"eval.select_metric={metric}"])


def test_evaluate_and_export_name_a_missing_model_or_split(tmp_path, tiny_dataset, capsys):
    assert main(["evaluate", "--checkpoint", str(tmp_path), "--data", str(tiny_dataset)]) == 2
    assert "pairsim_model.json" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", str(tmp_path), "--data", str(tiny_dataset), "--split", "dev"]) == 2
    assert "--split" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 2
    assert "pairsim_model.json" in capsys.readouterr().err
    missing = tmp_path / "mlflwo.db"  # a mistyped store: named, and not made empty
    for command in (["export", "--out", str(tmp_path / "m.pt")], ["evaluate", "--data", str(tiny_dataset)]):
        assert main([*command, "--run-id", "0123abcd", "--tracking-uri", f"sqlite:///{missing}"]) == 2
        assert f"sqlite:///{missing}" in capsys.readouterr().err
    assert not missing.exists()


# ------------------------------------------------------------- strict values, params owned by the entry

@pytest.mark.parametrize("overrides,names", [
    (["loss.base=infonce", "loss.base.margin=1.5"], ["loss.base.margin", "infonce"]),
    (["loss.base=triplet_hn", "loss.base.gamma=10"], ["loss.base.gamma", "triplet_hn"]),
    (["loss.structure=image_text", "loss.structure.mask_self=false"], ["loss.structure.mask_self", "image_text"]),
    (["optim.lr=inf"], ["optim.lr"]),
    (["optim.lr=.nan"], ["optim.lr"]),
    (["optim.lr=-.inf"], ["optim.lr"]),
    (["train.epochs=true"], ["train.epochs"]),
    (['train.epochs="3"'], ["train.epochs"]),
    (["train.epochs=2.0"], ["train.epochs"]),
    (["loss.local_loss=1"], ["loss.local_loss"]),
    (["optim.betas=[0.9,1.0]"], ["optim.betas"]),
    (["optim.betas=[-0.1,0.9]"], ["optim.betas"]),
    (["loss.cusa={image_teacher: {kind: open_clip, arch: pairsim-tiny, path: t.pt, max_length: 32}}"],
     ["loss.cusa.image_teacher.max_length", "open_clip"]),
    (["loss.cusa={image_teacher: {kind: initial_student, arch: pairsim-tiny}}"],
     ["loss.cusa.image_teacher.arch", "initial_student"]),
])
def test_cli_refuses_bad_values_naming_the_key(tmp_path, capsys, overrides, names, ray_never_starts):
    path = write(tmp_path, {"train": {"epochs": 1}})
    assert main(["train", "--config", str(path), *(a for o in overrides for a in ("--set", o))]) == 2
    err = capsys.readouterr().err
    key = names[0]
    lines = [line.strip() for line in err.splitlines() if line.strip().startswith(key)]
    assert lines and all(n in lines[0] for n in names), err


@pytest.mark.parametrize("command, flag, value, message", [
    (["data", "synth", "--out", "{tmp}/d"], "--num-train", "-5", "must be at least 0, got -5"),
    (["data", "synth", "--out", "{tmp}/d"], "--num-val", "two", "not an integer: 'two'"),
    (["data", "synth", "--out", "{tmp}/d"], "--rows-per-shard", "0", "must be at least 1, got 0"),
    (["data", "synth", "--out", "{tmp}/d"], "--image-size", "10", "must be at least 24, got 10"),
    (["evaluate", "--checkpoint", "{tmp}/c", "--data", "{tmp}/d"], "--batch-size", "0", "must be at least 1, got 0"),
    (["evaluate", "--checkpoint", "{tmp}/c", "--data", "{tmp}/d"], "--concurrency", "-1", "must be at least 1"),
    (["extract-teacher", "--config", str(DEMO_CONFIG), "--out", "{tmp}/t"], "--batch-size", "0", "must be at least 1"),
    (["shards", "inspect", "{tmp}/d"], "--samples", "-1", "must be at least 0, got -1"),
])
def test_cli_refuses_bad_counts_naming_the_flag(tmp_path, capsys, command, flag, value, message, ray_never_starts):
    with pytest.raises(SystemExit) as exit_:
        main([part.format(tmp=tmp_path) for part in command] + [flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_synth_with_no_split_to_write_is_refused_in_one_line(tmp_path, capsys, ray_never_starts):
    out = tmp_path / "d"
    assert main(["data", "synth", "--out", str(out), "--num-train", "0", "--num-val", "0", "--num-test", "0"]) == 2
    assert capsys.readouterr().err == "pairsim: num_train, num_val and num_test are all 0: no split to write\n"
    assert not out.exists()


def test_a_config_error_names_its_keys_and_keeps_them_through_pickling():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["model.lock_image_unlocked_groups=2", "optim.lr=x"])
    assert exc.value.keys == ("model.lock_image_unlocked_groups", "optim.lr")
    copy = pickle.loads(pickle.dumps(exc.value))  # as Ray ships it between processes
    assert (type(copy), str(copy), copy.keys) == (ConfigError, str(exc.value), exc.value.keys)
    assert ConfigError("no key").keys == ()


def test_param_of_another_loss_names_the_chosen_ones_parameters():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["loss.base=infonce", "loss.base.margin=1.5"])
    assert exc.value.keys == ("loss.base.margin",)
    assert "'infonce'" in str(exc.value) and "temperature" in str(exc.value)  # the base chosen, its own keys
    assert str(exc.value).startswith("1 error(s)")


def test_keys_no_entry_knows_stay_unknown_and_unknown_names_list_the_registered():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["loss.base=circle", "loss.base.margin=0.3", "loss.colour=red"])
    message = str(exc.value)
    assert exc.value.keys == ("loss.base.name", "loss.colour")
    assert "infonce, unified, triplet_hn" in message  # the registered names
    assert message.startswith("2 error(s)")  # margin is not reported against an unknown base


def test_floats_written_as_ints_and_yaml_1_2_exponents(tmp_path):
    assert load_config(None, ["optim.lr=1e-3"]).optim.lr == 0.001
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 2e-4\n  eps: 1E-8\nloss:\n  gamma: 20\n")
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.optim.eps, cfg.loss.base.gamma) == (2e-4, 1e-8, 20.0)
    assert isinstance(cfg.loss.base.gamma, float)


SHIPPED = sorted(Path(pairsim.cli.DEMO_CONFIG).parent.glob("objectives/*.yaml"))


@pytest.mark.parametrize("files", [[DEMO_CONFIG]] + [[DEMO_CONFIG, f] for f in SHIPPED],
                         ids=["demo"] + [f.stem for f in SHIPPED])
def test_shipped_configs_load_and_round_trip(files):
    cfg = load_config(files)
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    assert RunConfig.model_validate(yaml.safe_load(cfg.to_yaml())) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # as shipped to the Ray workers
    flat = cfg.flat()
    assert not any("params" in key for key in flat), flat
    if cfg.loss.base.name == "unified":
        assert {"loss.base.margin", "loss.base.gamma"} <= set(flat) and "loss.base.temperature.init" not in flat
    if cfg.loss.base.name == "infonce":
        assert "loss.base.temperature.init" in flat and "loss.base.margin" not in flat
    if cfg.loss.structure.name == "gcl":
        assert flat["loss.structure.mask_self"] is True
    if cfg.loss.cusa is not None:
        assert flat["loss.cusa.text_teacher.kind"] == "sentence_transformers"
        assert flat["loss.cusa.text_teacher.max_length"] == cfg.loss.cusa.text_teacher.max_length
        assert "loss.cusa.text_teacher.path" in flat and "loss.cusa.image_teacher.path" not in flat


def test_flat_keys_of_infonce_and_teachers():
    cfg = load_config(None, ["loss.base=infonce", "loss.structure=gcl", "loss.base.temperature.init=0.07",
                             "loss.cusa={image_teacher: {kind: open_clip, arch: pairsim-tiny, path: t.pt}}"])
    flat = cfg.flat()
    assert (flat["loss.base.temperature.init"], flat["loss.structure.mask_self"]) == (0.07, True)
    assert (flat["loss.cusa.image_teacher.kind"], flat["loss.cusa.image_teacher.arch"],
            flat["loss.cusa.image_teacher.path"]) == ("open_clip", "pairsim-tiny", "t.pt")
    assert list(cfg.loss.model_dump())[:2] == ["structure", "base"]
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_a_layer_that_names_another_base_replaces_its_whole_subsection(tmp_path):
    """demo.yaml sets unified's margin and gamma: a later layer choosing infonce or triplet_hn
    starts from that part's own defaults; a key written in the same layer is still refused."""
    assert load_config(DEMO_CONFIG, ["loss.base=infonce"]).flat()["loss.base.temperature.init"] == 0.05
    assert load_config(DEMO_CONFIG, ["loss.base=triplet_hn"]).loss.base.margin == 0.2  # its own default
    with pytest.raises(ConfigError) as exc:
        load_config(DEMO_CONFIG, ["loss.base=infonce", "loss.base.margin=0.3"])
    assert exc.value.keys == ("loss.base.margin",) and "'infonce'" in str(exc.value) and "'unified'" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, {"loss": {"base": {"name": "triplet_hn", "gamma": 30}}}))
    assert exc.value.keys == ("loss.base.gamma",) and "'triplet_hn'" in str(exc.value)


def test_loading_a_config_imports_no_torch_and_registers_nothing():
    """Config is data: the demo loads without torch, Ray, DeepSpeed or open_clip (a fresh process)."""
    check = (f"import sys; from pairsim.config import load_config; load_config({str(DEMO_CONFIG)!r}); "
             "heavy = {'torch', 'ray', 'deepspeed', 'open_clip'} & set(sys.modules); assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", check], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("flat,nested", [
    ({"base": "unified", "margin": 0.3, "gamma": 30}, {"base": {"name": "unified", "margin": 0.3, "gamma": 30}}),
    ({"base": "infonce", "temperature": {"init": 0.07}}, {"base": {"name": "infonce", "temperature": {"init": 0.07}}}),
    ({"structure": "gcl", "gcl_mask_self": False}, {"structure": {"name": "gcl", "mask_self": False}}),
    ({"margin": 0.3}, {"base": {"margin": 0.3}}),
])
def test_the_flat_loss_keys_of_the_last_release_still_read_with_a_warning_naming_the_new_key(tmp_path, flat, nested):
    with pytest.warns(FutureWarning) as warned:
        old = load_config(write(tmp_path, {"loss": flat}))
    moved = {"loss.margin": "loss.base.margin", "loss.temperature": "loss.base.temperature",
             "loss.gcl_mask_self": "loss.structure.mask_self"}
    said = [str(w.message) for w in warned]  # a warning naming an old key and its new one
    assert any(f"{old_key} " in m and new_key in m for m in said for old_key, new_key in moved.items()), said
    assert old == load_config(write(tmp_path, {"loss": nested}))


def test_a_part_named_alone_or_with_its_keys_is_the_same_part():
    assert load_config(None, ["loss.base=unified"]) == load_config(None, ["loss.base={name: unified}"]) == RunConfig()
    by_set = load_config(None, ["loss.base.temperature.init=0.07", "loss.base=infonce"])
    assert by_set == load_config(None, ["loss.base={name: infonce, temperature: {init: 0.07}}"])
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["loss.base={name: infonse}"])
    assert exc.value.keys == ("loss.base.name",) and "'infonse'" in str(exc.value)
    assert "infonce, unified" in str(exc.value)  # the registered names


def test_shards_build_flags_are_build_configs_fields_with_their_help_and_defaults(tmp_path):
    """``pairsim shards build``'s flags come from BuildConfig: one per field, its description and
    default in the help, parsed into the same config (escapes in --csv-separator decoded)."""
    import argparse

    from pairsim.cli import build_parser
    from pairsim.data.build_config import BuildConfig

    parser = build_parser()
    build = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["shards"]
    build = next(a for a in build._actions if isinstance(a, argparse._SubParsersAction)).choices["build"]
    flags = {a.dest: a for a in build._actions if a.option_strings and a.dest != "help"}
    assert set(flags) == set(BuildConfig.model_fields) | {"ray_address"}
    for name, field in BuildConfig.model_fields.items():
        assert flags[name].option_strings == ["--" + name.replace("_", "-")]
        assert flags[name].required == field.is_required() and flags[name].default is None
        if name != "format":
            assert field.description in flags[name].help
            assert field.is_required() or field.default is None or f"(default {field.default!r})" in flags[name].help
    args = parser.parse_args(["shards", "build", "--format", "csv", "--input", "pairs.csv", "--out", str(tmp_path),
                              "--csv-separator", "\\t", "--max-side", "512", "--val-share", "0.1"])
    cfg = BuildConfig.from_args(**{name: getattr(args, name) for name in BuildConfig.model_fields})
    assert (cfg.csv_separator, cfg.max_side, cfg.val_share, cfg.input) == ("\t", 512, 0.1, Path("pairs.csv"))
    assert cfg.shard_mb == BuildConfig.model_fields["shard_mb"].default  # not given: the config's default
    with pytest.raises(SystemExit):  # one shard size or the other
        parser.parse_args(["shards", "build", "--format", "csv", "--input", "x", "--out", "y", "--rows-per-shard", "5",
                           "--shard-mb", "3"])


def test_every_command_names_the_function_that_runs_it():
    import argparse

    from pairsim.cli import build_parser

    def leaves(parser, path=()):
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers:
            yield path, parser
        for action in subparsers:
            for name, child in action.choices.items():
                yield from leaves(child, (*path, name))

    commands = dict(leaves(build_parser()))
    assert {" ".join(c) for c in commands} == {
        "demo", "train", "tune", "extract-teacher", "shards build", "shards inspect", "shards verify", "evaluate", "export",
        "embed", "index", "search",
        "checkpoints list", "checkpoints verify", "doctor", "registry", "data synth"}
    assert all(callable(parser.get_default("func")) for parser in commands.values())


def test_compile_under_zero3_is_refused_naming_the_fields():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["train.compile=true", "train.zero_stage=3"])
    assert exc.value.keys == ("train.compile",) and "zero_stage 3" in str(exc.value)
    assert load_config(None, ["train.compile=true", "train.zero_stage=2"]).train.compile
