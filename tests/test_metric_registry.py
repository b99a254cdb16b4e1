"""The registries of the evaluation's metrics, the shard build's source formats and the fusions:
what config, the driver, the CLI and the report accept is what is registered, nothing else."""

import argparse
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pairsim.cli import add_shards_parser
from pairsim.config import ConfigError, load_config
from pairsim.data.build_config import BuildConfig
from pairsim.data import shards, sources
from pairsim import metric_families
from pairsim.eval import suite
from pairsim.eval.report import format_report
from pairsim.models.fusion import NormalizedSumFusion
from pairsim.registry import DATA_FORMATS
from pairsim.config import FUSIONS
from pairsim.train import driver
from conftest import remanifest
from test_evaluate import tiny_split

KS = (1, 5, 10)
SELECTABLE = suite.selectable_metrics(KS)


# --------------------------------------------------------------------------- metrics

def test_metric_families_lists_the_families_and_one_list_of_names():
    assert list(metric_families.FAMILIES) == ["crossmodal", "unimodal", "grid"]
    names = suite.metric_names(KS)
    assert {n: m for n, m in names.items() if m} == SELECTABLE
    assert {n for n, m in names.items() if m is None} == {
        f"{d}_n_queries_without_positive" for d in ("i2t", "t2i", "t2t", "i2i")}
    assert len(SELECTABLE) == 4 * (len(KS) + 3) + 1 + 2 * 9
    assert suite.directions() == {"i2t": "image→text", "t2i": "text→image", "i2i": "image→image",
                                  "t2t": "text→text"}


def test_metric_families_imports_no_torch():
    code = "import sys, pairsim.metric_families; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_suite_computes_every_metric_family_and_reexports_its_names():
    assert list(suite.COMPUTE) == list(metric_families.FAMILIES)
    for name in ("FAMILIES", "GRID_KS", "MODALITIES", "DataFacts", "MetricFamily", "directions", "grid_metric_name",
                 "metric_names", "ranking_metric_names", "selectable_metrics", "skipped_groups"):
        assert getattr(suite, name) is getattr(metric_families, name)


@pytest.mark.parametrize("metric", sorted(SELECTABLE))
def test_select_metric_accepts_every_name_the_registry_lists(metric):
    cfg = load_config(None, [f"eval.select_metric={metric}"])
    assert cfg.eval.select_mode == SELECTABLE[metric]
    assert cfg.eval.select_mode == ("min" if metric.endswith("median_rank") else "max")


@pytest.mark.parametrize("metric", ["rsum ", "R@1", "i2t_R@2", "i2t_R@100", "t2i_n_queries_without_positive",
                                    "grid_text2fused_R@10", "grid_text2audio_R@1", "i2a_R@1", "val/t2i_R@1",
                                    "crossmodal", "", "i2i_mAP@R@1"])
def test_select_metric_refuses_what_no_family_reports(metric):
    with pytest.raises(ConfigError, match="eval: Value error, select_metric"):
        load_config(None, [f"eval.select_metric='{metric}'"])


def test_select_metric_follows_ks():
    assert load_config(None, ["eval.ks=[3]", "eval.select_metric=t2t_R@3"]).eval.select_mode == "max"
    with pytest.raises(ConfigError, match="select_metric.*for ks \\[3\\]"):
        load_config(None, ["eval.ks=[3]", "eval.select_metric=t2t_R@1"])
    assert set(suite.selectable_metrics((3,))) - set(SELECTABLE) == {f"{d}_R@3" for d in ("i2t", "t2i", "t2t", "i2i")}


@pytest.mark.parametrize("labels,facts", [([0, 0, 1], suite.DataFacts(True, True)),
                                          ([-1, -1, -1], suite.DataFacts(False, True)),
                                          ([0, 1, 2], suite.DataFacts(False, True))])  # no image shares a class
def test_evaluate_split_reports_exactly_the_registered_names_for_its_data(labels, facts):
    split = tiny_split()
    split.labels = np.array(labels)
    assert suite.DataFacts.of(split) == facts
    report = suite.evaluate_split(split, NormalizedSumFusion(), ks=(1, 5))
    assert list(report.metrics) == list(suite.metric_names((1, 5), facts))
    assert any(n.startswith("i2i_") for n in report.metrics) == facts.has_labels
    assert sorted(report.grid) == list(suite.GRID_KS)
    table = format_report(report.metrics, ks=(1, 5))
    assert ("image→image" in table) == facts.has_labels and "text→text" in table and "modality grid" in table


def test_a_split_without_multi_caption_images_reports_no_text2text_or_grid():
    split = tiny_split()
    keep = [1, 2, 4]  # one caption each for a, b and c
    split.text, split.text_image_ids, split.caption_index = split.text[keep], split.text_image_ids[keep], \
        split.caption_index[keep]
    facts = suite.DataFacts.of(split)
    assert facts == suite.DataFacts(has_labels=True, has_multi_caption=False)
    report = suite.evaluate_split(split, NormalizedSumFusion(), ks=(1,))
    assert list(report.metrics) == list(suite.metric_names((1,), facts))
    assert not any(n.startswith(("t2t_", "grid_")) for n in report.metrics) and report.grid == {}
    assert "modality grid" not in format_report(report.metrics, ks=(1,))


def _copy_without_labels(src, dst, split):
    shutil.copytree(src, dst)
    for path in (dst / split).glob("*.parquet"):
        table = pq.read_table(path)
        labels = pa.array(np.full(table.num_rows, -1, dtype=np.int32))
        pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", labels), path)
    remanifest(dst)
    return dst


def _single_caption_copy(src, dst, split):
    shutil.copytree(src, dst)
    for path in (dst / split).glob("*.parquet"):
        table = pq.read_table(path)
        first = pc.list_slice(table.column("captions"), 0, 1)
        pq.write_table(table.set_column(table.schema.get_field_index("captions"), "captions",
                                        first.cast(table.schema.field("captions").type)), path)
    remanifest(dst)
    return dst


def _check(path, metric):
    driver.plan_run(load_config(None, [f"data.path={path}", f"eval.select_metric={metric}"]))


def test_check_ready_refuses_a_metric_the_val_data_cannot_give(tiny_dataset, tmp_path):
    labels, captions = shards.label_and_caption_counts(tiny_dataset, "val")
    assert (labels >= 0).all() and (captions == 5).all()
    for metric in ("i2i_R@1", "grid_text2fused_R@1", "t2t_median_rank", "rsum"):
        _check(tiny_dataset, metric)
    unlabelled = _copy_without_labels(tiny_dataset, tmp_path / "unlabelled", "val")
    with pytest.raises(ConfigError) as exc:
        _check(unlabelled, "i2i_R@1")
    message = str(exc.value)  # the key, the metric asked for, why not, what the split gives instead
    assert message.startswith("eval.select_metric:") and "'i2i_R@1'" in message and "no class labels" in message
    assert "t2t_R@1" in message.split("'i2i_R@1'")[1]
    _check(unlabelled, "t2t_R@1")
    single = _single_caption_copy(tiny_dataset, tmp_path / "single", "val")
    for metric in ("grid_text2fused_R@1", "t2t_R@1"):
        with pytest.raises(ConfigError) as exc:
            _check(single, metric)
        message = str(exc.value)
        assert message.startswith("eval.select_metric:") and f"'{metric}'" in message and "two captions" in message
    _check(single, "i2i_R@5")


def test_a_run_names_the_metrics_its_data_cannot_give(tiny_dataset, tmp_path, caplog):
    single = _single_caption_copy(tiny_dataset, tmp_path / "single", "val")
    cfg = load_config(None, [f"data.path={single}", "eval.select_metric=i2t_R@1"])
    with caplog.at_level("INFO", logger="pairsim"):
        assert driver.skipped_metrics_tag(cfg, driver.plan_run(cfg).facts) == {"pairsim.skipped_metrics": "t2t,grid"}
    assert "the val split of" in caplog.text and "no text→text, the modality grid metrics" in caplog.text
    plain = load_config(None, [f"data.path={tiny_dataset}"])
    assert driver.skipped_metrics_tag(plain, driver.plan_run(plain).facts) == {}


# --------------------------------------------------------------------------- data formats

def _format_choices() -> list[str]:
    parser = argparse.ArgumentParser()
    add_shards_parser(parser.add_subparsers())
    build = parser._subparsers._group_actions[0].choices["shards"]._subparsers._group_actions[0].choices["build"]
    return next(a for a in build._actions if a.dest == "format").choices


def test_the_cli_offers_exactly_the_registered_formats():
    assert DATA_FORMATS.names() == ["karpathy", "csv", "webdataset", "folder"]
    assert list(_format_choices()) == DATA_FORMATS.names()
    assert not hasattr(sources, "FORMATS")
    assert all(isinstance(fmt, sources.DataFormat) and fmt.description for _, fmt in DATA_FORMATS.items())


def test_a_bad_format_is_named_with_the_registered_ones(tmp_path):
    with pytest.raises(ConfigError) as exc:
        BuildConfig.from_args(format="tsv", input=tmp_path, out=tmp_path)
    assert exc.value.keys == ("format",) and "'tsv'" in str(exc.value)
    assert "karpathy, csv, webdataset, folder" in str(exc.value)  # the registered names
    with pytest.raises(sources.SourceError) as exc:
        sources.list_source("tsv", tmp_path, None, "train")
    assert str(exc.value).startswith("--format 'tsv':") and "karpathy, csv" in str(exc.value)


@pytest.mark.parametrize("fmt", ["karpathy", "webdataset", "folder"])
@pytest.mark.parametrize("option", ["csv_image_key", "csv_caption_key", "csv_separator"])
def test_csv_options_are_refused_with_another_format(tmp_path, fmt, option):
    with pytest.raises(ConfigError) as exc:
        BuildConfig.from_args(format=fmt, input=tmp_path, out=tmp_path, **{option: ","})
    assert exc.value.keys == (option,) and "csv" in str(exc.value) and f"'{fmt}'" in str(exc.value)
    cfg = BuildConfig.from_args(format="csv", input=tmp_path, out=tmp_path, **{option: ","})
    assert getattr(cfg, option) == ","
    assert BuildConfig(format=fmt, input=tmp_path, out=tmp_path).csv_separator == "\t"  # defaults are not "set"


def test_list_source_passes_a_formats_own_options(tmp_path):
    (tmp_path / "list.csv").write_text("path;text\na.jpg;hello\na.jpg;again\nb.jpg;bye\n")
    listing = sources.list_source("csv", tmp_path / "list.csv", None, "val", image_key="path", caption_key="text",
                                  separator=";")
    assert [(r.image_id, r.captions, r.split) for r in listing.records] == [
        ("a.jpg", ["hello", "again"], "val"), ("b.jpg", ["bye"], "val")]


# --------------------------------------------------------------------------- fusions

def test_model_fusion_is_a_registered_name():
    assert load_config(None, ["model.fusion=normalized_sum"]).model.fusion in FUSIONS.names()
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["model.fusion=concat"])
    assert exc.value.keys == ("model.fusion",) and "'concat'" in str(exc.value) and "normalized_sum" in str(exc.value)


@pytest.mark.parametrize("facts,skipped", [
    (suite.DataFacts(True, True), {}),
    (suite.DataFacts(False, True), {"i2i": "image→image"}),
    (suite.DataFacts(True, False), {"t2t": "text→text", "grid": "the modality grid"}),
    (suite.DataFacts(False, False), {"t2t": "text→text", "i2i": "image→image", "grid": "the modality grid"})])
def test_the_groups_a_split_cannot_give_are_named(facts, skipped):
    assert suite.skipped_groups((1, 5), facts) == skipped
