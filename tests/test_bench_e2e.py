"""``mlcls-bench e2e`` on the CPU with tiny settings: the fields of its JSON line, each rate measured on its
own (a loader made slower is timed slower, and only it), the shares computed from those rates; and the
reproduction cost that follows from the measured step rates."""

from __future__ import annotations

import json
import time

import pytest
from conftest import TINY

from mlcls.bench import e2e_bench
from mlcls.bench.pipeline_bench import make_jpegs
from mlcls.cli.bench import main
from mlcls.reporting.sweeps import run_gpu_hours

# torchvision 0.29 deprecates its codecs; mlcls.data.pipeline.gpu ignores the warning, pytest shows it.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")
BACKENDS = ["fast", "gpu", "torchvision", "shards"]
DELAY_S = 0.3  # added before every batch of the torchvision loader


class Delayed:
    """A training loader whose every batch comes ``DELAY_S`` late."""

    def __init__(self, loader) -> None:
        self.loader, self.sampler = loader, loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            time.sleep(DELAY_S)
            yield batch


@pytest.mark.slow
def test_e2e_times_each_backend_and_the_device_resident_loop_on_its_own(tmp_path, capsys, monkeypatch):
    make_jpegs(tmp_path / "jpegs", 6, size=(96, 72))
    real_loader = e2e_bench._loader

    def loader(backend, *args):
        made = real_loader(backend, *args)
        return Delayed(made) if backend == "torchvision" else made

    monkeypatch.setattr(e2e_bench, "_loader", loader)
    monkeypatch.chdir(tmp_path)
    overrides = [o for o in TINY if not o.startswith("trainer.batch_size")]
    main(["e2e", *overrides, "trainer.batch_size=4", "--backends", ",".join(BACKENDS),
          "--images", str(tmp_path / "jpegs"), "--steps", "2", "--warmup", "1"])  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert result["backends"] == BACKENDS and result["images"] == 2 * 4 and result["steps"] == 2
    assert (result["jpegs"]["files"], result["device"], result["gpu_input_peak_mib"]) == (6, "cpu", None)
    seconds = result["seconds"]
    assert sorted(seconds) == sorted([*BACKENDS, "gpu_only"]) and min(seconds.values()) > 0
    runs = result["gpu_only_runs_images_per_s"]
    assert len(runs) == 2 and seconds["gpu_only"] == pytest.approx(sum(8 / rate for rate in runs) / 2)
    gpu_only = result["gpu_only_images_per_s"]
    assert gpu_only == pytest.approx(8 / seconds["gpu_only"])
    for name in BACKENDS:
        assert result[f"{name}_images_per_s"] == pytest.approx(8 / seconds[name])
        assert result[f"{name}_share"] == pytest.approx(result[f"{name}_images_per_s"] / gpu_only)
    # the late loader's wait is in its time (2 timed batches), and in no other contender's
    assert seconds["torchvision"] >= 2 * DELAY_S
    assert seconds["torchvision"] > max(seconds[name] for name in ("fast", "gpu", "gpu_only")) + DELAY_S


def test_e2e_refuses_an_unknown_backend_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["e2e", *TINY, "--backends", "fast,opencv"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--backends fast,opencv; expected a comma-separated list" in err


def test_the_preset_cost_is_tresnet_l_over_resnet50_as_measured_on_an_h200(capsys):
    """ML-Decoder's TResNet-L at 448 px, batch 56: 556 images/s; ResNet-50 at 224 px, batch 256: 4,596
    images/s, both bf16 on one H200 (issue 37): a preset run costs 4,596 / 556 = 8.3 ResNet-50 runs (it
    was 9.6, from V100 figures), and mlcls-reproduce says on which GPU the rates were measured."""
    from mlcls.cli.reproduce import main as reproduce_main
    from mlcls.cli.reproduce import preset_gpu_hours

    resnet50 = run_gpu_hours("coco", "resnet50", "v100", epochs=40)
    assert preset_gpu_hours("v100") / resnet50 == pytest.approx(4596 / 556)
    assert reproduce_main(["presets", "--dry-run"]) == 0
    first = capsys.readouterr().out.splitlines()[1]  # after the cost basis
    assert first.startswith("# mldecoder_coco:") and "at 8.3x ResNet-50's cost" in first and "H200" in first
