"""``audit.html``: the ranking of ``mlcls-data audit`` as one self-contained page (the thumbnails embedded as
JPEG data URIs, no script or style fetched from anywhere), sortable by any column."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlcls.data import BadImageError, MultiLabelDataset
from mlcls.data.datasets.base import BAD_IMAGE_ERRORS

THUMBNAIL = 96  # the thumbnails' longer side, in pixels

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: middle; }
th { cursor: pointer; background: #f4f4f4; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { display: block; }
.given1 { color: #0a6; } .given0 { color: #c33; }
"""

# Click a header to sort by its column (numbers as numbers), again to reverse.
SCRIPT = """
document.querySelectorAll("th").forEach(function (th, column) {
  th.addEventListener("click", function () {
    var body = th.closest("table").tBodies[0];
    var rows = Array.from(body.rows);
    var ascending = th.dataset.order !== "asc";
    rows.sort(function (a, b) {
      var x = a.cells[column].dataset.value, y = b.cells[column].dataset.value;
      var nx = parseFloat(x), ny = parseFloat(y);
      var order = isNaN(nx) || isNaN(ny) ? x.localeCompare(y) : nx - ny;
      return ascending ? order : -order;
    });
    th.dataset.order = ascending ? "asc" : "desc";
    rows.forEach(function (row) { body.appendChild(row); });
  });
});
// Once loaded: the images shown, on the body (data-images-total, data-images-loaded), and #sort=HEADER
// in the address sorts by that column, as a click does.
window.addEventListener("load", function () {
  var images = Array.from(document.images);
  document.body.dataset.imagesTotal = images.length;
  document.body.dataset.imagesLoaded = images.filter(function (i) {
    return i.complete && i.naturalWidth > 0;
  }).length;
  if (location.hash.indexOf("#sort=") === 0) {
    var wanted = decodeURIComponent(location.hash.slice(6));
    document.querySelectorAll("th").forEach(function (th) { if (th.textContent === wanted) th.click(); });
  }
});
"""


def thumbnail(dataset: MultiLabelDataset, row: int) -> str:
    """A ``data:image/jpeg;base64,...`` URI of sample ``row``'s image, its longer side
    :data:`THUMBNAIL` pixels at most; empty when the image cannot be read."""
    try:
        image = dataset.load_image(row)
    except (*BAD_IMAGE_ERRORS, BadImageError):
        return ""
    image.thumbnail((THUMBNAIL, THUMBNAIL))
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _cell(text: Any, value: Any = None, css: str = "") -> str:
    shown = html.escape(str(text))
    sort_value = html.escape(str(text if value is None else value), quote=True)
    return f'<td{f" class={css!r}" if css else ""} data-value="{sort_value}">{shown}</td>'


def audit_page(
    suspects: Sequence[Any],
    dataset: MultiLabelDataset,
    labels: np.ndarray,
    name: str,
    folds: int,
    quality: str,
) -> str:
    """The HTML of the ranking ``suspects`` (:class:`mlcls.reporting.audit.Suspect`) of ``dataset``'s
    training split: rank, thumbnail, image, class, given label, probability, score and the image's given
    positive classes; ``labels`` are the split's (N, C); ``quality`` says how good the folds' models are
    (their out-of-fold mAP)."""
    thumbnails: dict[int, str] = {}
    rows = []
    for s in suspects:
        if s.row not in thumbnails:
            thumbnails[s.row] = thumbnail(dataset, s.row)
        uri = thumbnails[s.row]
        image = f'<img src="{uri}" alt="{html.escape(s.image, quote=True)}">' if uri else "unreadable"
        positives = ", ".join(dataset.classes[c] for c in np.flatnonzero(labels[s.row] == 1))
        rows.append(
            "<tr>"
            + _cell(s.rank, css="num")
            + f'<td data-value="{s.row}">{image}</td>'
            + _cell(s.image)
            + _cell(dataset.classes[s.column])
            + _cell(s.label, css=f"num given{s.label}")
            + _cell(f"{s.probability:.3f}", s.probability, "num")
            + _cell(f"{s.score:.3f}", s.score, "num")
            + _cell(positives)
            + "</tr>"
        )
    headers = ("rank", "image", "file", "class", "given label", "probability", "score", "given positives")
    title = f"Suspected label errors: {name}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<p>{len(suspects)} labels of the training split ({len(labels)} images, {len(dataset.classes)} "
        f"classes), the least likely first: cleanlab's label quality score of each given label under "
        f"out-of-sample probabilities from {folds} folds (each image scored by a model trained on the "
        f"other folds; {html.escape(quality)}). Click a column to sort.</p>"
        "<table><thead><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        + "</tr></thead><tbody>"
        + "".join(rows)
        + f"</tbody></table><script>{SCRIPT}</script></body></html>\n"
    )
