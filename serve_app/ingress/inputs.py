"""Images a request brings, decoded and checked at the ingress (in a worker thread), so that a
replica only ever gets pixels of the size it will use.

Every way an input image can be bad is a 400 that names the field: not an image, a damaged or
truncated file, more pixels than `limits.max_input_pixels` (checked from the header, before any
pixel is decoded: a decompression bomb never expands), a mode with no RGB meaning, or a mask
whose size is not the image's.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from serve_app.config import Limits
from serve_app.errors import InvalidRequest

# Formats a caller may send; PIL can open more (EPS, PSD, ...), some through outside programs.
_FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"}
_MODES = {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBa", "CMYK", "YCbCr", "I;16", "I", "La"}


def open_image(data: bytes, field: str, limits: Limits) -> Image.Image:
    """The image in `data`, fully decoded, or InvalidRequest naming `field`."""
    if not data:
        raise InvalidRequest(f"{field}: the file is empty", param=field)
    try:
        im = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:  # PIL's own bound, far above ours: the header said so
        limit = limits.max_input_pixels
        raise InvalidRequest(f"{field}: more pixels than the limit of {limit}", param=field) from None
    except UnidentifiedImageError:
        raise InvalidRequest(
            f"{field}: not an image file this server reads ({', '.join(sorted(_FORMATS))})", param=field
        ) from None
    except Exception as e:
        why = type(e).__name__
        raise InvalidRequest(f"{field}: the file cannot be read as an image ({why})", param=field) from None
    if im.format not in _FORMATS:
        raise InvalidRequest(f"{field}: {im.format} files are not taken; send PNG, JPEG or WebP", param=field)
    w, h = im.size
    if w < 8 or h < 8:
        raise InvalidRequest(f"{field}: {w}x{h} is too small (8x8 at least)", param=field)
    if w * h > limits.max_input_pixels:
        raise InvalidRequest(
            f"{field}: {w}x{h} is {w * h} pixels, above the limit of {limits.max_input_pixels}", param=field
        )
    if im.mode not in _MODES:
        raise InvalidRequest(f"{field}: pixel mode {im.mode} is not supported", param=field)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im.load()
    except Exception as e:  # truncated or corrupt data: OSError, SyntaxError, ValueError, ...
        why = type(e).__name__
        raise InvalidRequest(f"{field}: the image is damaged or truncated ({why})", param=field) from None
    return ImageOps.exif_transpose(im)  # as a viewer shows it


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB; transparent pixels become white (what a viewer shows on a white page)."""
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def to_mask(im: Image.Image) -> Image.Image:
    """An "L" mask, white where to paint. A mask with alpha is read the OpenAI way (transparent
    pixels are painted); one without, the diffusers way (white pixels are)."""
    if "A" in im.getbands() or (im.mode == "P" and "transparency" in im.info):
        alpha = im.convert("RGBA").getchannel("A")
        return alpha.point(lambda a: 255 if a < 128 else 0)
    return im.convert("L").point(lambda v: 255 if v >= 128 else 0)


def output_size(im: Image.Image, limits: Limits) -> tuple[int, int]:
    """(width, height) for an edit that names no size: the input's, scaled down to fit the
    limits if it must, in multiples of 8."""
    w, h = im.size
    scale = min(1.0, limits.max_side / max(w, h), (limits.max_pixels / (w * h)) ** 0.5)
    return max(8, int(w * scale) // 8 * 8), max(8, int(h * scale) // 8 * 8)


def open_references(images: list[bytes], limits: Limits) -> list[Any]:
    """An edit's reference images after the first, decoded and checked, as RGB at their own
    sizes scaled down to the limits (`max_side`, `max_pixels`) where larger: the pipeline fits
    them itself."""
    out = []
    for data in images:
        im = to_rgb(open_image(data, "image", limits))
        w, h = output_size(im, limits)
        out.append(im if w >= im.width and h >= im.height else im.resize((w, h), Image.Resampling.LANCZOS))
    return out


def prepare_inputs(
    image: bytes, mask: bytes | None, width: int | None, height: int | None, limits: Limits
) -> tuple[Any, Any, int, int]:
    """Decode, check and fit an edit's inputs (in a worker thread): (RGB image, L mask or None,
    width, height), the image and mask resized to width x height."""
    im = open_image(image, "image", limits)
    m = open_image(mask, "mask", limits) if mask is not None else None
    if m is not None and m.size != im.size:
        raise InvalidRequest(
            f"mask: {m.width}x{m.height} differs from the image's {im.width}x{im.height}", param="mask"
        )
    if width is None or height is None:
        w, h = output_size(im, limits)
        width, height = width or w, height or h
    rgb = to_rgb(im)
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), Image.Resampling.LANCZOS)
    if m is not None:
        m = to_mask(m)
        if m.size != (width, height):
            m = m.resize((width, height), Image.Resampling.NEAREST)
    return rgb, m, width, height
