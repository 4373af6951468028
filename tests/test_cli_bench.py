"""``mlcls-bench``: every subcommand runs on tiny inputs and prints one JSON line with ``_per_s`` rates."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from conftest import TINY, TINY_RESNET10T
from hostile import bounded
from sklearn.metrics import average_precision_score

from mlcls.bench.pipeline_bench import _datasets, make_jpegs
from mlcls.cli.bench import add_rates, main
from mlcls.metrics import compute_metrics


def json_line(capsys: pytest.CaptureFixture[str]) -> dict:
    """The single line printed on stdout, parsed; every ``_per_s`` value a positive finite number."""
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    result = json.loads(lines[0])
    rates = {key: value for key, value in result.items() if key.endswith("_per_s")}
    assert rates and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in rates.values()), rates
    return result


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("bench_jpegs")
    make_jpegs(folder, 3, size=(96, 72))
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_pipeline(images, workers, capsys):
    main(["pipeline", "--images", images, "--n", "4", "--size", "32", "--batch-size", "2", "--repeats", "1",
          "--workers", str(workers)])  # fmt: skip
    result = json_line(capsys)
    names = (
        "torchvision_",
        "plain_",
        "fast_cpu_stage_",
        "device_stage_",
        "shards_cpu_stage_",
        "shards_",
        "pack_",
    )
    for name in ("", *names):
        assert f"{name}images_per_s" in result
    rates = [value for key, value in result.items() if key.endswith("_per_s")]
    assert rates and all(math.isfinite(rate) and rate > 0 for rate in rates)
    assert {"ratio_fast_vs_torchvision", "ratio_shards_vs_torchvision"} <= result.keys()
    assert result["workers"] == workers and result["n"] == 4


def test_pipeline_without_jpegs_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["pipeline", "--images", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"mlcls: error: no JPEG files (*.jpg, *.jpeg) in {tmp_path}"


@pytest.mark.slow  # packs shards (about 5 s)
def test_pipeline_with_fewer_images_than_a_batch_is_one_line(images, capsys):
    """Old: the packed shards' endless batches looped for ever over epochs of no whole batch."""
    with pytest.raises(SystemExit) as exit_info:
        main(["pipeline", "--images", images, "--n", "4", "--size", "32", "--batch-size", "8",
              "--repeats", "1"])  # fmt: skip
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "mlcls: error: the packed shards hold 3 readable samples, fewer than one batch of 8: give --images "
        "more images or a smaller --batch-size"
    )


@pytest.mark.slow  # forks a bounded child
def test_every_pipeline_refuses_a_fifo_named_like_a_jpeg_at_once(tmp_path):
    """Old: the torchvision and decode_only pipelines opened each file with ``Image.open``, so
    ``mlcls-bench pipeline --images DIR`` blocked on a FIFO named ``x.jpg`` until killed."""
    os.mkfifo(tmp_path / "x.jpg")

    def refusals() -> dict[str, str]:
        found = {}
        for name, dataset in _datasets([tmp_path / "x.jpg"], 32).items():
            try:
                dataset[0]
            except TimeoutError:  # the bound's alarm (an OSError too): the child reports it
                raise
            except OSError as exc:
                found[name] = f"{type(exc).__name__}: {exc}"
        return found

    outcome = bounded(refusals, seconds=10)
    assert not outcome.escaped and outcome.error is None, outcome
    assert outcome.value.keys() == {"torchvision", "plain", "fast_cpu_stage", "fast", "decode_only"}
    for why in outcome.value.values():
        assert "\n" not in why and "x.jpg is a pipe (FIFO); expected a regular file" in why, why


@pytest.mark.slow  # trains (5-8 s on 2 cores)
@pytest.mark.parametrize("loop", ["epoch", "step"])
def test_step(capsys, tmp_path, monkeypatch, loop):
    monkeypatch.chdir(tmp_path)
    main(["step", *TINY_RESNET10T, "trainer.batch_size=8", "--loop", loop, "--repeats", "1", "--steps", "2",
          "--warmup", "0"])  # fmt: skip
    result = json_line(capsys)
    assert result["loop"] == loop and result["steps"] == 2
    assert {"trainer_images_per_s", "bare_images_per_s"} <= result.keys()
    assert result["model"] == "resnet10t" and result["batch_size"] == 8 and result["image_size"] == 32
    assert result["trainer_images_per_s"] > 0 and result["bare_images_per_s"] > 0


@pytest.mark.slow
def test_loss(capsys):
    main(["loss", "--repeats", "1"])
    result = json_line(capsys)
    assert result["twoway_512x80_per_s"] == pytest.approx(1000 / result["twoway_512x80_ms"])


def test_metrics(capsys):
    main(["metrics", "--n", "200", "--c", "5"])
    result = json_line(capsys)
    assert result["mlcls_pair_per_s"] == pytest.approx(1 / result["mlcls_pair_s"])
    assert result["equal"] is True


def test_add_rates_inverts_every_timing():
    result = add_rates({"a_ms": 4.0, "b_s": 0.5, "c_per_s": 3.0, "equal": True, "name": "x", "zero_s": 0.0})
    assert result == {"a_ms": 4.0, "a_per_s": 250.0, "b_s": 0.5, "b_per_s": 2.0, "c_per_s": 3.0,
                      "equal": True, "name": "x", "zero_s": 0.0}  # fmt: skip


def test_eval(capsys):
    """The evaluation of outputs streamed to disk: its figures are those of the outputs, checked against
    the float64 references; its memory and times are reported."""
    from mlcls.bench.eval_bench import make_outputs

    main(["eval", "--n", "300", "--c", "40", "--seed", "3", "--in-memory-gb", "0", "--check", "6"])
    result = json_line(capsys)
    assert result["store"] == "DiskStore"
    scores, labels = make_outputs(300, 40, seed=3)
    assert labels.dtype == torch.int8 and set(labels.unique().tolist()) == {-1, 0, 1}
    assert result["mAP_class"] == pytest.approx(
        compute_metrics(scores, labels, [str(c) for c in range(40)])["mAP_class"]
    )
    known = labels >= 0
    per_class = [
        average_precision_score(labels[known[:, c], c] == 1, scores[known[:, c], c])
        for c in range(40)
        if (labels[:, c] == 1).any()
    ]
    assert result["mAP_class"] == pytest.approx(100 * np.mean(per_class))
    assert (result["n"], result["c"], result["classes_counted"]) == (300, 40, len(per_class))
    assert result["exact"] and (result["checked_classes"], result["checked_samples"]) == (6, 6)
    assert result["peak_rss_gb"] > 0
    phases = ("store_s", "metrics_s", "thresholds_s", "held_out_s", "results_s")
    assert result["time_s"] == pytest.approx(sum(result[phase] for phase in phases), abs=0.003)


def test_thresholds(capsys):
    """Held-out F1 of per-tag thresholds beside one global threshold's on a long-tailed set."""
    main(["thresholds", "--n", "200", "--c", "30", "--halves", "1", "--min-positives", "0,5"])
    result = json_line(capsys)
    rules = [(r["rule"], r["min_positives"], r["pool"]) for r in result["rules"]]
    assert rules == [("f1", 0, "bins"), ("f1", 5, "bins"), ("f1", 5, "global"),
                     ("precision>=0.9", 0, "bins"), ("precision>=0.9", 10, "bins")]  # fmt: skip
    assert all(0 <= r["per_class_F1_mean"] <= 100 and 0 <= r["global_OF1"] <= 100 for r in result["rules"])
    assert 0 < result["tags_with_under_10_positives"] <= 30


def test_eval_without_samples_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--n", "0", "--c", "5"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "mlcls: error: --n and --c must be at least 1, got 0 and 5\n"


def test_step_heads_times_each_head_relative_to_the_first(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["step", *TINY, "trainer.batch_size=4", "--heads", "linear,mldecoder,csra", "--classes", "30",
          "--repeats", "1", "--steps", "1", "--warmup", "0"])  # fmt: skip
    result = json_line(capsys)
    assert result["classes"] == 30 and result["batch_size"] == 4 and result["image_size"] == 32
    assert result["linear_relative"] == 1.0
    for head in ("mldecoder", "csra"):
        assert result[f"{head}_relative"] == pytest.approx(result[f"{head}_step_s"] / result["linear_step_s"])
        assert result[f"{head}_images_per_s"] == pytest.approx(4 / result[f"{head}_step_s"])
    # the linear head's parameters: an fc layer of the backbone's width to 30 classes, float32
    width = timm.create_model("test_resnet", num_classes=0).num_features
    assert result["linear_head_parameters_mib"] * 2**20 == (width + 1) * 30 * 4


def test_step_heads_rejects_an_unknown_head_in_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["step", *TINY, "--heads", "linear,mlp"])
    assert (
        "--heads linear,mlp; expected a comma-separated list of linear, mldecoder, csra"
        in capsys.readouterr().err
    )


def test_the_documented_defaults_are_the_parsers():
    """Every ``[--flag VALUE]`` docs/performance.md shows for a subcommand is that flag's default (old:
    ``--subsampling 444`` for a default of auto; ``loss --scale``'s repeats said 20 and ran 100)."""
    import re

    from mlcls.bench.loss_bench import SCALE_REPEATS
    from mlcls.cli.bench import build_parser

    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command").choices
    text = (Path(__file__).parents[1] / "docs" / "performance.md").read_text()
    checked = 0
    for row in re.findall(r"^\| `mlcls-bench (\w+) ([^`|]*)`", text, flags=re.M):
        command, flags = row
        scale = "--scale" in flags
        for flag, value in re.findall(r"\[(--[\w-]+) ([^\]\[|]+?)\]", flags):
            if value.startswith(("DIR", "overrides")) or "\\|" in value:
                continue
            dest = flag[2:].replace("-", "_")
            default = commands[command].get_default(dest)
            if command == "loss" and dest == "repeats":
                default = SCALE_REPEATS if scale else 100
            assert str(default) == value, f"mlcls-bench {command} {flag}: docs {value}, default {default}"
            checked += 1
    assert checked >= 12


def test_step_heads_trains_each_head_with_each_of_the_losses(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["step", *TINY, "trainer.batch_size=4", "--heads", "linear", "--losses", "twoway,bce", "--classes",
          "30", "--repeats", "1", "--steps", "1", "--warmup", "0", "--memory"])  # fmt: skip
    result = json_line(capsys)
    assert result["linear_twoway_relative"] == 1.0
    assert result["linear_twoway_step_peak_mib"] > 0 and result["linear_bce_step_peak_mib"] > 0
    assert result["linear_bce_relative"] == pytest.approx(
        result["linear_bce_step_s"] / result["linear_twoway_step_s"]
    )
    with pytest.raises(SystemExit):
        main(["step", *TINY, "--heads", "linear", "--losses", "twoway,hinge"])
    assert "--losses twoway,hinge; expected a comma-separated list of" in capsys.readouterr().err
