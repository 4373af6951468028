"""Every default a "| key | default |" table in the docs states, and each head's default in docs/models.md,
read against the configs mlcls ships: a changed default fails here until its docs say the new one."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import yaml
from conftest import compose_config
from omegaconf import OmegaConf

DOCS = Path(__file__).resolve().parents[1] / "docs"

# The config each table describes, by the heading it stands under: (config name, overrides, key prefix).
# A loss table's columns name their losses (``default (`multisim`)``); one "default" column is every loss
# its heading names.
TABLES = {
    "Observed labels": ("train", [], ""),
    "Held-out share": ("train", [], ""),
    "Your own data (CSV)": ("train", ["dataset=csv"], "dataset."),
    "Caption folders (taggers)": ("train", ["dataset=captions"], "dataset."),
    "Predict: `mlcls-predict`": ("predict", [], ""),
    "Evaluate: `mlcls-eval`": ("eval", [], ""),
    "Export: `mlcls-export`": ("export", [], ""),
}
LOSS_HEADING = re.compile(r"^#+ ([a-z_]+(?:, [a-z_]+)*) —")


def tables(path: Path):
    """(heading, header cells, rows of cells) of each table whose first header cell is ``key``."""
    heading, table = "", None
    for line in path.read_text().splitlines() + [""]:
        if line.startswith("#"):
            heading = line
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells and cells[0] == "key" and table is None:
            table = (heading, cells, [])
        elif cells and table is not None:
            if not set(cells[0]) <= set("-: "):
                table[2].append(cells)
        elif table is not None:
            yield table
            table = None


def documented(cell: str):
    """The value a docs cell states (its first code span, or its first word): `null`, numbers, booleans,
    strings; ``required`` is a missing value. What follows, in words, is the docs' comment."""
    cell = cell.strip()
    text = cell[1:].split("`", 1)[0] if cell.startswith("`") else (cell.split() or [""])[0]
    if text == "required":
        return "???"
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    if re.fullmatch(r"-?\d+(\.\d*)?[eE][-+]?\d+", text):  # 1e9, 1e-4: numbers, though YAML 1.1 reads strings
        return float(text)
    return yaml.safe_load(text) if text != "" else ""


def split_keys(cell: str) -> tuple[list[str], str]:
    """The keys a row's first cell names, and what its parenthesis says they apply to (``(`an_ls`)``,
    ``(spherical only)``), "" for every config of the table."""
    keys, _, scope = cell.partition("(")
    return [k.strip().strip("`") for k in keys.split(",")], scope


def applies(scope: str, overrides: list[str]) -> bool:
    """Whether a row scoped by ``scope`` is about the config composed with ``overrides``."""
    names = re.findall(r"`([a-z_]+)`", scope) or re.findall(r"[a-z_]+", scope.split(" only")[0])
    return not scope or any(name in override for name in names for override in overrides)


@functools.cache
def composed(config: str, overrides: tuple[str, ...]):
    return compose_config(list(overrides), config_name=config)


def shipped(config: str, overrides: list[str], key: str):
    """The value of ``key`` in the composed config, ``???`` where it is a required (missing) value."""
    cfg = composed(config, tuple(overrides))
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    assert node is not None and leaf in list(node), f"{key} is not in the {config} config"  # "???" too
    return "???" if OmegaConf.is_missing(node, leaf) else OmegaConf.to_container(node, resolve=True)[leaf]


def documented_defaults():
    """(doc, heading, config, overrides, key, value) of every documented default."""
    for path in sorted(DOCS.glob("*.md")):
        for heading, header, rows in tables(path):
            title = heading.lstrip("# ").strip()
            loss = LOSS_HEADING.match(heading)
            if loss:
                names = loss.group(1).split(", ")
                columns = []
                for index, label in enumerate(header[1:], start=1):
                    named = re.findall(r"`([a-z_]+)`", label)
                    if label.startswith("default") or named:
                        for name in named or names:
                            columns.append((index, "train", [f"loss={name}"], "loss."))
            elif title in TABLES and "default" in header:
                config, overrides, prefix = TABLES[title]
                columns = [(header.index("default"), config, overrides, prefix)]
            else:
                continue
            for cells in rows:
                keys, scope = split_keys(cells[0])
                if any("<" in key for key in keys):  # a pattern (`dataset.<key>`), not a key
                    continue
                for index, config, overrides, prefix in columns:
                    if cells[index] in ("—", "-") or not applies(scope, overrides):
                        continue
                    values = cells[index].split(", ") if len(keys) > 1 else [cells[index]]
                    for key, value in zip(keys, values, strict=True):
                        key = key if key.startswith(prefix) else prefix + key
                        yield path.name, title, config, overrides, key, documented(value)


DEFAULTS = list(documented_defaults())


def test_the_docs_state_defaults_in_every_table_this_test_reads():
    assert {title for _, title, *_ in DEFAULTS} >= set(TABLES) - {"Export: `mlcls-export`"}
    assert len(DEFAULTS) > 60


@pytest.mark.parametrize(
    ("doc", "title", "config", "overrides", "key", "value"),
    DEFAULTS,
    ids=[f"{d[0]}:{d[4]}:{' '.join(d[3])}" for d in DEFAULTS],
)
def test_a_documented_default_is_the_configs(doc, title, config, overrides, key, value):
    assert shipped(config, overrides, key) == value, f"{doc}, {title}: {key}"


HEAD_ROW = re.compile(r"^\| `(\w+)`(?: \(default\))? \| .* \| (.*) \|$")


def test_each_heads_documented_options_are_its_configs():
    rows = [HEAD_ROW.match(line) for line in (DOCS / "models.md").read_text().splitlines()[:14]]
    heads = {m.group(1): m.group(2) for m in rows if m}
    assert {"linear", "mldecoder", "csra"} <= set(heads)
    for head, options in heads.items():
        cfg = compose_config([f"model/head={head}"]).model.head
        for key, value in re.findall(r"`(\w+)` \(([^)]*)\)", options):
            stated = value.rsplit("default ", 1)[-1]
            assert documented(stated) == cfg[key], (head, key)
