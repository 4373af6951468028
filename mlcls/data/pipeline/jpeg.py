"""What the workers read of a JPEG before handing it to the device: the segments before its first scan
(:func:`read_jpeg_header`, on the one walk of :func:`mlcls.data.images.jpeg_markers`) and whether it ends
after its last scan (:func:`ends_after_its_last_scan`), both without decoding and in bounded time."""

from __future__ import annotations

from typing import NamedTuple

from mlcls.data.images import jpeg_markers

# JPEG start-of-frame markers (SOF0-SOF15 less DHT, JPG and DAC); only SOF0, baseline, goes to the device.
FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
BASELINE = 0xC0
# The first scan of a sequential JPEG: spectral selection 0-63, no successive approximation (Ah = Al = 0).
SEQUENTIAL_SCAN = (0, 63, 0)
# Bytes at a file's end searched for its end-of-image marker (one past the last scan); a file with more
# trailing data than this is searched whole.
EOI_TAIL = 4096


class JpegHeader(NamedTuple):
    """What a JPEG's segments before its first scan say: the start-of-frame ``marker`` (0xC0 baseline,
    0xC2 progressive, ...), the sample ``precision`` in bits, the quantisation ``tables`` its components
    use and those ``defined`` (DQT) before the scan, and the first scan's ``progression`` (Ss, Se, Ah/Al)."""

    marker: int
    precision: int
    tables: frozenset[int]
    defined: frozenset[int]
    progression: tuple[int, int, int]


def read_jpeg_header(data: bytes) -> JpegHeader | None:
    """The :class:`JpegHeader` of a JPEG, read by walking its segments to the first scan
    (:func:`~mlcls.data.images.jpeg_markers`, strict: no stray byte); None when there is no frame header
    before it, the walk stops short of it, a segment is cut short, or the file is no JPEG."""
    if data[:2] != b"\xff\xd8":
        return None
    frame, defined = None, set()
    try:
        for marker, position, length in jpeg_markers(data, strict=True):
            if marker == 0xD9:
                return None
            if marker not in FRAME_MARKERS and marker not in (0xDB, 0xDA):
                continue
            segment = data[position + 4 : position + 2 + length]
            if len(segment) != length - 2 or not segment:
                return None
            if marker == 0xDB:  # tables of 64 one-byte or two-byte values, each after its id byte
                k = 0
                while k < len(segment):
                    defined.add(segment[k] & 0x0F)
                    k += 1 + (128 if segment[k] >> 4 else 64)
            elif marker == 0xDA:
                progression = tuple(segment[1 + 2 * segment[0] : 4 + 2 * segment[0]])
                if frame is None or len(progression) != 3:
                    return None
                return JpegHeader(*frame, frozenset(defined), progression)
            elif frame is None and len(segment) >= 6:
                frame = (marker, segment[0], frozenset(segment[6 : 6 + 3 * segment[5]][2::3]))
            else:
                return None
    except OSError:  # a stray byte, or past the walk's bounds: the CPU path's
        return None
    return None


def ends_after_its_last_scan(data: bytes) -> bool:
    """Whether an end-of-image marker follows the file's last start-of-scan (else the file is cut short):
    searched in the last :data:`EOI_TAIL` bytes, the whole file only when the tail holds none."""
    end_marker = data.rfind(b"\xff\xd9", max(0, len(data) - EOI_TAIL))
    if end_marker < 0:
        end_marker = data.rfind(b"\xff\xd9")
    return end_marker >= 0 and data.find(b"\xff\xda", end_marker) < 0
