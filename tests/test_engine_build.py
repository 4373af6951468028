"""Pieces the trainer is built from: the classes a validation split cannot score, stop signals, the CLI's
exit statuses."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch
from conftest import TINY, compose_config
from torch.utils.data import Subset

from mlcls.cli import train as train_cli
from mlcls.engine.build import build_run, classes_without_positives
from mlcls.engine.checkpoint import load_checkpoint
from mlcls.engine.distributed import StopSignals
from mlcls.engine.trainer import Preempted, Trainer


class _Labelled(torch.utils.data.Dataset):
    def __init__(self, labels):
        self.labels = torch.tensor(labels, dtype=torch.float32)

    def __len__(self):
        return len(self.labels)


def test_classes_without_a_positive_are_named():
    dataset = _Labelled([[1, 0, -1], [0, 0, 1], [1, -1, 0]])
    assert classes_without_positives(dataset, ["cat", "dog", "bird"]) == ["dog"]
    # a capped validation set (trainer.limit_val_batches) is judged on the samples it keeps
    assert classes_without_positives(Subset(dataset, [0]), ["cat", "dog", "bird"]) == ["dog", "bird"]
    assert classes_without_positives(torch.utils.data.TensorDataset(torch.zeros(2)), ["a"]) == []


@pytest.mark.slow
def test_the_trainer_trains_the_built_run_and_checkpoints_the_position_the_loop_set(tmp_path):
    cfg = compose_config([*TINY, "dataset.train_size=96", "dataset.val_size=40"])
    run = build_run(cfg, tmp_path)
    assert run.data.local_batch == cfg.trainer.batch_size and run.data.iters_per_epoch == 3
    assert (run.state.epoch, run.state.step) == (0, 0)
    trainer = Trainer(run)
    assert trainer.model is run.model and trainer.optimizer is run.optimizer and trainer.state is run.state
    try:
        trainer.state.epoch = 1  # what the loop sets after the first epoch
        trainer.save(is_best=False)
        assert (trainer.state.epoch, trainer.state.step) == (1, 0)  # writing moves nothing
        saved = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
        assert (saved["epoch"], saved["step"]) == (1, 0)
        assert (tmp_path / "checkpoints" / "iter_000000003.pt").is_file()  # 1 epoch of 3 steps
        # one convention for where a stop happened: the state's position
        with pytest.raises(Preempted, match="stopped by a signal at the end of epoch 1; "):
            trainer._stop()
        trainer.state.step = 2
        with pytest.raises(Preempted, match="stopped by a signal at epoch 2, step 2; "):
            trainer._stop()
    finally:
        trainer.run_log.close()


def test_first_ctrl_c_asks_to_stop_the_second_quits():
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a background job, Python's handler otherwise
    with StopSignals(distributed=False) as signals:
        assert not signals.poll(1)
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.poll(2) and signals.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
def test_ctrl_c_mid_epoch_checkpoints_then_resumes(tmp_path, caplog):
    class _CtrlCAtStep2(Trainer):
        def train_step(self, images, targets):
            self.steps = getattr(self, "steps", 0) + 1
            if self.steps == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return super().train_step(images, targets)

    overrides = [*TINY, "dataset.train_size=96", "dataset.val_size=40"]
    with pytest.raises(Preempted) as stopped:
        _CtrlCAtStep2(compose_config(overrides), run_dir=tmp_path).fit()
    assert stopped.value.signum == signal.SIGINT
    state = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert (state["epoch"], state["step"]) == (0, 2)
    with caplog.at_level(logging.INFO, logger="mlcls"):
        resumed = Trainer(compose_config([*overrides, "trainer.resume=auto"]), run_dir=tmp_path)
    assert (resumed.state.epoch, resumed.state.step) == (0, 2)
    assert "continuing at epoch 1, step 3" in caplog.text  # what runs next, counted from 1


@pytest.mark.parametrize(
    ("raised", "status"),
    [
        (Preempted("stopped", signal.SIGINT), 130),
        (Preempted("stopped", signal.SIGTERM), 75),
        (KeyboardInterrupt(), 130),
    ],
)
@pytest.mark.slow
def test_stops_exit_with_the_shells_statuses(monkeypatch, capsys, raised, status):
    def stopped(cfg):
        raise raised

    monkeypatch.setattr(train_cli, "run", stopped)
    with pytest.raises(SystemExit) as exit_info:
        train_cli._run_cli(None)
    assert exit_info.value.code == status
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlcls: ") and "\n" not in err and "Traceback" not in err
