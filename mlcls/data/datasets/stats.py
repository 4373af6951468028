"""An image readability check of a dataset (label statistics:
:func:`mlcls.data.datasets.labels.label_counts`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from mlcls.data.datasets.base import BAD_IMAGE_ERRORS, MultiLabelDataset


def find_unreadable(dataset: MultiLabelDataset, workers: int = 4) -> tuple[int, list[tuple[str, str]]]:
    """Decode every distinct image of ``dataset`` once; return ``(images checked, [(path, error), ...])``.

    Samples sharing a file (several crops of one image) are checked once, through their first sample.
    """
    first_index: dict[str, int] = {}
    for index, sample in enumerate(dataset.samples):
        first_index.setdefault(sample.path, index)

    def error_of(index: int) -> str | None:
        try:
            dataset.load_image(index)
        except BAD_IMAGE_ERRORS as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        errors = list(pool.map(error_of, first_index.values()))
    bad = [(path, error) for path, error in zip(first_index, errors, strict=True) if error is not None]
    return len(first_index), bad
