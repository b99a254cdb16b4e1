"""Every figure the benchmarks page shows is a results file that a script wrote: the page
includes ``benchmarks/results/*.md`` as they are, each the rendering of its JSON (values,
command, commit, machine, packages), and ``bench_all.py --quick`` regenerates all of them."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pairsim.tune.space import load_sweep

REPO = Path(__file__).parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_all  # noqa: E402
import cusa_tradeoff  # noqa: E402
import machine_cpu  # noqa: E402
import reproduce  # noqa: E402
import results  # noqa: E402
import unified_figure5  # noqa: E402

sys.path.remove(str(REPO / "benchmarks"))  # its checkout_path and reproduce modules stay out of other tests' way

PAGE = REPO / "docs" / "benchmarks.md"
INCLUDE = re.compile(r'^--8<-- "(benchmarks/results/[\w.-]+\.md)"$', re.M)


def check_results_file(json_file: Path) -> dict:
    result = json.loads(json_file.read_text())
    env = result["environment"]
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?", env["commit"]), env["commit"]
    assert env["machine"]["cores"] >= 1 and "torch" in env["packages"] and env["date"]
    script = re.match(r"python benchmarks/(\w+)\.py", result["command"])
    assert script, result["command"]
    setting = re.search(r"--setting (\w+)", result["command"])  # reproduce.py's settings but its default
    names = {script[1], f"{script[1]}_gpu"} | ({f"{script[1]}_{setting[1]}"} if setting else set())  # _gpu: on a GPU
    if "--profile-steps" in result["command"]:  # gpu_checks.sh profile's call, kept beside bench_train_gpu
        names.add(f"{script[1]}_gpu_profile")
    assert json_file.stem in names, result["command"]
    for table in result["tables"]:
        assert table["rows"] and all(len(row) == len(table["columns"]) == len(table["formats"]) for row in table["rows"])
    assert json_file.with_suffix(".md").read_text() == results.render(result), f"{json_file.name}: .md is not its JSON"
    return result


def test_the_docs_include_every_results_file_and_the_page_holds_no_table_of_its_own():
    """The docs include each of them once: the benchmarks page all but the demo's (the Quick
    start's) and the research figures' (the Objectives page's)."""
    page = PAGE.read_text()
    included = [path for doc in sorted((REPO / "docs").glob("*.md")) for path in INCLUDE.findall(doc.read_text())]
    written = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "benchmarks" / "results").glob("*.md"))
    assert sorted(included) == written
    expected = {*map(bench_all.results_name, bench_all.PROFILES), "bench_all"}
    stems = {Path(p).stem.removesuffix("_profile").removesuffix("_gpu") for p in written}  # by gpu_checks.sh
    assert stems == expected, (expected, stems)
    outside_code = re.sub(r"```.*?```", "", page, flags=re.S)
    assert not re.search(r"^\s*\|", outside_code, re.M), "a table typed into the page instead of a results file"
    assert all(block.startswith("```bash") for block in re.findall(r"```\w*", page)[::2])


def test_the_readme_shows_the_demos_figures_as_its_results_file_holds_them():
    """The README is no MkDocs page (GitHub shows it): it holds a copy of the best epoch's table,
    which must be the results file's, with its commit and RSUM."""
    result = check_results_file(REPO / "benchmarks" / "results" / "bench_demo.json")
    readme = (REPO / "README.md").read_text()
    best = result["tables"][1]
    assert results.render_table(best) in readme, "README's demo table is not benchmarks/results/bench_demo.json's"
    assert f"`{result['environment']['commit']}`" in readme and best["notes"][0] in readme


def test_each_documented_table_is_the_rendering_of_its_results_file():
    for json_file in sorted((REPO / "benchmarks" / "results").glob("*.json")):
        check_results_file(json_file)


def test_the_research_tables_are_their_runs_files_rendered():
    """The reproduction's, Figure 5's and CUSA's trade-off's results files, which the Objectives
    page includes, hold what their scripts make of the files the page cites: the runs files of
    the reproduction's two settings (25 runs from the pretrained base, 21 from a random model),
    the Figure 5 sweep's points and verdicts beside its picture, and the trade-off sweep's
    ``results.csv`` with its base's metrics (the front computed anew from the file)."""
    from pairsim.tune import figures
    from pairsim.tune.results import read_csv

    def rows(tables) -> list:
        return json.loads(json.dumps([table.rows for table in tables]))

    # claims judged: every one from the pretrained base; the scratch table has no Sigmoid row for SigLIP's
    for setting, name, seeds, claims in (("pretrained", "reproduce", [1, *[3] * 8], 8),
                                         ("scratch", "reproduce_scratch", [3] * 7, 7)):
        published = json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text())
        runs_file = REPO / "docs" / "results" / f"reproduce_{setting}_{published['environment']['commit']}.json"
        runs = json.loads(runs_file.read_text())
        made = reproduce.tables(reproduce.grouped(runs, list(runs)), "")
        assert [row[1] for row in made[0].rows] == seeds and len(made[1].rows) == claims, runs_file.name
        assert rows(made) == [table["rows"] for table in published["tables"]], runs_file.name
    figure = json.loads((REPO / "docs" / "figures" / "unified_figure5.json").read_text())
    curves = [[figures.Point(p["x"], p["metric"], tuple(p["trials"])) for p in panel["points"]]
              for panel in figure["panels"]]
    verdicts = [figures.Verdict(**v) for v in figure["verdicts"]]
    made = unified_figure5.tables(curves, verdicts, figure["metric"])
    assert len(made[0].rows) == 10 and len(made[1].rows) == 3
    published = json.loads((REPO / "benchmarks" / "results" / "unified_figure5.json").read_text())
    assert rows(made) == [table["rows"] for table in published["tables"]], "docs/figures/unified_figure5.json"
    sweep = load_sweep(cusa_tradeoff.SPACE)
    trials = read_csv(REPO / "docs" / "figures" / "cusa_tradeoff_results.csv", sweep)
    summary = json.loads((REPO / "docs" / "figures" / "cusa_tradeoff.json").read_text())
    made = cusa_tradeoff.tables(trials, sweep, summary["base"])
    assert len(made[0].rows) == 1 + sweep.settings.num_samples and len(made[1].rows) == 2
    published = json.loads((REPO / "benchmarks" / "results" / "cusa_tradeoff.json").read_text())
    assert rows(made) == [table["rows"] for table in published["tables"]], "docs/figures/cusa_tradeoff_results.csv"


def test_a_rendered_table_shows_what_its_json_holds():
    table = results.Table("t", ["name", "n", "ratio"], ["", ",", ".2f"])
    table.add("a", 12345, 0.5)
    table.add("b", None, 1.234)
    with pytest.raises(ValueError, match="2 values for 3 columns"):
        table.add("c", 1)
    md = results.render({"command": "python benchmarks/x.py", "seconds": 3.0, "tables": [table.__dict__],
                         "environment": {"commit": "abc1234", "date": "d", "python": "3.11", "packages": {"torch": "2"},
                                         "machine": {"cores": 2, "cpu": "c", "memory_gib": 1.0, "gpu": None}}})
    assert "| a | 12,345 | 0.50 |" in md and "| b | – | 1.23 |" in md and "|---|---:|---:|" in md
    assert results._as_rerun("python b.py --sizes 1 --results /tmp/r --out /tmp/o") == "python b.py --sizes 1"


def test_machine_cpu_gives_a_child_the_cpu_seconds_it_spun_inside_a_window_only():
    """A child spins 0.6 s of CPU, sleeps, spins 1.5 s, sleeps: the window over its second spin
    holds those 1.5 s, the window over its first sleep none, and it is counted among this
    process's descendants."""
    spin = ("import time; t = time.process_time()\n"
            "while time.process_time() - t < 0.6: pass\n"
            "time.sleep(1); print(time.time(), flush=True); t = time.process_time()\n"
            "while time.process_time() - t < 1.5: pass\n"
            "print(time.time(), flush=True); time.sleep(1)")
    with machine_cpu.MachineCpu(interval=0.05) as cpu:
        done = subprocess.run([sys.executable, "-c", spin], capture_output=True, text=True, check=True)
    began, ended = map(float, done.stdout.split())
    child = next(p for p in cpu.processes.values() if spin.splitlines()[0] in " ".join(p.titles))
    assert child.pid in cpu.descendants(os.getpid()) and child.name.startswith("python")
    used, busy = cpu.window(began, ended)
    assert 1.3 < used[child] < 1.7 and busy >= used[child] - 0.2
    assert child not in cpu.window(began - 0.9, began - 0.1)[0]
    middle = (began + ended) / 2  # two spans add up to the window they split
    halves = cpu.by_group([(began, middle), (middle, ended)], lambda p: "child" if p is child else "other")
    assert halves["child"] == pytest.approx(used[child]) and halves["busy"] == pytest.approx(busy)


@pytest.mark.slow
@pytest.mark.extended  # 6.5–11 min alone (667 s on the 2-core EPYC, the test command then near CI's limit)
def test_bench_all_quick_regenerates_every_results_file(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, not the session's
    done = subprocess.run([sys.executable, "benchmarks/bench_all.py", "--quick", "--results", str(tmp_path / "results"),
                           "--work", str(tmp_path / "work")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = check_results_file(tmp_path / "results" / "bench_all.json")
    quick = [name for name, (_, arguments) in bench_all.PROFILES.items() if arguments is not None]
    assert [row[0] for row in summary["tables"][0]["rows"]] == list(map(bench_all.results_name, quick))
    assert all(row[-1] == "yes" for row in summary["tables"][0]["rows"])
    for name in quick:
        result = check_results_file(tmp_path / "results" / f"{bench_all.results_name(name)}.json")
        assert result["environment"]["commit"].split("+")[0] == subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
