"""Reliability: mid-epoch preemption and exact resume, checkpoint fallback, non-finite guard, validation."""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings

import pytest
import torch
from conftest import compose_config

from mlcls.cli.train import main as train_main
from mlcls.cli.train import run
from mlcls.engine.checkpoint import load_checkpoint
from mlcls.engine.config_checks import check_config
from mlcls.engine.distributed import resolve_device
from mlcls.engine.guards import NonFiniteCounter
from mlcls.engine.state import CheckpointError
from mlcls.engine.trainer import LaggedRead, NonFiniteError, Preempted, Trainer
from mlcls.errors import ConfigError

# 96 training images in batches of 32: 3 steps per epoch, 2 epochs; 2 DataLoader workers.
SMALL = ["dataset.train_size=96", "dataset.val_size=40", "trainer.workers=2"]


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]


class _SignalAtStep(Trainer):
    """Sends itself SIGTERM during global step ``signal_step`` (1-based), as a scheduler would."""

    signal_step = 4

    def train_step(self, images, targets):
        self._steps_taken = getattr(self, "_steps_taken", 0) + 1
        if self._steps_taken == self.signal_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().train_step(images, targets)


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_is_bit_identical(tmp_path, tiny):
    straight = run(compose_config([*tiny, *SMALL]), run_dir=tmp_path / "a")

    with pytest.raises(Preempted, match="at epoch 2, step 1; .*trainer.resume=auto"):
        _SignalAtStep(compose_config([*tiny, *SMALL]), run_dir=tmp_path / "b").fit()
    # the device stage's thread (fetching from the 2 workers) was joined when the stop left the loop
    assert not [t for t in threading.enumerate() if t.name == "mlcls-device-stage"]
    state = load_checkpoint(tmp_path / "b" / "checkpoints" / "last.pt")
    assert (state["epoch"], state["step"]) == (1, 1)  # stopped after step 4 = epoch 2, step 1
    resumed = run(compose_config([*tiny, *SMALL, "trainer.resume=auto"]), run_dir=tmp_path / "b")

    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["metrics"]["mAP_class"] == straight["metrics"]["mAP_class"]
    assert [h["loss"] for h in resumed["history"]] == pytest.approx([h["loss"] for h in straight["history"]])


@pytest.mark.slow
def test_truncated_last_checkpoint_falls_back_to_previous(tmp_path, tiny):
    run_dir = tmp_path / "run"
    run(compose_config([*tiny, *SMALL]), run_dir=run_dir)
    ckpts = run_dir / "checkpoints"
    numbered = sorted(ckpts.glob("iter_*.pt"))
    assert [p.name for p in numbered] == ["iter_000000003.pt", "iter_000000006.pt"]  # keep_checkpoints=2
    last = ckpts / "last.pt"
    data = last.read_bytes()
    last.unlink()  # last.pt is a hard link of the newest numbered file: truncate both as a crash would
    numbered[-1].write_bytes(data[: len(data) // 3])
    last.write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="last.pt"):
        load_checkpoint(last)

    trainer = Trainer(compose_config([*tiny, *SMALL, "trainer.resume=auto"]), run_dir=run_dir)
    assert (trainer.state.epoch, trainer.state.step) == (1, 0)  # epoch 1's checkpoint, the previous one


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_abort(tmp_path, tiny):
    class _NaNLoss(torch.nn.Module):
        def __init__(self, bad_calls):
            super().__init__()
            self.calls, self.bad_calls = 0, bad_calls

        def forward(self, logits, targets):
            self.calls += 1
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets.clamp(min=0))
            return loss * float("nan") if self.calls in self.bad_calls else loss

    trainer = Trainer(compose_config([*tiny, *SMALL, "trainer.epochs=1"]), run_dir=tmp_path / "a")
    trainer.criterion = _NaNLoss(bad_calls={2})
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train_step(*next(iter(_plain_batches(trainer))))
    after_good = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    _, finite = trainer.train_step(*next(iter(_plain_batches(trainer))))
    assert not finite  # the update of the NaN step is skipped: parameters unchanged
    assert all(torch.equal(after_good[k], v) for k, v in trainer.model.named_parameters())
    assert any(not torch.equal(before[k], after_good[k]) for k in before)

    trainer = Trainer(
        compose_config(
            [
                *tiny,
                *SMALL,
                "trainer.max_nonfinite=2",
                "trainer.epochs=1",
            ]
        ),
        run_dir=tmp_path / "b",
    )
    trainer.criterion = _NaNLoss(bad_calls=set(range(1, 100)))
    with pytest.raises(NonFiniteError, match="learning rate"):
        trainer.fit()


def test_the_logged_loss_and_guard_are_read_one_log_period_later():
    """A log step's values are copied when taken and read at the next one (or the flush at the epoch's end
    or a stop), so the loop never waits for its queued steps; the guard raises from the run it took."""
    reads, counter = LaggedRead(), NonFiniteCounter(torch.device("cpu"), max_run=3)
    for applied in (True, False, False, False):
        counter.record(torch.tensor(applied))
    values = torch.stack([torch.tensor(0.75), counter.take_longest().float()])
    assert reads.swap(values, ("epoch 0", "step 3")) is None
    values.fill_(-1.0)  # the copy was taken at the swap
    counter.record(torch.tensor(True))
    previous = reads.swap(torch.stack([torch.tensor(0.5), counter.take_longest().float()]), "step 7")
    assert previous == ([0.75, 3.0], ("epoch 0", "step 3"))
    with pytest.raises(NonFiniteError, match="3 consecutive steps"):
        counter.raise_if(int(previous[0][1]), 0)
    assert (
        reads.flush() == ([0.5, 3.0], "step 7") and reads.flush() is None
    )  # the run went on past the first read
    counter.raise_if(int(counter.take_longest().item()), 0)  # none since: nothing raised


@pytest.mark.slow
def test_skipped_first_step_advances_the_schedule_without_warning(tmp_path, tiny):
    trainer = Trainer(compose_config([*tiny, *SMALL, "trainer.epochs=1"]), run_dir=tmp_path)
    trainer.criterion = lambda logits, targets: logits.sum() * float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, finite = trainer.train_step(*next(iter(_plain_batches(trainer))))
    assert not finite
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    assert trainer.scheduler.last_epoch == 1  # one schedule value per iteration, applied or skipped


def _plain_batches(trainer: Trainer):
    images = torch.randn(4, 3, 32, 32)
    targets = (torch.rand(4, 12) > 0.7).float()
    yield images, targets


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (["trainer.amp=fp32"], 1, "trainer.amp='fp32'; expected one of auto, none, bf16, fp16"),
        (["trainer.batch_size=32"], 3, "does not divide over 3 processes"),
        (["trainer.epochs=0"], 1, "trainer.epochs=0; expected a positive integer"),
        (["trainer.resume=auto"], 1, "needs hydra.run.dir=<run dir>"),
        (["trainer.ema_decay=1.5"], 1, "trainer.ema_decay=1.5"),
    ],
)
def test_config_validation_messages(tiny, overrides, world_size, message):
    cfg = compose_config([*tiny, *overrides])
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        check_config(cfg, world_size=world_size)


def _train_cli_error(argv: list[str], monkeypatch, capsys) -> list[str]:
    """The stderr lines of ``mlcls-train <argv>`` run in-process, which must exit with status 2 (the console
    script's entry point and exit status are proven by a subprocess in test_cli_train.py)."""
    monkeypatch.setattr(sys, "argv", ["mlcls-train", *argv])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    with pytest.raises(SystemExit) as exit_info:
        train_main()
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_the_device_setting_is_checked_once_in_one_line(tmp_path, monkeypatch, capsys):
    """``trainer.device`` is checked by resolve_device alone, the first thing a run does (old: a ValueError
    or RuntimeError traceback from init_distributed, before check_config's copy of the check ran)."""
    monkeypatch.chdir(tmp_path)
    assert _train_cli_error(["trainer.device=gpu"], monkeypatch, capsys) == [
        "mlcls: error: trainer.device='gpu'; expected auto, cpu or cuda"
    ]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^trainer.device=cuda but no CUDA device is available"):
            resolve_device("cuda")
    with pytest.raises(ConfigError, match=r"^device='tpu'; expected auto, cpu or cuda$"):
        resolve_device("tpu", "device")  # mlcls-eval's and mlcls-predict's key
    assert not any(tmp_path.iterdir())  # no run directory, no Hydra output


@pytest.mark.slow
def test_unknown_key_and_bad_value_fail_before_any_data_is_read(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # The dataset root does not exist: a config error must be reported first, as one line.
    argv = ["dataset=coco", f"dataset.root={tmp_path / 'nowhere'}", "trainer.amp=fp32"]
    assert _train_cli_error(argv, monkeypatch, capsys) == [
        "mlcls: error: trainer.amp='fp32'; expected one of auto, none, bf16, fp16"
    ]

    # A misspelt key: one line naming the option meant, and no run directory.
    argv = ["+trainer.epochz=3", f"hydra.run.dir={tmp_path / 'run'}"]
    assert _train_cli_error(argv, monkeypatch, capsys) == [
        "mlcls: error: unknown option +trainer.epochz: did you mean trainer.epochs? "
        "(nothing reads an added key; ++ adds one all the same)"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_usr1_checkpoints_then_hands_over_to_previous_handler(tmp_path, tiny):
    """Under submitit a handler is already installed for USR1; it must run after the checkpoint exists."""
    calls = []

    def submitit_like(signum, frame):
        calls.append((signum, (tmp_path / "run" / "checkpoints" / "last.pt").is_file()))

    class _Usr1(_SignalAtStep):
        signal_step = 2

        def train_step(self, images, targets):
            self._steps_taken = getattr(self, "_steps_taken", 0) + 1
            if self._steps_taken == self.signal_step:
                os.kill(os.getpid(), signal.SIGUSR1)
            return Trainer.train_step(self, images, targets)

    previous = signal.signal(signal.SIGUSR1, submitit_like)
    try:
        with pytest.raises(Preempted):
            _Usr1(compose_config([*tiny, *SMALL]), run_dir=tmp_path / "run").fit()
        assert calls == [(signal.SIGUSR1, True)]
        assert signal.getsignal(signal.SIGUSR1) is submitit_like  # restored
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_slurm_launcher_config_composes(tiny):
    from hydra import compose, initialize_config_dir

    from mlcls import config_dir

    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(
            "train", overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2"], return_hydra_config=True
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 4, 4)
    assert launcher.max_num_timeout > 0 and launcher.signal_delay_s > 0


def test_gradient_norm_is_clip_grad_norms_total_norm():
    """The trainer's finite check without clipping: the norm ``clip_grad_norm_`` reports, without its
    rescaling pass; non-finite as soon as one gradient entry is."""
    from mlcls.engine.guards import gradient_norm

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    torch.testing.assert_close(gradient_norm(model.parameters()), expected)
    model[0].weight.grad[0, 0] = float("nan")
    assert not torch.isfinite(gradient_norm(model.parameters()))
    assert gradient_norm([torch.nn.Parameter(torch.zeros(2))]) == 0


OPTIMIZERS = {
    "SGD fused": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01, fused=True),
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False),
    "SGD without state": lambda params: torch.optim.SGD(params, lr=0.1, foreach=False),
    "RMSprop": lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.9, centered=True),
    "AdamW foreach": lambda params: torch.optim.AdamW(params, lr=0.01, foreach=True),
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_a_skipped_step_keeps_the_parameters_and_the_optimizer_state(make):
    """step_if_finite against plain optimizers that take the applied steps only: a skipped step (the first
    one, which would make the state, or a later one) changes neither the parameters nor the state."""
    from mlcls.engine.guards import step_if_finite

    torch.manual_seed(0)
    start = [torch.randn(4, 3), torch.randn(3)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(4)]
    nan = [torch.full_like(t, float("nan")) for t in start]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    ours_opt, reference_opt = make(ours), make(reference)

    def step(params, optimizer, step_grads, applied=None):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        if applied is None:
            optimizer.step()
        else:
            step_if_finite(optimizer, applied)

    step(ours, ours_opt, nan, torch.tensor(False))  # a skipped first step leaves no state behind
    assert all(torch.equal(p, t) for p, t in zip(ours, start, strict=True)) and not ours_opt.state
    for k in range(4):
        step(ours, ours_opt, grads[k], torch.tensor(True))
        step(reference, reference_opt, grads[k])
        step(ours, ours_opt, nan, torch.tensor(False))
    assert all(torch.equal(p, r) for p, r in zip(ours, reference, strict=True))
    ours_state, reference_state = ours_opt.state_dict()["state"], reference_opt.state_dict()["state"]
    assert ours_state.keys() == reference_state.keys()
    for index, state in ours_state.items():
        assert state.keys() == reference_state[index].keys()
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(reference_state[index][key])), key
