"""Fuzzing checkpoints: seeded mutations of a genuine checkpoint's plain fields (config values,
interpolations, shard URLs, model options, weight shapes, class lists, preprocessing, thresholds) and of the
file itself (a second zip directory, a pickle that builds more than it holds, /proc/self/pagemap), each
read by ``mlcls-eval`` and ``mlcls-predict`` as a user runs them. Each must evaluate and predict, or stop
with one of the errors the commands print as one line, within bounded time and memory, without running a
command (a marker file) or reaching the network (a counting server on 127.0.0.1).

The mutations run in a child process forked from the test's (:func:`hostile.bounded`: it starts with mlcls
imported) whose address space is limited, so that an allocation a crafted field asks for fails there at once
instead of exhausting the machine; a ``MemoryError`` anywhere in an error's chain counts as an escape, not as
a one-line refusal.
"""

from __future__ import annotations

import copy
import json
import math
import random
import signal
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compose_config
from hostile import (
    bounded,
    empty_dicts_pickle,
    nested_list_pickle,
    nested_tuple_key_pickle,
    rezip,
    two_directories,
    with_pickle,
)

SEEDS = 24  # mutated checkpoints per run (each read by eval and by predict); between them they apply every
# kind of mutation (KINDS), which the test checks
MUTATIONS_PER_CHECKPOINT = (1, 3)
SECONDS_PER_READ = 8.0  # a read (eval or predict) of one mutated checkpoint, on a loaded CI machine
ADDRESS_MB = 6144  # the child's address-space limit above what it has mapped when it starts (hostile.bounded)
# The child's peak RSS over the 48 reads above its RSS when it starts (the forked test process's): the bound
# of the child that started as a new interpreter (3,072 MiB, whose imports held about 500 MiB; it peaked at
# 1,295 MiB measured alone, 2,054-2,134 MiB in the whole suite on a loaded 2-core machine: torch.load reads
# from the open file, which copies each record once) less those imports.
PEAK_GROWTH_MIB = 2560
# What each kind of mutation writes first in its description (:func:`mutate`'s "other": a whole field).
KINDS = {
    "dataset": "config.dataset.",
    "shards": "config.dataset=shards",
    "model": "config.model.",
    "classes": "classes=",
    "preprocess": "preprocess",
    "weights": "model[",
    "other": ("config=", "thresholds=", "model="),
    "file": "file ",
}
FILE_MUTATIONS = 0.3  # the share of mutated checkpoints whose file is then rewritten (:func:`rewrite_file`)
# The rewrites, applied in turn (the test checks that each was)
REWRITES = ("two directories", "empty dicts", "nested list", "nested tuple key", "declares 0 bytes")

# The genuine run the mutations start from: a tiny timm network on the synthetic data, one short epoch.
RUN = [
    "dataset=synthetic",
    "dataset.train_size=32",
    "dataset.val_size=12",
    "dataset.image_size=32",
    "model.name=test_resnet",
    "model.pretrained=false",
    "trainer.epochs=1",
    "trainer.batch_size=16",
    "trainer.workers=0",
    "trainer.report=false",
    "trainer.device=cpu",
    "trainer.eval_every=1",
]


def value_pool(marker: Path, server: str) -> list[Any]:
    """Values a crafted file may hold in any field."""
    return [
        f"pipe:touch {marker} #",
        f"pipe:touch {marker} #x.tar",
        "${oc.env:HOME}",
        "${shards_source:image_size,32}",
        "${oc.decode:'{a: 1}'}",
        "\\${oc.env:HOME}",
        f"{server}/x",
        f"{server}/train-{{000000..000003}}.tar",
        "s3://bucket/train-000000.tar",
        "file:///etc/hostname",
        "/dev/zero",
        "../../../../etc/hostname",
        "train-{0..99999999}.tar",
        "",
        "x" * 5000,
        "\x1b]0;title\x07\n| forged | row |",
        0,
        -1,
        1.5,
        2**31,
        2**62,
        float("nan"),
        float("inf"),
        True,
        None,
        [],
        [0.5, 0.5],
        ["a", 1, None],
        {"_target_": "os.system", "command": f"touch {marker}"},
        {"_target_": "builtins.open", "file": str(marker), "mode": "w"},
        {"a": {"b": {"c": [1, {"d": "${oc.env:HOME}"}]}}},
    ]


def stored_shards_config(image_size: Any = 32, **keys: Any) -> dict[str, Any]:
    """A stored ``dataset=shards`` config as a run trained on shards holds it (resolved); ``keys`` set."""
    return {
        "_target_": "mlcls.data.shards.datasets.open_shards",
        "name": "shards",
        "root": None,
        "urls": None,
        "val_urls": None,
        "meta": None,
        "shuffle_buffer": 10,
        "image_size": image_size,
        "transform": "light",
        "train_split": "train",
        "val_split": "val",
        **keys,
    }


def shards_config(marker: Path, server: str, rng: random.Random) -> dict[str, Any]:
    """A stored ``dataset=shards`` config whose sources are hostile."""
    source = rng.choice([f"pipe:touch {marker} #", f"{server}/m", "${oc.env:HOME}", "s3://b/m"])
    key = rng.choice(["meta", "urls", "val_urls", "root"])
    image_size = rng.choice([32, "${shards_source:image_size,32}"])
    return stored_shards_config(image_size, **{key: source})


def mutate(state: dict[str, Any], rng: random.Random, marker: Path, server: str) -> list[str]:
    """Apply 1-3 seeded mutations to ``state`` in place; returns what was done."""
    pool = value_pool(marker, server)
    done = []
    for _ in range(rng.randint(*MUTATIONS_PER_CHECKPOINT)):
        kind = rng.choice(
            ["dataset", "dataset", "shards", "model", "classes", "preprocess", "weights", "other"]
        )
        config = state.get("config") if isinstance(state.get("config"), dict) else None
        if kind == "dataset" and config is not None and isinstance(config.get("dataset"), dict):
            key = rng.choice([*config["dataset"], "_target_", "val_size", "urls", "meta", "canvas_size"])
            value = rng.choice([*pool, "mlcls.data.shards.datasets.open_shards", "os.system"])
            config["dataset"][key] = value
            done.append(f"config.dataset.{key}={value!r:.60}")
        elif kind == "shards" and config is not None:
            config["dataset"] = shards_config(marker, server, rng)
            done.append(f"config.dataset=shards {config['dataset']!r:.120}")
        elif kind == "model" and config is not None and isinstance(config.get("model"), dict):
            key = rng.choice([*config["model"], "head", "decoder_embedding", "num_groups", "csra_heads"])
            value = rng.choice([*pool, "mldecoder", "csra", "hf-hub:timm/resnet18", "local-dir:/tmp", 40000])
            config["model"][key] = value
            done.append(f"config.model.{key}={value!r:.60}")
        elif kind == "classes":
            classes = (
                state["classes"] if isinstance(state.get("classes"), list) and state["classes"] else ["a"]
            )
            value = rng.choice(
                [
                    [],
                    classes[:-1],
                    [*classes, "extra"],
                    [f"c{k}" for k in range(200_000)],
                    list(range(len(classes))),
                    [classes[0]] * len(classes),
                    [*classes[:-1], "price_$5_to_$10\x1b[2J\n"],
                    torch.arange(len(classes)),
                    "a,b,c",
                    None,
                ]
            )
            state["classes"] = value
            done.append(f"classes={value!r:.60}")
        elif kind == "preprocess":
            preprocess = state.get("preprocess")
            if isinstance(preprocess, dict) and preprocess:
                key = rng.choice(list(preprocess))
                value = rng.choice([*pool, 40000, 0, [0.0, 0.0, 0.0]])
                preprocess[key] = value
                done.append(f"preprocess.{key}={value!r:.60}")
            else:
                state["preprocess"] = rng.choice(pool)
                done.append(f"preprocess={state['preprocess']!r:.60}")
        elif kind == "weights" and isinstance(state.get("model"), dict) and state["model"]:
            key = rng.choice(sorted(state["model"]))
            tensor = state["model"][key]
            change = rng.choice(["shape", "nan", "dtype", "scalar", "missing"])
            if change == "shape":
                state["model"][key] = torch.zeros(*[d + 1 for d in tensor.shape] or [2])
            elif change == "nan" and tensor.is_floating_point():
                state["model"][key] = torch.full_like(tensor, math.nan)
            elif change == "dtype":
                state["model"][key] = tensor.to(torch.int64)
            elif change == "scalar":
                state["model"][key] = torch.tensor(1.0)
            else:
                del state["model"][key]
            done.append(f"model[{key}] {change}")
        else:
            key = rng.choice(["config", "thresholds", "model", "classes"])
            value = rng.choice(
                [*pool, [math.nan] * 12, torch.full((12,), math.nan), torch.zeros(3), torch.zeros(12, 2)]
            )
            state[key] = value
            done.append(f"{key}={value!r:.60}")
    return done


def rewrite_file(path: Path, how: str) -> str:
    """Rewrite the checkpoint file ``path`` as the door's hostile file ``how`` (one of :data:`REWRITES`)."""
    data = path.read_bytes()
    if how == "two directories":
        path.write_bytes(two_directories(rezip(data, zipfile.ZIP_DEFLATED)))
    elif how == "declares 0 bytes":
        path.unlink()
        path.symlink_to("/proc/self/pagemap")
    else:
        build = {"empty dicts": (empty_dicts_pickle, 3_000_000), "nested list": (nested_list_pickle, 10_000)}
        pickled, size = build.get(how, (nested_tuple_key_pickle, 10_000))
        path.write_bytes(with_pickle(data, pickled(size)))
    return f"file {how}"


class CountingServer:
    """An HTTP server on 127.0.0.1 that counts its requests (none may arrive)."""

    def __init__(self) -> None:
        import http.server
        import threading

        counter = self
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server name
                counter.requests += 1
                self.send_error(404)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def memory_kib(field: str) -> int:
    """A memory figure of this process (``VmRSS``, ``VmHWM``...), from /proc/self/status, in KiB."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith(field + ":")).split()[1])


def _timeout(signum: int, frame: Any) -> None:
    raise TimeoutError(f"a read took over {SECONDS_PER_READ} s")


def classify(exc: BaseException) -> str | None:
    """None when ``exc`` is a refusal the commands print as one line; else why it is an escape."""
    from hydra.errors import HydraException

    from mlcls.cli.errors import USER_ERRORS, error_line

    chain, seen = exc, set()
    while chain is not None and id(chain) not in seen:
        if isinstance(chain, (MemoryError, RecursionError, TimeoutError)):
            return f"{type(chain).__name__}: {chain}"
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__
    if not isinstance(exc, (HydraException, *USER_ERRORS)):
        return f"traceback {type(exc).__name__}: {str(exc)[:200]}"
    if "\n" in error_line(exc):
        return f"more than one line: {error_line(exc)[:200]!r}"
    return None


def fuzz(checkpoint: Path, images: Path, work: Path, seeds: range) -> dict[str, Any]:
    """Read ``len(seeds)`` mutations of ``checkpoint`` with eval and predict; a report of what happened."""
    from hydra import compose, initialize_config_dir

    from mlcls import config_dir
    from mlcls.cli.eval import checkpoint_metrics
    from mlcls.cli.predict import run as predict_run

    server = CountingServer()
    marker = work / "marker"
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory (VmHWM) := the RSS now
    start_rss = memory_kib("VmRSS")
    signal.signal(signal.SIGALRM, _timeout)
    genuine = torch.load(checkpoint, weights_only=True)
    path = work / "mutated.pt"
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        commands = [
            (checkpoint_metrics, compose("eval", [f"checkpoint={path}", "device=cpu", "workers=0"])),
            (
                predict_run,
                compose(
                    "predict",
                    [f"checkpoint={path}", f"images={images}", "device=cpu", "workers=0", "top_k=2"],
                ),
            ),
        ]
    report: dict[str, Any] = {
        "escapes": [],
        "outcomes": {"ok": 0, "refused": 0},
        "slowest": 0.0,
        "kinds": [],
        "rewrites": [],
    }
    for seed in seeds:
        rng = random.Random(seed)
        state = copy.deepcopy(genuine)
        done = mutate(state, rng, marker, server.url)
        path.unlink(missing_ok=True)  # the last one may be a link to /proc/self/pagemap
        torch.save(state, path)
        if rng.random() < FILE_MUTATIONS:
            done.append(rewrite_file(path, REWRITES[len(report["rewrites"]) % len(REWRITES)]))
            report["rewrites"].append(done[-1].removeprefix("file "))
        kinds = {kind for kind, start in KINDS.items() for what in done if what.startswith(start)}
        report["kinds"] = sorted({*report["kinds"], *kinds})
        for read, cfg in commands:
            command = read.__module__.rsplit(".", 1)[-1]
            start = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, SECONDS_PER_READ)
            try:
                read(copy.deepcopy(cfg))
                outcome = "ok"
            except BaseException as exc:  # noqa: BLE001 - every escape is what the fuzzer reports
                escape = classify(exc)
                outcome = "refused" if escape is None else "escape"
                if escape is not None:
                    report["escapes"].append(
                        {"seed": seed, "command": command, "mutations": done, "error": escape}
                    )
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            report["outcomes"][outcome] = report["outcomes"].get(outcome, 0) + 1
            report["slowest"] = max(report["slowest"], time.perf_counter() - start)
    report["marker"] = marker.exists()
    report["requests"] = server.requests
    report["peak_growth_mib"] = (memory_kib("VmHWM") - start_rss) / 1024
    return report


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> tuple[Path, Path]:
    """A genuine checkpoint (a one-epoch run) and a folder of two images to predict."""
    from mlcls.cli.train import run as train_run
    from mlcls.data.datasets.synthetic import SyntheticMultiLabel

    root = tmp_path_factory.mktemp("fuzz")
    train_run(compose_config([*RUN]), run_dir=root / "run")
    images = root / "images"
    images.mkdir()
    dataset = SyntheticMultiLabel("val", val_size=2)
    for k in range(2):
        dataset.load_image(k).save(images / f"{k}.png")
    return root / "run" / "checkpoints" / "best.pt", images


@pytest.mark.slow
def test_mutated_checkpoints_load_or_fail_in_one_line(genuine, tmp_path):
    checkpoint, images = genuine
    started = time.perf_counter()
    outcome = bounded(fuzz, checkpoint, images, tmp_path, range(SEEDS), memory_mb=ADDRESS_MB, seconds=240)
    assert outcome.error is None, outcome.trace[-3000:] or outcome.message
    report = outcome.value
    print(
        f"{SEEDS} mutated checkpoints in {time.perf_counter() - started:.1f} s: {report['outcomes']}, "
        f"slowest read {report['slowest']:.2f} s, peak RSS +{report['peak_growth_mib']:.0f} MiB"
    )
    assert report["escapes"] == [], json.dumps(report["escapes"][:5], indent=1)
    assert not report["marker"] and report["requests"] == 0
    assert report["outcomes"]["ok"] > 0 and report["outcomes"]["refused"] > 0  # both kinds were reached
    assert report["kinds"] == sorted(KINDS)  # every kind of mutation was applied
    assert set(report["rewrites"]) == set(REWRITES)  # and every rewrite of the file
    assert report["slowest"] < SECONDS_PER_READ and report["peak_growth_mib"] < PEAK_GROWTH_MIB
