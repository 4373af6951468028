"""The HTML of the run report and the audit page: one self-contained page each (inline CSS, script and
SVG, thumbnails as ``data:`` URIs), kept off the network by a Content-Security-Policy; text from the run or
the dataset is escaped everywhere.

The thumbnails travel in one JSON block (each image once), which the script sets as the ``src`` of every
``<img data-thumb>``; once all have loaded or failed, it records on ``<body>`` ``data-images-total``,
``data-images-loaded``, ``data-page-height`` and ``data-end-bottom`` (of ``#report-end``) for a browser test.
A click on a header of a :func:`sortable_table` sorts by that column (again: the other way), undefined values
last; ``#sort=<key>[,<key>...]`` in the URL clicks those headers in turn. The search box of
:func:`class_search` lists the classes whose name holds what is typed (``#search=<text>`` in the URL types
it), and records their number as ``data-search-matches``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlcls.data import BadImageError
from mlcls.data.datasets.base import BAD_IMAGE_ERRORS
from mlcls.reporting.run_files import yaml_text

log = logging.getLogger("mlcls")

COLOURS = ("#1f6fb2", "#d1495b", "#2e933c", "#edae49", "#7b4b94")

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2430;background:#f4f6f9}
header{background:#1d2b3a;color:#fff;padding:18px 28px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#c4d0dd}main{padding:8px 28px 24px;max-width:1400px}
h2{font-size:18px;margin:26px 0 8px;border-bottom:1px solid #d5dbe3;padding-bottom:4px}
.figures{display:flex;flex-wrap:wrap;gap:10px;margin-top:16px}
.figure{background:#fff;border:1px solid #d5dbe3;border-radius:6px;padding:8px 14px;min-width:110px}
.figure b{display:block;font-size:22px}.figure span{color:#5a6778;font-size:12px}
.charts{display:flex;flex-wrap:wrap;gap:12px;margin-top:12px}
.chart{background:#fff;border:1px solid #d5dbe3;border-radius:6px}
table{border-collapse:collapse;background:#fff;font-size:13px}th,td{border:1px solid #dfe4ea;padding:3px 8px}
th{background:#e9eef4;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
th[data-key]{cursor:pointer;user-select:none}th[aria-sort=ascending]::after{content:" \\25B2"}
th[aria-sort=descending]::after{content:" \\25BC"}.given1{color:#0a6}.given0{color:#c33}
.note{color:#5a6778;font-size:12.5px;margin:4px 0}
.gallery{display:flex;flex-wrap:wrap;gap:8px}
figure.card{margin:0;width:150px;background:#fff;border:1px solid #d5dbe3;border-radius:6px;overflow:hidden}
figure.card img,.missing{display:block;width:150px;height:112px;object-fit:contain;background:#222}
.missing{color:#eee;font-size:12px;text-align:center;line-height:112px}
figcaption{padding:4px 6px;font-size:11.5px;word-wrap:break-word}figcaption .w{color:#b3261e;font-weight:600}
figcaption .id{color:#5a6778}details{background:#fff;border:1px solid #d5dbe3;border-radius:6px;margin:6px 0}
summary{padding:6px 10px;cursor:pointer;font-weight:600}
.detail{display:flex;flex-wrap:wrap;gap:14px;padding:0 10px 10px}
footer#report-end{background:#1d2b3a;color:#c4d0dd;padding:10px 28px;font-size:12px}
"""

SCRIPT = """
(function () {
  const body = document.body;
  const thumbs = JSON.parse(document.getElementById('thumbs').textContent);
  const images = Array.from(document.querySelectorAll('img[data-thumb]'));
  const loaded = images.map(img => new Promise(done => {
    img.addEventListener('load', done); img.addEventListener('error', done);
    img.src = thumbs[img.dataset.thumb];
  }));
  function cell(row, index) { return row.cells[index].dataset.v; }
  function sortBy(th) {
    const table = th.closest('table'), rows = Array.from(table.tBodies[0].rows);
    const index = Array.from(th.parentNode.children).indexOf(th);
    const down = th.getAttribute('aria-sort') === 'ascending';
    table.querySelectorAll('th').forEach(h => h.removeAttribute('aria-sort'));
    th.setAttribute('aria-sort', down ? 'descending' : 'ascending');
    const sign = down ? -1 : 1;
    rows.sort((a, b) => {
      let x = cell(a, index), y = cell(b, index);
      if (th.dataset.type === 'number') {
        x = parseFloat(x); y = parseFloat(y);
        if (isNaN(x) || isNaN(y)) return isNaN(x) - isNaN(y);
        return sign * (x - y);
      }
      return sign * (x < y ? -1 : x > y ? 1 : 0);
    });
    rows.forEach(row => table.tBodies[0].appendChild(row));
  }
  document.querySelectorAll('th[data-key]').forEach(th => {
    th.addEventListener('click', () => sortBy(th));
  });
  const asked = /^#sort=([\\w,]+)$/.exec(location.hash);
  if (asked) asked[1].split(',').forEach(key => {
    const th = document.querySelector('th[data-key="' + key + '"]');
    if (th) th.click();
  });
  function openTarget() {
    const target = location.hash.length > 1 ? document.getElementById(location.hash.slice(1)) : null;
    if (target && target.tagName === 'DETAILS') target.open = true;
  }
  window.addEventListener('hashchange', openTarget); openTarget();
  const index = document.getElementById('class-index');
  if (index) {
    const classes = JSON.parse(index.textContent), box = document.getElementById('class-search');
    const found = document.getElementById('class-search-results');
    const note = document.getElementById('class-search-note'), shown = parseInt(found.dataset.shown, 10);
    const names = classes.name.map(name => name.toLowerCase());
    function search() {
      const query = box.value.trim().toLowerCase(), rows = found.tBodies[0];
      rows.replaceChildren();
      let matches = 0;
      for (let c = 0; query && c < names.length; c++) {
        if (!names[c].includes(query) || matches++ >= shown) continue;
        const row = rows.insertRow(), name = row.insertCell();
        if (document.getElementById('class-' + c)) {
          const link = name.appendChild(document.createElement('a'));
          link.href = '#class-' + c; link.textContent = classes.name[c];
        } else name.textContent = classes.name[c];
        const ap = classes.ap[c] === null ? '\u2013' : classes.ap[c].toFixed(1);
        [ap, String(classes.positives[c])].forEach(text => {
          const cell = row.insertCell(); cell.className = 'n'; cell.textContent = text;
        });
      }
      found.hidden = matches === 0;
      note.textContent = !query ? '' : matches > shown ? matches + ' classes match; the first ' + shown +
        ' shown' : matches + (matches === 1 ? ' class matches' : ' classes match');
      body.dataset.searchMatches = matches;
    }
    box.addEventListener('input', search);
    const asked = /^#search=(.*)$/.exec(location.hash);
    if (asked) box.value = decodeURIComponent(asked[1]);
    search();
  }
  Promise.all(loaded).then(() => {
    body.dataset.imagesTotal = images.length;
    body.dataset.imagesLoaded = images.filter(img => img.complete && img.naturalWidth > 0).length;
    body.dataset.pageHeight = document.documentElement.scrollHeight;
    const end = document.getElementById('report-end').getBoundingClientRect();
    body.dataset.endBottom = Math.ceil(end.bottom + window.scrollY);
  });
})();
"""


@dataclass(frozen=True)
class Card:
    """A gallery card: the thumbnail ``thumb`` (a key of the page's thumbnails, or None: no image, for the
    reason ``missing``), ``image`` (the file, shown short, in full on hover), the error line ``headline`` and
    text ``lines``."""

    thumb: str | None
    image: str
    headline: str
    lines: tuple[str, ...]
    missing: str = "unreadable image"


def escape(text: object) -> str:
    return html.escape(str(text), quote=True)


class Thumbnails:
    """JPEG thumbnails, at most ``side`` pixels a side, of ``dataset``'s samples as ``data:`` URIs
    (``uris``, by key), each made once. The image is the dataset's ``picture`` (read through
    :func:`mlcls.data.images.read_image`: a regular file within ``CAPS["image"]``, its pixels bounded).
    Once the URIs hold ``max_bytes`` (None: no limit), further samples get none and are ``omitted``: the
    page's size stays bounded however many cards it shows, the first cards keeping their images."""

    def __init__(self, dataset: Any, side: int, max_bytes: int | None = None) -> None:
        self.dataset, self.side, self.max_bytes = dataset, side, max_bytes
        self.uris: dict[str, str] = {}
        self.omitted: set[int] = set()
        self._keys: dict[int, str | None] = {}
        self._bytes = 0

    def key(self, index: int) -> str | None:
        """The key of sample ``index``'s thumbnail; None when its image cannot be read (and a log line) or
        the thumbnails are full (``omitted``)."""
        if index in self._keys:
            return self._keys[index]
        key = None
        if self.max_bytes is not None and self._bytes >= self.max_bytes:
            self.omitted.add(index)
            self._keys[index] = None
            return None
        try:
            image = self.dataset.picture(index)
        except (*BAD_IMAGE_ERRORS, BadImageError) as exc:
            log.warning("no thumbnail of %s (%s)", self.dataset.samples[index].path, exc)
        else:
            image.thumbnail((self.side, self.side))
            buffer = io.BytesIO()
            image.convert("RGB").save(buffer, format="JPEG", quality=85)
            key = f"t{len(self.uris)}"
            self.uris[key] = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
            self._bytes += len(self.uris[key])
        self._keys[index] = key
        return key


def number(value: float | None, digits: int = 1) -> str:
    """``value`` with ``digits`` decimals; a dash for NaN or None."""
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def line_chart(
    series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    title: str,
    x_label: str,
    y_label: str,
    x_range: tuple[float, float],
    y_range: tuple[float, float],
    steps: bool = False,
    marks: Sequence[tuple[float, float]] = (),
    whole_x: bool = False,
    width: int = 440,
    height: int = 270,
) -> str:
    """An SVG line chart of ``series`` (``(name, xs, ys)``, one colour each, with a legend when there are
    several): markers on the points (``steps``: a step line without markers, as a PR curve), a ring on each
    of ``marks``; ``whole_x``: ticks on whole numbers of x only (epochs)."""
    left, right, top, bottom = 52, 12, 30, 42
    (x0, x1), (y0, y1) = x_range, y_range
    if x1 <= x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    if y1 <= y0:
        y0, y1 = y0 - 1.0, y1 + 1.0

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)

    parts = [
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
        f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13" font-weight="600">'
        f"{escape(title)}</text>",
    ]
    for tick in np.linspace(y0, y1, 5):
        parts.append(
            f'<line x1="{left}" x2="{width - right}" y1="{sy(tick):.1f}" y2="{sy(tick):.1f}" '
            'stroke="#e3e7ec"/>'
            f'<text x="{left - 5}" y="{sy(tick) + 4:.1f}" text-anchor="end" font-size="10">{tick:.3g}</text>'
        )
    x_ticks = np.linspace(x0, x1, 5)
    if whole_x:
        x_ticks = sorted({float(round(tick)) for tick in x_ticks if x0 <= round(tick) <= x1})
    for tick in x_ticks:
        parts.append(
            f'<text x="{sx(tick):.1f}" y="{height - bottom + 14}" text-anchor="middle" font-size="10">'
            f"{tick:.3g}</text>"
        )
    parts.append(
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
        'fill="none" stroke="#9aa5b1"/>'
        f'<text x="{(left + width - right) / 2}" y="{height - 8}" text-anchor="middle" font-size="11">'
        f"{escape(x_label)}</text>"
        f'<text transform="translate(13 {(top + height - bottom) / 2}) rotate(-90)" text-anchor="middle" '
        f'font-size="11">{escape(y_label)}</text>'
    )
    for k, (name, xs, ys) in enumerate(series):
        colour = COLOURS[k % len(COLOURS)]
        points = [(sx(x), sy(y)) for x, y in zip(xs, ys, strict=True)]
        if steps:  # a precision-recall curve: precision holds until the next recall
            points = [
                p for a, b in zip(points, points[1:], strict=False) for p in (a, (b[0], a[1]))
            ] + points[-1:]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.8"/>')
        if not steps:
            parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in points]
        if len(series) > 1:
            y = top + 14 + 15 * k
            parts.append(
                f'<line x1="{width - right - 110}" x2="{width - right - 94}" y1="{y - 4}" y2="{y - 4}" '
                f'stroke="{colour}" stroke-width="2"/><text x="{width - right - 90}" y="{y}" font-size="11">'
                f"{escape(name)}</text>"
            )
    for x, y in marks:
        parts.append(
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="none" stroke="#111" stroke-width="1.5"/>'
        )
    parts.append("</svg>")
    return "".join(parts)


def settings_table(settings: Sequence[tuple[str, object, object]]) -> str:
    """The settings that differ from the defaults: key, this run's value, the default."""
    if not settings:
        return '<p class="note">Every setting is the default of <code>mlcls-train</code>.</p>'
    rows = "".join(
        f"<tr><td><code>{escape(k)}</code></td><td>{escape(yaml_text(v))}</td><td>{escape(yaml_text(d))}</td></tr>"
        for k, v, d in settings
    )
    head = "<tr><th>setting</th><th>this run</th><th>default</th></tr>"
    return f"<table><thead>{head}</thead><tbody>{rows}</tbody></table>"


CLASS_COLUMNS = (
    ("name", "class", "text"),
    ("ap", "AP %", "number"),
    ("positives", "val. positives", "number"),
    ("threshold", "threshold", "number"),
    ("precision", "precision %", "number"),
    ("recall", "recall %", "number"),
    ("fp", "false pos.", "number"),
    ("fn", "false neg.", "number"),
)


def sortable_table(
    table_id: str,
    columns: Sequence[tuple[str, str, str]],
    rows: Sequence[Sequence[tuple[str, object, str]]],
    sorted_by: str | None = None,
) -> str:
    """A table the page's script sorts on a click on a header: ``columns`` are ``(key, label, kind)``
    (kind ``number`` or ``text``), each cell of ``rows`` is ``(inner HTML, sort value, css class)``;
    ``sorted_by``: the key of the column ``rows`` come sorted by (ascending)."""
    head = "".join(
        f'<th data-key="{key}" data-type="{kind}"{" aria-sort=ascending" if key == sorted_by else ""}>'
        f"{escape(label)}</th>"
        for key, label, kind in columns
    )
    body = "".join(
        "<tr>"
        + "".join(
            f'<td{f" class={css!r}" if css else ""} data-v="{escape(value)}">{inner}</td>'
            for inner, value, css in row
        )
        + "</tr>"
        for row in rows
    )
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def class_table(
    rows: Sequence[Mapping[str, object]],
    detailed: set[int],
    table_id: str = "classes",
    sorted_by: str | None = "ap",
) -> str:
    """A per-class table (``id=table_id``), in the order of ``rows`` (:func:`class_rows`' dicts), which is
    ascending by the column ``sorted_by`` (None: no column's order); each class of ``detailed`` links to its
    details."""
    cells = []
    for row in rows:
        name = escape(row["name"])
        link = f'<a href="#class-{row["cls"]}">{name}</a>' if row["cls"] in detailed else name
        shown = [(link, row["name"], "")]
        for key, _, _ in CLASS_COLUMNS[1:]:
            value = float(row[key])
            digits = 3 if key == "threshold" else 1
            text = str(int(value)) if key in ("positives", "fp", "fn") else number(value, digits)
            shown.append((text, repr(value), "n"))
        cells.append(shown)
    return sortable_table(table_id, CLASS_COLUMNS, cells, sorted_by)


def class_search(rows: Sequence[Mapping[str, object]], shown: int) -> str:
    """A search box over every class of ``rows`` (a case-insensitive substring of the name): the page's
    script lists the first ``shown`` matches, in class order, with their AP and validation positives, from
    one compact JSON block (``id="class-index"``: the names, AP % to one decimal or null, and positives, in
    class order; about 22 bytes a class), so that the page need not hold a row per class."""
    ordered = sorted(rows, key=lambda row: row["cls"])
    index = {
        "name": [str(row["name"]) for row in ordered],
        "ap": [None if math.isnan(row["ap"]) else round(float(row["ap"]), 1) for row in ordered],
        "positives": [int(row["positives"]) for row in ordered],
    }
    head = "<tr><th>class</th><th>AP %</th><th>val. positives</th></tr>"
    return (
        '<p><input id="class-search" type="search" placeholder="Search all classes" '
        f'aria-label="search all classes"> <span class="note" id="class-search-note"></span></p>'
        f'<table id="class-search-results" data-shown="{shown}" hidden><thead>{head}</thead><tbody></tbody>'
        f"</table>{json_block('class-index', index)}"
    )


def json_block(element_id: str, value: object) -> str:
    """``value`` as compact JSON in a ``<script type="application/json">`` the page's script reads; every
    ``<`` escaped, so that no text in it (a class named ``</script>``) can end the block."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def gallery(cards: Sequence[Card], empty: str) -> str:
    """A row of cards, or the note ``empty`` when there is none."""
    if not cards:
        return f'<p class="note">{escape(empty)}</p>'
    shown = []
    for card in cards:
        short = card.image.rsplit("/", 1)[-1]
        image = (
            f'<img data-thumb="{escape(card.thumb)}" alt="{escape(short)}" title="{escape(card.image)}">'
            if card.thumb is not None
            else f'<div class="missing">{escape(card.missing)}</div>'
        )
        lines = "".join(f"<br>{escape(line)}" for line in card.lines)
        shown.append(
            f'<figure class="card" data-image="{escape(card.image)}">{image}<figcaption>'
            f'<span class="w">{escape(card.headline)}</span>{lines}<br>'
            f'<span class="id" title="{escape(card.image)}">{escape(short)}</span></figcaption></figure>'
        )
    return f'<div class="gallery">{"".join(shown)}</div>'


def page(
    title: str,
    subtitle: str,
    sections: Sequence[tuple[str, str, str]],
    thumbs: Mapping[str, str],
    footer: str,
) -> str:
    """The whole page: a header, ``sections`` (``(id, heading, inner HTML)``; no heading: no ``<h2>``), the
    thumbnails' JSON block, the script and the footer ``#report-end``."""
    body = "".join(
        f'<section id="{escape(sid)}">{f"<h2>{escape(heading)}</h2>" if heading else ""}{inner}</section>'
        for sid, heading, inner in sections
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
        f"<header><h1>{escape(title)}</h1><p>{escape(subtitle)}</p></header><main>{body}</main>"
        f'<footer id="report-end">{escape(footer)}</footer>'
        f"{json_block('thumbs', dict(thumbs))}"
        f"<script>{SCRIPT}</script></body></html>\n"
    )
