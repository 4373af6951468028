"""Loaders: the builders (pinned memory, persistent workers, workers capped at the CPUs) and the device
prefetcher (CPU: exactly the un-prefetched batches; CUDA: the same batches, on the device, without syncs)."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from data_fixtures import PhotoFiles, write_photos

from mlcls.data import loader as batches
from mlcls.data.loader import (
    DevicePrefetcher,
    DeviceStage,
    RankSampler,
    ResumableSampler,
    available_cpus,
    build_eval_loader,
    build_train_loader,
)
from mlcls.data.pipeline.fast import HALF_PRECISION_LEVELS, AugmentedImage, FastTrainTransform
from mlcls.data.pipeline.transforms import IMAGENET_STD, build_transform

SIZE = 32
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_photos(tmp_path_factory.mktemp("photos"), 4)


@pytest.fixture
def two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process may run on 2 CPUs; the once-per-process log record is reset."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    batches._log_once.cache_clear()


def test_builders_pin_memory_and_keep_workers_on_cuda(photos):
    dataset = PhotoFiles(photos * 2, build_transform("light", SIZE, train=True))
    cuda = torch.device("cuda", 0)  # only the loaders' settings are read: no GPU needed
    train = build_train_loader(dataset, 4, 1, 0, 1, seed=0, device=cuda, backend="fast")
    evaluation = build_eval_loader(dataset, 4, 1, 0, 1, device=cuda)
    for loader in (train, evaluation.loader):
        assert loader.pin_memory and loader.persistent_workers and loader.num_workers == 1
    assert isinstance(train.sampler, ResumableSampler) and isinstance(evaluation.loader.sampler, RankSampler)
    assert evaluation.stage.device == cuda
    assert train.drop_last and len(train) == 2
    on_cpu = build_train_loader(dataset, 3, 0, 0, 1, seed=0, device=CPU, backend="torchvision")
    assert not on_cpu.pin_memory and not on_cpu.persistent_workers and len(on_cpu) == 2


@pytest.mark.slow
def test_workers_are_capped_at_the_cpus_and_said_once(photos, two_cpus, caplog):
    """trainer.workers=8 on 2 CPUs: 2 workers, one log line for all loaders, and no torch warning."""
    dataset = PhotoFiles(photos, build_transform("light", SIZE, train=False))
    with caplog.at_level(logging.INFO, logger="mlcls"), warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "This DataLoader will create 8 worker processes" warning
        train = build_train_loader(dataset, 2, 8, 0, 1, seed=0, device=CPU, backend="fast")
        evaluation = build_eval_loader(dataset, 2, 8, 0, 1, device=CPU)
        assert train.num_workers == evaluation.loader.num_workers == 2
        assert len(list(evaluation)) == 2
    capped = [r.getMessage() for r in caplog.records if "CPUs" in r.getMessage()]
    assert capped == ["DataLoader workers capped at the 2 CPUs this process may use (8 requested)"]
    assert build_eval_loader(dataset, 2, 1, 0, 1, device=CPU).loader.num_workers == 1


def test_available_cpus_falls_back_to_the_cpu_count(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert available_cpus() == 3


def test_dali_backend_needs_the_paper_transform(photos):
    from mlcls.data.datasets.base import DatasetConfigError

    dataset = PhotoFiles(photos, build_transform("light", SIZE, train=True))
    with pytest.raises(DatasetConfigError, match="use dataset.transform=paper"):
        build_train_loader(dataset, 2, 0, 0, 1, seed=0, device=CPU, backend="dali")


def _fast_loader(photos: list[Path], workers: int = 0):
    dataset = PhotoFiles(photos * 3, FastTrainTransform(SIZE))  # 12 samples, 4 batches of 3
    return build_train_loader(dataset, 3, workers, 0, 1, seed=11, device=CPU, backend="fast")


def test_prefetcher_on_the_cpu_gives_exactly_the_batches_of_the_stage(photos):
    """The trainer's loop over the prefetcher (started mid-epoch, as on resume) against the loader's batches
    finished by the device stage one by one."""
    stage = DeviceStage(CPU, channels_last=True)
    loader = _fast_loader(photos)
    loader.sampler.set_epoch(2)
    expected = [(stage(images), targets) for images, targets in loader]
    assert isinstance(next(iter(loader))[0], AugmentedImage)
    prefetcher = DevicePrefetcher(loader, stage)
    assert len(prefetcher) == 4 and prefetcher.sampler is loader.sampler
    prefetcher.sampler.set_epoch(2)
    prefetcher.sampler.set_start(3)  # resume after one batch
    got = list(enumerate(prefetcher, start=1))
    assert [step for step, _ in got] == [1, 2, 3]
    for (_, (images, targets)), (want_images, want_targets) in zip(got, expected[1:], strict=True):
        assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(images, want_images) and torch.equal(targets, want_targets)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetcher_on_cuda_gives_the_cpu_batches_without_syncs(photos):
    """The side-stream prefetcher on the GPU: the CPU stage's batches (the colour jitter in float16 on CUDA,
    within HALF_PRECISION_LEVELS grey levels), on the device, in order; neither the stage nor the prefetcher
    synchronises with the host."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    loader = _fast_loader(photos, workers=1)
    loader.sampler.set_epoch(0)
    expected = [(DeviceStage(CPU)(images), targets) for images, targets in loader]
    loader = build_train_loader(loader.sampler.dataset, 3, 1, 0, 1, seed=11, device=cuda, backend="fast")
    loader.sampler.set_epoch(0)
    stage = DeviceStage(cuda)
    assert stage.constants.eigval.device == cuda
    got = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for images, targets in DevicePrefetcher(loader, stage):
            got.append((images * 1.0, targets.clone()))  # work on the compute stream, as a step would
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert len(got) == len(expected) == 4
    for (images, targets), (want_images, want_targets) in zip(got, expected, strict=True):
        assert images.device == cuda and targets.device == cuda
        atol = 1e-4 + HALF_PRECISION_LEVELS / 255 / min(IMAGENET_STD)
        torch.testing.assert_close(images.cpu(), want_images, atol=atol, rtol=0)
        assert torch.equal(targets.cpu(), want_targets)


@pytest.mark.slow
def test_the_trainer_runs_the_device_stage_once_per_batch(tmp_path, monkeypatch):
    """An epoch of 3 steps (96 images, batches of 32) of the fast pipeline calls the device stage 3 times, in
    the prefetcher only (the step used to call it again on the finished batch: 6 calls, half no-ops)."""
    from conftest import TINY, compose_config

    from mlcls.engine.trainer import Trainer

    calls = []
    finish_images = DeviceStage.__call__
    monkeypatch.setattr(
        DeviceStage, "__call__", lambda stage, images: calls.append(1) or finish_images(stage, images)
    )
    overrides = [
        *TINY,
        "data.backend=fast",
        "dataset.train_size=96",
    ]
    trainer = Trainer(compose_config(overrides), run_dir=tmp_path)
    trainer.train_one_epoch(0)
    assert len(calls) == 3


def test_the_device_stage_thread_fetching_from_the_loader_gives_the_loaders_batches(photos, monkeypatch):
    """With a loader of worker processes the thread fetches the batches itself (forced here for an
    in-process loader): the loader's batches finished one by one, in order, none left out; the thread's
    host time is counted per batch."""
    stage = DeviceStage(CPU)
    loader = _fast_loader(photos)
    loader.sampler.set_epoch(1)
    expected = [stage.finish(batch) for batch in loader]
    monkeypatch.setattr(batches, "_reads_in_process", lambda loader: False)
    prefetcher = DevicePrefetcher(loader, stage)
    got = list(prefetcher)
    assert len(got) == len(expected) == 4 and stage.times.batches == 4
    assert stage.times.making_s > 0 and stage.times.waiting_s > 0
    for (images, targets), (want_images, want_targets) in zip(got, expected, strict=True):
        assert torch.equal(images, want_images) and torch.equal(targets, want_targets)


class _Refused(ValueError):
    pass


@pytest.mark.parametrize("in_process", [True, False])
def test_an_error_in_the_device_stage_thread_reaches_the_consumer_as_itself(monkeypatch, in_process):
    """An exception raised while finishing batch 3 (in the thread) is raised to the consumer with its type
    and message after batches 1 and 2; the thread is joined."""
    monkeypatch.setattr(batches, "_reads_in_process", lambda loader: in_process)
    threads = threading.active_count()

    def finish(batch: int) -> tuple[int]:
        if batch == 3:
            raise _Refused("batch 3: one line that says what is wrong")
        return (batch,)

    got = []
    with pytest.raises(_Refused, match="^batch 3: one line that says what is wrong$"):
        for made in batches.beside_the_step(range(1, 6), finish, CPU):
            got.append(made)
    assert got == [(1,), (2,)] and threading.active_count() == threads


@pytest.mark.parametrize("in_process", [True, False])
def test_the_device_stage_thread_ends_with_the_epoch_and_when_the_consumer_leaves(monkeypatch, in_process):
    """The thread is joined at the end of the batches, when the consumer closes the iterator while the
    thread waits to hand a batch over (the stop flag is seen within STOP_POLL_S), and when the consumer's
    loop raises (a stop signal's Preempted, an error on this rank)."""
    monkeypatch.setattr(batches, "_reads_in_process", lambda loader: in_process)
    threads = threading.active_count()
    assert list(batches.beside_the_step(range(5), lambda b: (b,), CPU)) == [(b,) for b in range(5)]
    assert threading.active_count() == threads
    finished = batches.beside_the_step(range(100), lambda b: (b,), CPU)
    assert next(finished) == (0,)
    time.sleep(0.1)  # the thread fills the queue and waits on it
    started = time.perf_counter()
    finished.close()
    assert threading.active_count() == threads and time.perf_counter() - started < 2.0
    with pytest.raises(KeyboardInterrupt):
        for made in batches.beside_the_step(range(100), lambda b: (b,), CPU):
            if made == (2,):
                raise KeyboardInterrupt
    assert threading.active_count() == threads


def test_the_device_stage_keeps_at_most_two_batches_ahead(monkeypatch):
    """While the consumer holds batch 0, the thread makes batches 1 and 2 and no more (BATCHES_AHEAD)."""
    monkeypatch.setattr(batches, "_reads_in_process", lambda loader: False)
    made = []
    finished = batches.beside_the_step(range(10), lambda b: made.append(b) or (b,), CPU)
    assert next(finished) == (0,)
    deadline = time.monotonic() + 5.0
    while len(made) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # time for a fourth, which must not come
    assert made == [0, 1, 2] and batches.BATCHES_AHEAD == 2
    finished.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("in_process", [True, False])
def test_on_cuda_a_batch_is_made_once_the_step_three_batches_back_has_run(monkeypatch, in_process):
    """However far the consumer's host runs ahead of its GPU (each step a kernel of about 10 ms, queued
    without waiting), the stage makes batch j only once the consumer's work on batch j - 3 has run: it
    holds three batches on the device at most."""
    monkeypatch.setattr(batches, "_reads_in_process", lambda loader: in_process)
    cuda = torch.device("cuda", torch.cuda.current_device())
    steps, early = [], []

    def finish(j: int) -> tuple[torch.Tensor]:
        if j > batches.BATCHES_AHEAD:
            early.append(not steps[j - batches.BATCHES_AHEAD - 1].query())
        return (torch.full((4,), float(j), device=cuda),)

    for (made,) in batches.beside_the_step(range(8), finish, cuda):
        torch.cuda._sleep(20_000_000)
        made.add_(1.0)
        steps.append(torch.cuda.current_stream(cuda).record_event())
    torch.cuda.synchronize()
    assert len(steps) == 8 and len(early) == 5 and not any(early)


def test_starting_a_loaders_epoch_draws_nothing_from_torchs_global_generator():
    """``iter()`` of a DataLoader draws its workers' base seed; from torch's global generator that draw
    would fall where a resumed run's does not (mid-epoch, or a new process's first epoch), shifting every
    later CPU draw of the step (dropout). Each loader draws from a generator of its own."""
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.zeros(8, 3, 4, 4), torch.zeros(8, 2))
    train = build_train_loader(data, 4, 0, 0, 1, 0, torch.device("cpu"), "fast")
    evaluation = build_eval_loader(data, 4, 0, 0, 1, torch.device("cpu"))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for loader in (train, evaluation.loader):
        next(iter(loader))
    assert torch.equal(torch.rand(3), expected)
