"""mlcls-tables --runs: runs written by the trainer side by side, the swept key a column of its own."""

from __future__ import annotations

import csv
import html
import io
import json
import re
import shutil

import pytest
import torch
from conftest import compose_config

from mlcls.cli import tables as tables_cli
from mlcls.engine.checkpoint import restore
from mlcls.engine.state import TrainState
from mlcls.reporting.run_table import differing_keys, flat_settings, run_status

RUN = [
    "dataset.train_size=32",
    "dataset.val_size=16",
    "dataset.image_size=32",
    "model.name=resnet10t",
    "trainer.epochs=1",
    "trainer.batch_size=16",
    "trainer.limit_train_batches=1",
    "trainer.workers=0",
    "trainer.report=false",
    "trainer.device=cpu",
    "trainer.log_every=1000",
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A sweep directory of two real runs, loss=twoway (job 0) and loss=bce (job 1), and a job 2 that
    stopped before its first evaluation (config.yaml only)."""
    from mlcls.cli.train import run

    root = tmp_path_factory.mktemp("sweep")
    for job, loss in enumerate(("twoway", "bce")):
        run(compose_config([*RUN, f"loss={loss}"]), run_dir=root / str(job))
    (root / "2").mkdir()
    shutil.copy(root / "1" / "config.yaml", root / "2" / "config.yaml")
    return root


def table(argv, capsys) -> tuple[int, str, str]:
    code = tables_cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def results(run_dir) -> dict:
    return json.loads((run_dir / "results.json").read_text())


@pytest.mark.slow
def test_a_sweep_is_one_table_with_the_swept_key_as_a_column(sweep, capsys):
    code, out, err = table(["--runs", str(sweep), "--csv"], capsys)
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [row["loss"] for row in rows] == ["twoway", "bce", "bce"]
    assert next(iter(rows[0])) == "loss"  # the only setting that differs: no loss.tp, no trainer.resume
    assert list(rows[0])[1:] == [
        "status", "mAP_class", "mAP_sample", "best_epoch", "epochs_completed", "wall_time_s", "run",
    ]  # fmt: skip
    for row, job in zip(rows[:2], ("0", "1"), strict=True):
        written = results(sweep / job)
        assert row["run"] == str(sweep / job) and row["status"] == "finished"
        assert float(row["mAP_class"]) == written["metrics"]["mAP_class"]
        assert float(row["mAP_sample"]) == written["metrics"]["mAP_sample"]
        assert int(row["best_epoch"]) == written["best"]["epoch"] == 1
        assert float(row["wall_time_s"]) == written["provenance"]["wall_time_s"] > 0
    assert rows[2]["status"] == "failed" and rows[2]["mAP_class"] == ""


@pytest.mark.slow
def test_markdown_and_json_hold_the_same_runs(sweep, capsys):
    code, out, _ = table(["--runs", str(sweep)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "### 3 runs"
    header = lines.index("| loss | status | mAP_class | mAP_sample | best_epoch | epochs_completed | "
                         "wall_time_s | run |")  # fmt: skip
    twoway = results(sweep / "0")["metrics"]["mAP_class"]
    assert lines[header + 2].startswith(f"| twoway | finished | {twoway:.2f} |")
    code, out, _ = table(["--runs", str(sweep / "0"), str(sweep / "1"), "--json"], capsys)
    runs = json.loads(out)
    assert [run["loss"] for run in runs] == ["twoway", "bce"]
    assert runs[1]["mAP_sample"] == results(sweep / "1")["metrics"]["mAP_sample"]


@pytest.mark.slow
def test_sort_puts_the_best_mAP_first(sweep, capsys):
    code, out, _ = table(["--runs", str(sweep), "--json", "--sort", "mAP_class"], capsys)
    scores = {job: results(sweep / job)["metrics"]["mAP_class"] for job in ("0", "1")}
    order = sorted(scores, key=scores.get, reverse=True)
    assert [run["run"] for run in json.loads(out)] == [str(sweep / job) for job in order] + [str(sweep / "2")]
    code, _, err = table(["--runs", str(sweep), "--sort", "mAP"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--sort mAP: no such column; the columns are loss" in err


def test_no_run_found_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, out, err = table(["--runs", str(tmp_path / "empty")], capsys)
    assert code == 2 and out == ""
    where = tmp_path / "empty"
    expected = f"no run in {where}: a run directory holds config.yaml or results.json"
    assert err == f"mlcls-tables: error: {expected}\n"
    code, _, err = table(["--runs", str(tmp_path), "--table", "table1"], capsys)
    assert code == 2 and "--table apply to the paper tables, not to --runs" in err


def test_status_of_unfinished_and_resumed_runs():
    config = {"trainer": {"epochs": 4}}
    assert run_status(config, {"epochs_completed": 4}) == "finished"
    assert run_status(config, {"epochs_completed": 2}) == "unfinished (2 of 4 epochs)"
    assert run_status(config, {"epochs_completed": 4, "resumes": 2}) == "finished, resumed 2×"
    assert run_status(config, None) == "failed"


@pytest.mark.slow
def test_resuming_counts_in_the_state_and_results(sweep):
    checkpoint = torch.load(sweep / "0" / "checkpoints" / "last.pt", weights_only=False)
    assert checkpoint.get("resumes", 0) == 0 and results(sweep / "0")["resumes"] == 0
    state = TrainState()
    restore(checkpoint, sweep / "0" / "last.pt", {}, torch.amp.GradScaler("cpu"), state, "none", 0)
    assert state.resumes == 1
    restore(state.state_dict() | {"optimizer": {}}, sweep / "0" / "x.pt", {}, torch.amp.GradScaler("cpu"),
            state, "none", 0)  # fmt: skip
    assert state.resumes == 2


def test_differing_keys_name_a_rebuilt_group_once_and_skip_launch_keys():
    twoway = {"_target_": "mlcls.losses.TwoWayLoss", "tp": 4.0, "tn": 1.0}
    runs = [
        {"loss": twoway, "model": {"name": "a", "drop": 0.1}, "trainer": {"resume": None, "epochs": 2}},
        {"loss": {**twoway, "tp": 1.0}, "model": {"name": "a"}, "trainer": {"resume": "auto", "epochs": 2}},
        {"loss": {"_target_": "mlcls.losses.BinaryCrossEntropyLoss"}, "model": {"name": "a", "drop": 0.1},
         "trainer": {"resume": "x.pt", "epochs": 2}},
    ]  # fmt: skip
    settings = [flat_settings(run) for run in runs]
    assert [s["loss"] for s in settings] == ["twoway", "twoway", "bce"]
    assert differing_keys(settings) == ["loss", "model.drop"]
    assert differing_keys(settings[:2]) == ["loss.tp", "model.drop"]


HOSTILE = {
    "a": '=HYPERLINK("http://x.invalid","y")',
    "b": "two\nlines | forged | row",
    "c": "<img src=x onerror=alert(1)> & <b>bold</b>",
    "d": "+1\r-2",
    "e": "@SUM(A1)",
    "f": "\tcmd",
    "g_": "**bold** _em_ `code` ~~gone~~ \\[x] a_b_c",
}


@pytest.fixture
def others_runs(tmp_path):
    """Runs written by others: a setting whose text is markup or a formula in each, one with a results.json
    that is a JSON list, and one finished run whose numbers (a negative setting) must stay numbers."""
    for name, text in HOSTILE.items():
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(json.dumps({"trainer": {"epochs": 2}, "note": text}))
    (tmp_path / "g").mkdir()
    config = {"trainer": {"epochs": 2}, "note": "plain", "loss": {"gamma": -1}}
    finished = {"metrics": {"mAP_class": 51.25}, "epochs_completed": 2, "provenance": {"config": config}}
    (tmp_path / "g" / "results.json").write_text(json.dumps(finished))
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "results.json").write_text("[1, 2]")
    return tmp_path


def _markdown_cells(line: str) -> list[str]:
    """The cells of a Markdown table row, split on the pipes that are not escaped, shown as a CommonMark
    renderer shows them: a backslash before ASCII punctuation shows the character, entities decoded."""
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    shown = [re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", cell.strip(" ")) for cell in cells]
    return [html.unescape(cell.replace("<br>", "\n")) for cell in shown]


def test_markdown_of_others_runs_shows_their_text_without_markup(others_runs, capsys):
    code, out, err = table(["--runs", str(others_runs)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| "))
    rows = lines[header + 2 :]
    assert len(rows) == len(HOSTILE) + 2  # one line per run: no row forged by a newline
    columns = _markdown_cells(lines[header])
    shown = {}
    for line in rows:
        cells = dict(zip(columns, _markdown_cells(line), strict=True))  # no cell forged by a pipe
        shown[cells["run"]] = cells
    for name, text in HOSTILE.items():
        assert shown[str(others_runs / name)]["note"] == text.replace("\r", "\n")
    without_breaks = out.replace("<br>", "")
    assert "<" not in without_breaks and ">" not in without_breaks  # no raw HTML
    # no emphasis, code span or strike-through: every such character in the rows is escaped (an underscore
    # within a word never is one)
    marker = re.compile(r"(?<!\\)[*~`]|(?<![^\W_])(?<!\\)_|(?<!\\)_(?![^\W_])")
    assert not any(marker.search(line) for line in rows)
    assert shown[str(others_runs / "g")]["mAP_class"] == "51.25"


def test_csv_of_others_runs_runs_no_formula_and_json_is_unchanged(others_runs, capsys):
    code, out, err = table(["--runs", str(others_runs), "--csv"], capsys)
    assert code == 0, err
    rows = {row["run"]: row for row in csv.DictReader(io.StringIO(out))}
    for name, text in HOSTILE.items():
        formula = text[0] in "=+-@\t\r"  # OWASP's list of a formula's first characters
        # shown as text by a spreadsheet; a lone CR as a line break the writer quotes
        assert rows[str(others_runs / name)]["note"] == "'" * formula + text.replace("\r", "\n")
    finished = rows[str(others_runs / "g")]
    assert (finished["note"], finished["loss.gamma"], finished["mAP_class"]) == ("plain", "-1", "51.25")

    code, out, err = table(["--runs", str(others_runs), "--json"], capsys)
    runs = {run["run"]: run for run in json.loads(out)}
    assert {name: runs[str(others_runs / name)]["note"] for name in HOSTILE} == HOSTILE
    assert runs[str(others_runs / "g")]["loss.gamma"] == -1


def test_a_results_json_that_is_not_an_object_is_listed_unreadable(others_runs, capsys):
    code, out, err = table(["--runs", str(others_runs), "--json"], capsys)
    assert code == 0 and err == ""
    runs = {run["run"]: run for run in json.loads(out)}
    where = others_runs / "h" / "results.json"
    assert runs[str(others_runs / "h")]["status"] == f"unreadable: {where}: a JSON list; expected an object"
    assert runs[str(others_runs / "g")]["status"] == "finished" and len(runs) == len(HOSTILE) + 2
    code, out, err = table([str(others_runs / "h")], capsys)  # the paper tables need every run
    assert (code, out) == (2, "")
    assert err == f"mlcls-tables: error: {where}: a JSON list; expected an object\n"


# metrics.zsl figures of someone's results.json, each once (old: printed as they are; NaN as "nan")
ZSL_HOSTILE = {
    "osc": "\x1b]0;title\x07",
    "csi": "\x1b[31mred\x9b0m",
    "object": {"a": 1},
    "digits": 10**400,
    "infinite": float("inf"),
    "huge": 1e308,
    "negative": -5.0,
}


@pytest.fixture
def zsl_runs(tmp_path):
    """A run per hostile metrics.zsl.mAP_class, one whose zsl figures are NaN and 12.5, and a run folder
    named with escape sequences whose setting holds some too."""
    config = {"trainer": {"epochs": 1}}
    for name, value in ZSL_HOSTILE.items():
        results = {"metrics": {"mAP_class": 40.0, "zsl": {"mAP_class": value}}, "epochs_completed": 1}
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(
            json.dumps({**results, "provenance": {"config": config}})
        )
    nan = {"metrics": {"mAP_class": 40.0, "zsl": {"mAP_class": float("nan"), "mAP_sample": 12.5}}}
    (tmp_path / "nan").mkdir()
    (tmp_path / "nan" / "results.json").write_text(json.dumps({**nan, "provenance": {"config": config}}))
    escaped = tmp_path / "run\x1b[2J\x1b]0;x\x07"
    escaped.mkdir()
    (escaped / "config.yaml").write_text(json.dumps({"trainer": {"epochs": 1}, "note": "a\x1b[5mb\x9bc"}))
    return tmp_path


@pytest.mark.parametrize("form", ["markdown", "csv", "json"])
def test_hostile_zero_shot_figures_and_escape_sequences_never_reach_the_terminal(zsl_runs, capsys, form):
    code, out, err = table(
        ["--runs", str(zsl_runs), *({"markdown": [], "csv": ["--csv"], "json": ["--json"]}[form])], capsys
    )
    assert code == 0 and err == "", err
    assert not any(char in out for char in "\x1b\x07\x9b"), repr(out)
    code, out, err = table(["--runs", str(zsl_runs), "--json"], capsys)
    runs = {run["run"].rsplit("/", 1)[1]: run for run in json.loads(out)}
    for name in ZSL_HOSTILE:
        assert runs[name]["status"].startswith(
            f"unreadable: {zsl_runs / name / 'results.json'}: metrics zsl "
        )
        assert "expected a number from 0 to 100, NaN (undefined) or null" in runs[name]["status"]
    assert (runs["nan"]["zsl.mAP_class"], runs["nan"]["zsl.mAP_sample"]) == (None, 12.5)
    assert runs["run\\x1b[2J\\x1b]0;x\\x07"]["note"] == "a\\x1b[5mb\\x9bc"
