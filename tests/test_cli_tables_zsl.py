"""mlcls-tables --runs: the ZSL / GZSL figures of results.json's metrics.zsl and metrics.gzsl as columns."""

from __future__ import annotations

import json

from mlcls.cli import tables as tables_cli


def write_run(run_dir, metrics: dict) -> None:
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("trainer:\n  epochs: 1\nmodel:\n  head: cosine\n")
    results = {"metrics": metrics, "best": {"epoch": 1}, "epochs_completed": 1, "provenance": {}}
    (run_dir / "results.json").write_text(json.dumps(results))


def test_zero_shot_columns_appear_when_a_run_has_them(tmp_path, capsys) -> None:
    zsl = {"mAP_class": 61.5, "mAP_sample": 70.25, "F1_top3": 40.125, "F1_top5": 33.0}
    gzsl = {"mAP_class": 80.0, "mAP_sample": 85.5, "F1_top3": 55.0, "F1_top5": 45.75}
    write_run(tmp_path / "a", {"mAP_class": 80.0, "mAP_sample": 85.5, "zsl": zsl, "gzsl": gzsl})
    write_run(tmp_path / "b", {"mAP_class": 90.0, "mAP_sample": 91.0})
    assert tables_cli.main(["--runs", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["zsl.mAP_class"] == 61.5 and rows[0]["gzsl.F1_top5"] == 45.75
    assert rows[1]["zsl.F1_top3"] is None
    assert list(rows[0])[:4] == ["status", "mAP_class", "mAP_sample", "zsl.mAP_class"]
    assert tables_cli.main(["--runs", str(tmp_path), "--sort", "zsl.mAP_class"]) == 0
    markdown = capsys.readouterr().out
    assert "zsl.mAP" in markdown and "gzsl.F1" in markdown
    assert "61.50" in markdown and "40.12" in markdown


def test_no_zero_shot_columns_without_a_zero_shot_run(tmp_path, capsys) -> None:
    write_run(tmp_path / "a", {"mAP_class": 80.0, "mAP_sample": 85.5})
    assert tables_cli.main(["--runs", str(tmp_path), "--json"]) == 0
    assert not any(key.startswith(("zsl", "gzsl")) for key in json.loads(capsys.readouterr().out)[0])
