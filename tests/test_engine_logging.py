"""``logger=mlflow``: the MLflow run of a training run (params, per-epoch metrics, artifacts), read back with
MLflow's own client."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mlcls.engine.logging import RunLog


@pytest.fixture(scope="module")
def mlflow():
    """MLflow, imported by the tests that use it (5 s: not at collection, which every worker does)."""
    return pytest.importorskip("mlflow")


@pytest.mark.slow  # MLflow runs uname while it opens a run
def test_mlflow_run_holds_params_metrics_plots_and_best_checkpoint(tmp_path: Path, mlflow) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "plots").mkdir(parents=True)
    (run_dir / "plots" / "per_class_ap.png").write_bytes(b"png")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "best.pt").write_bytes(b"weights")
    (run_dir / "results.json").write_text("{}")
    store = (tmp_path / "mlruns").as_uri()
    cfg = OmegaConf.create(
        {
            "logger": {"name": "mlflow", "tracking_uri": store, "experiment": "shapes", "run_name": None},
            "optim": {"lr_head": 0.002, "betas": [0.9, 0.99]},
            "ref": "${optim.lr_head}",
            "hydra": {"run": {"dir": "x"}},
        }
    )
    run_log = RunLog(run_dir, True, epochs=2, iters_per_epoch=3, cfg=cfg)
    run_log.epoch(0, 0.5, 100.0)
    run_log.evaluation(1, {"mAP_class": 40.0, "mAP_sample": 50.0, "per_class": [1, 2]}, _best(1))
    run_log.epoch(1, 0.25, 110.0)
    run_log.evaluation(2, {"mAP_class": 45.0, "mAP_sample": 55.0}, _best(2))
    run_log.close()

    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("shapes").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params == {"logger.name": "mlflow", "logger.tracking_uri": store,
                               "logger.experiment": "shapes", "logger.run_name": "None",
                               "optim.lr_head": "0.002", "optim.betas": "[0.9, 0.99]",
                               "ref": "0.002"}  # fmt: skip
    history = client.get_metric_history(run.info.run_id, "val_mAP_class")
    assert [(m.step, m.value) for m in history] == [(1, 40.0), (2, 45.0)]
    losses = client.get_metric_history(run.info.run_id, "train_epoch_loss")
    assert [(m.step, m.value) for m in losses] == [(1, 0.5), (2, 0.25)]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"plots", "results.json", "checkpoints"}
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == ["checkpoints/best.pt"]


def test_a_failed_run_is_marked_failed(tmp_path: Path, mlflow) -> None:
    store = (tmp_path / "mlruns").as_uri()
    cfg = OmegaConf.create({"logger": {"name": "mlflow", "tracking_uri": store, "experiment": "e"}})
    run_log = RunLog(tmp_path, True, epochs=1, iters_per_epoch=1, cfg=cfg)
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("boom")
        finally:
            run_log.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert run.info.status == "FAILED"


def _best(epoch: int) -> dict:
    return {"mAP_class": 45.0, "epoch": epoch, "weights": "raw"}


def test_a_non_main_run_log_quiets_the_logger_until_it_closes(tmp_path: Path) -> None:
    """Ranks other than 0 log warnings only while their run lasts; the level is theirs again afterwards (a
    sweep's next run in the same process logs as configured)."""
    logger = logging.getLogger("mlcls")
    before = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        run_log = RunLog(tmp_path, False, epochs=1, iters_per_epoch=1)
        assert logger.level == logging.WARNING
        run_log.close()
        assert logger.level == logging.DEBUG
        assert not (tmp_path / "tb").exists()
    finally:
        logger.setLevel(before)
