"""The sparkline of :class:`~cudalab.widgets.MemoryDashboard`: allocated, reserved and
NVML-used bytes over the sample window, drawn with numpy into a palette PNG (about 1 KB,
re-sent only when its pixels change), so the sampler thread needs no plotting library."""

from __future__ import annotations

import struct
import zlib

import numpy as np

#: The names :mod:`cudalab.widgets.dashboard` draws its sparklines with.
__all__ = ["draw_chart", "nice_max", "palette_png"]

# Chart colours (palette PNG indices).
_PALETTE = (
    (255, 255, 255),  # 0 background
    (232, 232, 232),  # 1 grid
    (253, 208, 162),  # 2 reserved area
    (198, 219, 239),  # 3 allocated area
    (140, 140, 140),  # 4 NVML used line
    (230, 85, 13),    # 5 reserved line
    (31, 119, 180),   # 6 allocated line
    (214, 39, 40),    # 7 capacity line
)

def palette_png(indices: np.ndarray, palette: tuple = _PALETTE) -> bytes:
    """A palette PNG (colour type 3, 8 bits) of ``indices`` (H x W uint8)."""
    h, w = indices.shape
    raw = np.zeros((h, w + 1), np.uint8)  # filter byte 0 per row
    raw[:, 1:] = indices

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    plte = bytes(c for rgb in palette for c in rgb)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 3, 0, 0, 0))
            + chunk(b"PLTE", plte) + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
            + chunk(b"IEND", b""))


def nice_max(v: float) -> float:
    """The smallest of 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x 1024^k (or 2^k below 1 KiB)
    that is >= v: a y-axis top that changes rarely."""
    v = max(float(v), 1024.0)
    unit = 1024.0 ** int(np.floor(np.log(v) / np.log(1024)))
    for m in (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12.5, 15, 20, 25, 30, 40, 50, 60, 80,
              100, 125, 150, 200, 250, 300, 400, 500, 600, 800, 1000, 1024):
        if m * unit >= v:
            return m * unit
    return 1024 * unit  # pragma: no cover


def _columns(values: np.ndarray, window: int, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(low, high) value per pixel column for the samples (oldest first), newest at the right
    edge (the series scrolls left), and the first column covered."""
    n = values.size
    step = (width - 1) / max(window - 1, 1)
    pos = (np.arange(n, dtype=np.float64) + (window - n)) * step
    c0 = int(pos[0])
    ncol = width - c0
    rel = pos - c0
    if n >= ncol:
        col = np.minimum(rel.astype(np.int64), ncol - 1)
        lo = np.full(ncol, np.inf)
        hi = np.full(ncol, -np.inf)
        np.minimum.at(lo, col, values)
        np.maximum.at(hi, col, values)
        last = np.zeros(ncol, np.int64)
        np.maximum.at(last, col, np.arange(n))
        prev = np.empty(ncol)
        prev[0] = values[0]
        prev[1:] = values[last[:-1]]
    else:
        cols = np.arange(ncol, dtype=np.float64)
        lo = hi = np.interp(cols, rel, values)
        prev = np.empty(ncol)
        prev[0] = lo[0]
        prev[1:] = lo[:-1]
    return np.minimum(lo, prev), np.maximum(hi, prev), c0


def draw_chart(series: dict[str, np.ndarray], window: int, ymax: float, capacity: int | None,
           width: int = 300, height: int = 64) -> np.ndarray:
    """The palette-index image of the time series (areas for allocated/reserved, lines for
    all three, a dotted red line at the capacity when it is on the scale)."""
    img = np.zeros((height, width), np.uint8)
    img[[height // 4, height // 2, 3 * height // 4], ::3] = 1
    rows = np.arange(height)[:, None]
    scale = (height - 1) / ymax if ymax > 0 else 0.0

    def y(v: np.ndarray) -> np.ndarray:
        return np.clip(height - 1 - np.round(v * scale), 0, height - 1).astype(np.int64)

    spans = {}
    for key in ("nvml_used", "reserved", "allocated"):
        v = series.get(key)
        if v is None or v.size == 0:
            continue
        lo, hi, c0 = _columns(v.astype(np.float64), window, width)
        spans[key] = (y(hi), y(lo), c0)
    for key, color in (("reserved", 2), ("allocated", 3)):  # areas under the lines
        if key in spans:
            top, _, c0 = spans[key]
            sub = img[:, c0:]
            sub[rows >= top[None, :]] = color
    if capacity and capacity <= ymax:
        img[int(y(np.array([capacity]))[0]), ::2] = 7
    for key, color in (("nvml_used", 4), ("reserved", 5), ("allocated", 6)):
        if key in spans:
            top, bottom, c0 = spans[key]
            sub = img[:, c0:]
            sub[(rows >= top[None, :]) & (rows <= bottom[None, :])] = color
    return img

