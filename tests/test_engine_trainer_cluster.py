"""The cluster path of the trainer, on gloo processes and the CPU: SLURM start-up, failing ranks, resume
under DDP, mixed precision on the CPU with the non-finite guard, and a training step that reads nothing
back from the device between log steps."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config
from ranks import free_port, run_ranks

import mlcls.engine.checkpoint as checkpoint_module
import mlcls.engine.logging as logging_module
from mlcls.engine import distributed as engine_distributed
from mlcls.engine.build import warn_protocol
from mlcls.engine.checkpoint import load_checkpoint
from mlcls.engine.trainer import NonFiniteError, Trainer

WORLD = 2
# 128 samples of 16 pixels, global batch 32: 16 per process, 4 steps per epoch (TINY's model).
SMALL = ["dataset.train_size=128", "dataset.val_size=40", "dataset.image_size=16", "trainer.epochs=1"]


def _slurm_environment(rank: int, port: int) -> dict[str, str]:
    """What SLURM sets for task ``rank`` of a 2-task job on one node, and what submitit adds."""
    return {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": str(WORLD),
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "MASTER_PORT": str(port),  # set by many job scripts; submitit reads it as the port
        "CUDA_VISIBLE_DEVICES": "0,1",  # the job's GPUs, as SLURM sets them for every task of the node
    }


def _on_rank(rank: int, port: int, out_dir: str) -> None:
    """Run every scenario of :data:`SCENARIOS`, in order, as rank ``rank`` of one 2-process job (the SLURM
    scenario first: it starts the process group from SLURM's environment, which the others then share, as
    the runs of a sweep do) and save what each observed, or its traceback, to rank<r>.pt. A scenario that
    crashes ends the process: the other rank cannot be in step with it any more."""
    torch.set_num_threads(1)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SUBMITIT_EXECUTOR"):
        os.environ.pop(key, None)
    os.environ.update(_slurm_environment(rank, port))
    observed: dict[str, dict] = {}
    level = logging.getLogger("mlcls").level
    for name, scenario in SCENARIOS.items():
        # as in a new process (a trainer built and never fitted, as in _failures, keeps rank 1's at WARNING)
        logging.getLogger("mlcls").setLevel(level)
        with pytest.MonkeyPatch.context() as monkeypatch:  # each scenario's patches end with it
            try:
                observed[name] = scenario(rank, Path(out_dir) / name, monkeypatch)
            except BaseException:  # noqa: BLE001 - reported to the test
                observed[name] = {"crash": traceback.format_exc()}
        torch.save(observed, Path(out_dir) / f"rank{rank}.pt")
        if "crash" in observed[name]:
            return


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One 2-process job that runs every scenario; its directory and what each rank observed.

    The processes are forked where no CUDA device could have been initialised in this process (a fork
    does not import torch again); otherwise they are spawned."""
    out = tmp_path_factory.mktemp("ranks")
    method = "spawn" if torch.cuda.is_available() else "fork"
    run_ranks(_on_rank, (free_port(), str(out)), WORLD, 900, "the 2-process job", method)
    return out, [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def _observed(ranks: tuple[Path, list[dict]], scenario: str) -> list[dict]:
    """What each rank observed in ``scenario``."""
    observed = []
    for rank, by_scenario in enumerate(ranks[1]):
        assert scenario in by_scenario, f"rank {rank} did not run {scenario}: an earlier scenario crashed"
        assert "crash" not in by_scenario[scenario], f"rank {rank}:\n{by_scenario[scenario]['crash']}"
        observed.append(by_scenario[scenario])
    return observed


# ---------------------------------------------------------------------------------------------- SLURM
def _slurm(rank: int, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    # The global batch of 32 in buckets of 32: only valid when the loss gathers both processes' 16 rows.
    cfg = compose_config([*TINY, *SMALL, "loss.gather=true", "loss.bucket_size=32"])
    results = Trainer(cfg, run_dir=out / "run").fit()
    return {
        "world_size": results["world_size"],
        "mAP": results["metrics"]["mAP_class"],
        "visible": os.environ["CUDA_VISIBLE_DEVICES"],
    }


@pytest.mark.slow
def test_slurm_tasks_are_validated_as_the_whole_job(ranks):
    """Under Hydra's submitit launcher the world size exists only after submitit's environment export:
    the config must be checked against it (loss.gather=true is refused for a single process)."""
    observed = _observed(ranks, "slurm")
    assert [o["world_size"] for o in observed] == [WORLD, WORLD]
    assert observed[0]["mAP"] == observed[1]["mAP"]
    assert [o["visible"] for o in observed] == ["0,1", "0,1"]  # each task still sees the node's GPUs


def test_cuda_device_of_a_local_rank():
    from mlcls.engine.distributed import cuda_device_index

    assert [cuda_device_index(r, 4) for r in range(4)] == [0, 1, 2, 3]  # every task sees the node's GPUs
    assert cuda_device_index(3, 1) == 0  # SLURM bound one GPU to the task
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3 but this process sees 2 CUDA devices"):
        cuda_device_index(3, 2)


# ---------------------------------------------------------------------------------------------- failing ranks
def _failures(rank: int, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    trainer = Trainer(compose_config([*TINY, *SMALL]), run_dir=out / "run")
    observed = {}

    if rank == 1:  # an unreadable image in rank 1's shard of the validation set

        def broken(*args, **kwargs):
            raise OSError("cannot identify image file 'val/0007.jpg'")

        import mlcls.engine.evaluate as evaluate_module

        monkeypatch.setattr(evaluate_module, "predict", broken)
    start = time.perf_counter()
    try:
        trainer.measure()
        observed["evaluate"] = "returned"
    except Exception as exc:  # noqa: BLE001
        observed["evaluate"] = f"{type(exc).__name__}: {exc}"
    observed["evaluate_s"] = time.perf_counter() - start

    if rank == 0:  # the disk fills while rank 0 writes the checkpoint

        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(trainer.checkpointer, "_write_files", full_disk)
    start = time.perf_counter()
    try:
        trainer.save(is_best=False)
        observed["save"] = "returned"
    except Exception as exc:  # noqa: BLE001
        observed["save"] = f"{type(exc).__name__}: {exc}"
    observed["save_s"] = time.perf_counter() - start
    return observed


@pytest.mark.slow
def test_a_failing_rank_ends_every_rank_with_its_error(ranks):
    """A rank failing in evaluation, or rank 0 failing to write a checkpoint, must not leave the others
    waiting in a collective until the timeout: every rank stops within seconds, naming the failure."""
    rank0, rank1 = _observed(ranks, "failures")
    assert rank1["evaluate"].startswith("OSError: cannot identify image file")
    assert (
        rank0["evaluate"] == "RankFailed: rank 1 failed: OSError: cannot identify image file 'val/0007.jpg'"
    )
    assert rank0["save"].startswith("OSError: [Errno 28] No space left on device")
    assert rank1["save"] == "RankFailed: rank 0 failed: OSError: [Errno 28] No space left on device"
    assert max(rank0["evaluate_s"], rank1["evaluate_s"], rank0["save_s"], rank1["save_s"]) < 20


def _startup(rank: int, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Rank 0 cannot open its run log (an MLflow server that is down) while rank 1 starts normally."""
    if rank == 0:

        class Unreachable:
            def __init__(self, *args, **kwargs):
                raise ConnectionError("MLflow server http://tracking:5000 is down")

        monkeypatch.setattr(logging_module, "MlflowRun", Unreachable)
    level = logging.getLogger("mlcls").level
    start = time.perf_counter()
    try:
        Trainer(compose_config([*TINY, *SMALL, "logger=mlflow"]), run_dir=out / "run")
        outcome = "started"
    except Exception as exc:  # noqa: BLE001
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    return {"outcome": outcome, "seconds": seconds, "level_kept": level == logging.getLogger("mlcls").level}


@pytest.mark.slow
def test_a_failing_rank0_start_up_ends_every_rank(ranks):
    """Rank 0's start-up work (config.yaml, TensorBoard, MLflow) fails: rank 1 must not go on to train and
    wait for it in DDP; both raise within seconds, and rank 1's logger keeps its level."""
    rank0, rank1 = _observed(ranks, "startup")
    error = "ConnectionError: MLflow server http://tracking:5000 is down"
    assert (rank0["outcome"], rank1["outcome"]) == (error, f"RankFailed: rank 0 failed: {error}")
    assert max(rank0["seconds"], rank1["seconds"]) < 60
    assert rank1["level_kept"]


# ---------------------------------------------------------------------------------- resume under DDP
def _resume(rank: int, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """An uninterrupted epoch; the same epoch stopped by a signal to rank 0 after step 2, then resumed
    while rank 1 sees no checkpoint of its own (as on a node whose file system lags)."""
    monkeypatch.setattr(engine_distributed, "POLL_EVERY", 1)
    level_before = logging.getLogger("mlcls").level
    straight = Trainer(compose_config([*TINY, *SMALL]), run_dir=out / "straight").fit()
    level_after = logging.getLogger("mlcls").level

    class SignalAfterStep2(Trainer):
        def train_step(self, images, targets):
            self.steps = getattr(self, "steps", 0) + 1
            if self.steps == 2 and self.dist.rank == 0:
                self.signals.received = signal.SIGTERM
            return super().train_step(images, targets)

    cfg = compose_config([*TINY, *SMALL])
    try:
        SignalAfterStep2(cfg, run_dir=out / "stopped").fit()
        stopped = "finished"
    except Exception as exc:  # noqa: BLE001
        stopped = type(exc).__name__
    if rank == 1:  # had rank 1 chosen for itself, it would start afresh
        monkeypatch.setattr(checkpoint_module, "choose_resume_checkpoint", lambda *args: (None, None))
    resumed_trainer = Trainer(compose_config([*TINY, *SMALL, "trainer.resume=auto"]), run_dir=out / "stopped")
    start = (resumed_trainer.state.epoch, resumed_trainer.state.step)
    resumed = resumed_trainer.fit()
    straight_weights, resumed_weights = (
        load_checkpoint(out / name / "checkpoints" / "last.pt")["model"] for name in ("straight", "stopped")
    )
    return {
        "levels": (level_before, level_after),
        "same_weights": all(torch.equal(straight_weights[k], resumed_weights[k]) for k in straight_weights),
        "resumed_weights": resumed_trainer.model.state_dict(),
        "straight": straight["history"],
        "stopped": stopped,
        "start": start,
        "resumed": resumed["history"],
    }


@pytest.mark.slow
def test_mid_epoch_resume_under_ddp_matches_the_uninterrupted_run(ranks):
    """Rank 0 chooses the checkpoint for every rank, and every rank's partial loss sum is restored."""
    rank0, rank1 = _observed(ranks, "resume")
    # The flag set during step 2 is exchanged after it and read after step 3 (POLL_EVERY = 1).
    state = load_checkpoint(ranks[0] / "resume" / "stopped" / "checkpoints" / "iter_000000003.pt")
    assert (state["epoch"], state["step"]) == (0, 3)
    assert len(state["partial"]) == WORLD and state["partial"][0] != state["partial"][1]
    for observed in (rank0, rank1):
        assert observed["stopped"] == "Preempted"
        assert observed["start"] == (0, 3)
        assert [h["loss"] for h in observed["resumed"]] == pytest.approx(
            [h["loss"] for h in observed["straight"]], rel=1e-6
        )
        assert observed["same_weights"]  # the resumed run ends with the uninterrupted run's weights
    weights0, weights1 = rank0["resumed_weights"], rank1["resumed_weights"]
    assert all(torch.equal(weights0[k], weights1[k]) for k in weights0)  # the ranks trained one model
    # rank 1 logs warnings only while it trains, and gives the logger its level back at the end
    assert rank1["levels"][0] == rank1["levels"][1] != logging.WARNING


# In this order: the SLURM scenario starts the process group.
SCENARIOS = {"slurm": _slurm, "startup": _startup, "failures": _failures, "resume": _resume}


# ---------------------------------------------------------------------------------------------- one process
class _CountReads:
    """Counts reads of tensor values by the host (``item``, ``bool``, ``int``, ``float``, ``tolist``) made
    while the training loop runs, outside the data pipeline (which works on the CPU by design) and the
    losses' label check (made for CPU targets only; tests/test_losses.py runs the losses on the meta device
    and finds no read)."""

    METHODS = ("item", "__bool__", "__int__", "__float__", "tolist")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            in_loop = in_data = label_check = False
            frame = caller
            while frame is not None:  # the calling frames (walked, not extracted: no source lines read)
                name_, filename = frame.f_code.co_name, frame.f_code.co_filename
                in_loop = in_loop or name_ == "train_one_epoch"
                in_data = in_data or "/mlcls/data/" in filename or "/torch/utils/data/" in filename
                label_check = label_check or (name_ == "prepare" and "/mlcls/losses/" in filename)
                frame = frame.f_back
            if in_loop and not in_data and not label_check:
                self.calls.append(f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return original(tensor, *args, **kwargs)

        return counted


RMSPROP = ["optim._target_=torch.optim.RMSprop", "~optim.fused", "~optim.betas", "+optim.momentum=0.9"]
# CPU kernels (fp16's most) are slow: these tests train timm's test_resnet (a ResNet of 0.4 M parameters) on
# batches of 8 (the behaviour depends on neither size)
SMALL_BATCH = ["model.name=test_resnet", "trainer.batch_size=8"]


@pytest.mark.parametrize(
    "extra",
    [
        [],  # AdamW, fused
        ["trainer.grad_clip=1.0", "trainer.ema_decay=0.99"],
        RMSPROP,  # not fused: its non-finite steps are skipped by restoring a copy
        pytest.param([*RMSPROP, "trainer.amp=fp16"], marks=pytest.mark.slow),  # with fp16's loss scale
    ],
)
@pytest.mark.slow
def test_the_training_loop_reads_the_device_only_at_log_steps(tmp_path, monkeypatch, extra):
    """Steps between log steps cost no host read: an epoch of 4 steps reads as often as one of 2, with a
    fused optimizer or not, with fp16's loss scale or not."""

    def reads(steps: int) -> list[str]:
        cfg = compose_config(
            [*TINY, *extra, *SMALL_BATCH, "trainer.log_every=1000", f"trainer.limit_train_batches={steps}"]
        )  # fmt: skip
        trainer = Trainer(cfg, run_dir=tmp_path / str(steps))
        counter = _CountReads(monkeypatch)
        trainer.train_one_epoch(0)
        monkeypatch.undo()
        return counter.calls

    two, four = reads(2), reads(4)
    assert two  # the counter works: the epoch's end reads its totals
    assert len(four) == len(two), "\n".join(four)


# Losses whose steps must not synchronise either: the default, and those with a row per training sample
# (their batches carry sample indices, their tables are read and written on the device).
SYNC_FREE_LOSSES = {
    "default": [],
    "role": ["loss=role", "loss.expected_positives=2", "dataset.observed=single_positive"],
    "em_apl": ["loss=em", "loss.apl=true", "loss.epochs=2", "loss.warmup_epochs=1",
               "dataset.observed=single_positive"],
    "ll_cp": ["loss=ll", "loss.mode=cp", "loss.delta_rel=0.05", "dataset.observed=single_positive"],
}  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loss", sorted(SYNC_FREE_LOSSES))
@pytest.mark.slow
def test_no_synchronising_call_in_cuda_training_steps(tmp_path, loss):
    cfg = compose_config(
        [*TINY, "trainer.device=cuda", "trainer.log_every=1000", "trainer.limit_train_batches=6",
         *SYNC_FREE_LOSSES[loss]]
    )  # fmt: skip
    trainer = Trainer(cfg, run_dir=tmp_path)
    trainer.train_one_epoch(0)  # warm-up: cuDNN autotuning, allocator, first optimizer state
    for module in trainer.loss_modules():  # terms of a later epoch: LL-Cp corrects from epoch 1 on
        if hasattr(module, "set_epoch"):
            module.set_epoch(1)
    batches = [next(iter(trainer.train_loader)) for _ in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:  # the device stage (the prefetcher's) and the step
            trainer.train_step(*trainer.device_stage.finish(batch))
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _NanLoss:
    """BCE of the logits, times NaN at the calls numbered in ``bad_calls`` (1-based), so that the step sees a
    NaN gradient; the finite losses it returned are kept in ``finite``."""

    def __init__(self, bad_calls) -> None:
        self.calls, self.bad_calls, self.finite = 0, bad_calls, []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets.clamp(min=0))
        if self.calls in self.bad_calls:
            return loss * float("nan")
        self.finite.append(loss.item())
        return loss


@pytest.mark.slow
def test_fp16_on_the_cpu_skips_counts_and_aborts(tmp_path):
    """trainer.amp=fp16 on the CPU, as the trainer sets it up: a step with an inf/NaN gradient is skipped
    (parameters and EMA unchanged), the loss scale backs off, and a run that never recovers stops with the
    usual message after trainer.max_nonfinite steps."""
    cfg = compose_config(
        [*TINY, "trainer.device=cpu", "trainer.amp=fp16", "trainer.ema_decay=0.9", "trainer.max_nonfinite=3",
         "trainer.log_every=1", *SMALL_BATCH]
    )  # fmt: skip
    trainer = Trainer(cfg, run_dir=tmp_path)
    assert trainer.amp == "fp16" and trainer.scaler.is_enabled() and trainer.scaler.get_scale() == 2.0**16
    trainer.criterion = _NanLoss(bad_calls=range(2, 10**6))
    batch = trainer.device_stage.finish(next(iter(trainer.train_loader)))
    trainer.train_step(*batch)
    ema_before = {k: v.clone() for k, v in trainer.ema.module.state_dict().items()}
    params_before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    _, applied = trainer.train_step(*batch)
    assert not applied
    assert all(torch.equal(v, trainer.ema.module.state_dict()[k]) for k, v in ema_before.items())
    assert all(torch.equal(v, dict(trainer.model.named_parameters())[k]) for k, v in params_before.items())
    assert trainer.scaler.get_scale() == 2.0**15  # the scaler backed off
    with pytest.raises(NonFiniteError, match="3 consecutive steps with a non-finite loss"):
        trainer.train_one_epoch(0)
    assert trainer._nonfinite.take_skipped() >= 3


@pytest.mark.parametrize("amp", ["none", "fp16"])
@pytest.mark.slow
def test_the_epoch_loss_is_the_mean_of_the_applied_steps(tmp_path, amp):
    """A skipped step counts in skipped_steps, not in the epoch's mean loss."""
    cfg = compose_config(
        [*TINY, "trainer.device=cpu", f"trainer.amp={amp}", "trainer.limit_train_batches=4", *SMALL_BATCH]
    )  # fmt: skip
    trainer = Trainer(cfg, run_dir=tmp_path)
    trainer.criterion = _NanLoss(bad_calls={2})
    record = trainer.train_one_epoch(0)
    assert len(trainer.criterion.finite) == 3
    assert record["loss"] == pytest.approx(sum(trainer.criterion.finite) / 3, rel=1e-6)
    assert trainer.state.counts["skipped_steps"] == 1


@pytest.mark.parametrize(("amp", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
@pytest.mark.slow
def test_mixed_precision_trains_on_the_cpu(tmp_path, amp, dtype):
    """trainer.amp=bf16|fp16 on the CPU: the forward runs under autocast in that dtype (evaluation too,
    eval_amp=null) and a short run trains to finite losses and metrics."""
    cfg = compose_config(
        [*TINY, *SMALL_BATCH, "trainer.device=cpu", f"trainer.amp={amp}", "trainer.epochs=1",
         "trainer.limit_train_batches=1", "trainer.limit_val_batches=1"]
    )  # fmt: skip
    trainer = Trainer(cfg, run_dir=tmp_path)
    assert trainer.eval_amp == amp and trainer.scaler.is_enabled() == (amp == "fp16")
    dtypes = []
    trainer.model.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    results = trainer.fit()
    assert dtypes and set(dtypes) == {dtype}
    assert all(math.isfinite(record["loss"]) for record in results["history"])
    assert math.isfinite(results["metrics"]["mAP_class"]) and results["metrics"]["mAP_class"] > 0
    assert results["counts"]["skipped_steps"] == 0


@pytest.mark.slow
def test_amp_auto_is_float32_on_the_cpu(tmp_path):
    """The default trainer.amp=auto keeps CPU runs in float32 (bf16 on CUDA) and needs no GradScaler."""
    trainer = Trainer(compose_config([*TINY, "trainer.device=cpu"]), run_dir=tmp_path)
    assert (trainer.amp, trainer.eval_amp, trainer.scaler.is_enabled()) == ("none", "none", False)


@pytest.mark.slow
def test_resume_with_another_amp_mode_warns_and_continues(tmp_path, caplog):
    run_dir = tmp_path / "run"
    Trainer(
        compose_config(
            [
                *TINY,
                *SMALL_BATCH,
                "trainer.epochs=1",
                "trainer.amp=none",  # the stored config says fp16 below: no bf16 step needed
                "trainer.limit_train_batches=1",
                "trainer.limit_val_batches=1",
            ]
        ),
        run_dir=run_dir,  # fmt: skip
    ).fit()
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    state["config"]["trainer"]["amp"] = "fp16"  # as written by a fp16 run on a GPU
    state["scaler"] = {"scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                       "_growth_tracker": 0}  # fmt: skip
    torch.save(state, run_dir / "checkpoints" / "last.pt")
    with caplog.at_level(logging.WARNING, logger="mlcls"):
        trainer = Trainer(
            compose_config(
                [
                    *TINY,
                    *SMALL_BATCH,
                    "trainer.amp=bf16",
                    "trainer.resume=auto",
                ]
            ),
            run_dir=run_dir,
        )
    assert "trained with trainer.amp=fp16; continuing with trainer.amp=bf16 (fresh loss scale)" in caplog.text
    assert trainer.state.epoch == 1 and trainer.scaler.get_scale() == 1.0


@pytest.mark.slow
def test_paper_presets_on_one_process_warn_about_batchnorm(caplog):
    cfg = compose_config(["experiment=paper_twoway"])
    assert cfg.trainer.eval_amp == "none"  # the authors evaluate in float32
    with caplog.at_level(logging.WARNING, logger="mlcls"):
        warn_protocol(cfg, world_size=1)
    assert "BatchNorm normalises over all 512 samples" in caplog.text and "torchrun" in caplog.text
    caplog.clear()
    warn_protocol(cfg, world_size=4)
    assert not caplog.text


def _train_in_process(monkeypatch, cwd: Path, *args: str) -> int:
    """The exit status of ``mlcls-train *args`` run in this process in directory ``cwd``."""
    from mlcls.cli.train import main

    monkeypatch.chdir(cwd)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["mlcls-train", *args])
    try:
        main()
    except SystemExit as exc:
        return exc.code
    return 0


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        ("dataset.train_size=10", "use trainer.batch_size=8 or less"),  # found when the data is built
        ("trainer.max_nonfinite=0", "trainer.max_nonfinite=0; expected a positive integer"),  # config check
    ],
)
@pytest.mark.slow
def test_failed_checks_leave_no_run_directory(tmp_path, monkeypatch, capsys, mistake, message):
    assert _train_in_process(monkeypatch, tmp_path, *TINY, mistake, "hydra.run.dir=runs/x") == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_hydra_run_dir_is_the_run_directory(tmp_path, monkeypatch):
    overrides = [*TINY, *SMALL_BATCH, "trainer.epochs=1", "dataset.train_size=64", "dataset.val_size=20"]
    assert _train_in_process(monkeypatch, tmp_path, *overrides, "hydra.run.dir=runs/first") == 0
    assert (tmp_path / "runs/first/results.json").is_file()
    assert (tmp_path / "runs/first/checkpoints/best.pt").is_file()
    assert not (tmp_path / "outputs").exists()
