"""Turning what a pipeline made into bytes: images (PNG, JPEG, WebP) and videos (MP4, WebP, GIF).

Encoding is on the serving path (a lone request waits for it after its pipeline call), so the
common cases are written for speed.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

import numpy as np

from serve_app.media_types import IMAGE_FORMATS, VIDEO_FORMATS

_PNG_COLOR_TYPES = {"L": 0, "RGB": 2, "RGBA": 6}  # 8 bits per channel


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def _png(im: Any) -> bytes:
    """PNG with every row "Up"-filtered (one numpy subtraction) and deflate level 1.

    PIL picks a filter per row by trying them all, which is most of its cost; one filter for
    the whole image halves the time at the same size (512x512, measured on 2 cores: a smooth
    image 5 vs 10 ms, 87 vs 85 KiB; noise, what random weights make, 19 vs 38 ms).
    """
    color = _PNG_COLOR_TYPES.get(im.mode)
    if color is None:  # palettes, 16-bit, ...: PIL's encoder
        buf = io.BytesIO()
        im.save(buf, format="PNG", compress_level=1)
        return buf.getvalue()
    rows = np.asarray(im, dtype=np.uint8).reshape(im.height, -1)
    filtered = np.empty((rows.shape[0], rows.shape[1] + 1), np.uint8)
    filtered[:, 0] = 2  # filter type Up: each byte minus the byte above it, modulo 256
    filtered[0, 1:] = rows[0]
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])
    header = struct.pack(">IIBBBBB", im.width, im.height, 8, color, 0, 0, 0)
    return b"".join(
        (
            b"\x89PNG\r\n\x1a\n",
            _png_chunk(b"IHDR", header),
            _png_chunk(b"IDAT", zlib.compress(filtered.tobytes(), 1)),
            _png_chunk(b"IEND", b""),
        )
    )


_QUALITY = 90  # JPEG and WebP, unless the request gives `output_compression`


def encode_image(im: Any, fmt: str, quality: int | None = None) -> bytes:
    """A PIL image to bytes; `quality` (0-100) for the lossy formats."""
    if fmt == "png":
        return _png(im)
    buf = io.BytesIO()
    q = _QUALITY if quality is None else quality
    if fmt == "jpeg":
        im.convert("RGB").save(buf, format="JPEG", quality=q)
    elif fmt == "webp":
        im.save(buf, format="WEBP", quality=q)
    else:
        raise ValueError(f"output_format must be one of {', '.join(IMAGE_FORMATS)} for an image, not {fmt!r}")
    return buf.getvalue()


def _mp4(frames: list[Any], fps: int) -> bytes:
    """H.264 in MP4 (yuv420p, what every browser and player takes), through PyAV's FFmpeg."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "20", "preset": "veryfast"}
        for im in frames:
            for packet in stream.encode(av.VideoFrame.from_image(im.convert("RGB"))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def encode_video(frames: list[Any], fmt: str, fps: int, quality: int | None = None) -> bytes:
    """PIL frames to a video file: MP4 (H.264), or animated WebP or GIF through Pillow."""
    if fmt == "mp4":
        return _mp4(frames, fps)
    if fmt not in ("webp", "gif"):
        raise ValueError(f"output_format must be one of {', '.join(VIDEO_FORMATS)} for a video, not {fmt!r}")
    buf = io.BytesIO()
    first, *rest = frames
    kw = {"quality": _QUALITY if quality is None else quality} if fmt == "webp" else {}
    first.save(
        buf, format=fmt.upper(), save_all=True, append_images=rest, duration=round(1000 / fps), loop=0, **kw
    )
    return buf.getvalue()


def encode_output(item: Any, fmt: str, fps: int | None = None, quality: int | None = None) -> bytes:
    """One row's result as bytes: a PIL image, or a video as a list of PIL frames. `quality`:
    JPEG and WebP (still or animated), 0-100."""
    if isinstance(item, list):
        return encode_video(item, fmt, fps or 16, quality)
    return encode_image(item, fmt, quality)
