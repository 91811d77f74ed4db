"""Tensors and images as they travel: raw tensors (`TensorPayload`, `Trajectory`), decoded
pixels (`PixelPayload`) and the input-image field type that takes what a caller hands over."""

from __future__ import annotations

import base64
import io
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PlainSerializer

from serve_app.schemas.base import B64Bytes, _Wire


class TensorPayload(_Wire):
    """A tensor as raw little-endian bytes, so it travels as JSON (base64) or through Ray."""

    shape: list[int]
    dtype: str
    data: B64Bytes

    @classmethod
    def from_tensor(cls, t: Any) -> TensorPayload:
        arr = t.detach().to("cpu").float().contiguous().numpy()
        return cls(shape=list(arr.shape), dtype=str(arr.dtype), data=arr.tobytes())

    def to_numpy(self):
        import numpy as np

        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)

    def to_torch(self):
        import torch

        return torch.from_numpy(self.to_numpy().copy())


class PixelPayload(_Wire):
    """A decoded image as raw 8-bit pixels: what the ingress hands a replica after it has checked
    and fitted an input image (the replica never decodes a caller's file)."""

    width: int
    height: int
    mode: Literal["RGB", "L"]
    data: B64Bytes

    @classmethod
    def from_pil(cls, im: Any) -> PixelPayload:
        return cls(width=im.width, height=im.height, mode=im.mode, data=im.tobytes())

    def to_pil(self) -> Any:
        from PIL import Image

        return Image.frombytes(self.mode, (self.width, self.height), self.data)


def _image_bytes(v: Any) -> Any:
    """An input image as the bytes of an image file, from what a caller may hand over: bytes,
    base64 text or a `data:` URL, a PIL image, or a `TensorPayload` (channels first or last,
    values in 0..1 or 0..255). The file itself is checked where it is decoded (the ingress)."""
    if isinstance(v, bytes | bytearray):
        return bytes(v)
    if isinstance(v, str):
        text = v.split(",", 1)[1] if v.startswith("data:") and "," in v else v
        try:
            return base64.b64decode(text, validate=True)
        except ValueError:
            raise ValueError("must be base64 or a data: URL of an image file") from None
    if isinstance(v, dict) and {"shape", "dtype", "data"} <= set(v):
        v = TensorPayload.model_validate(v)
    if isinstance(v, TensorPayload):
        import numpy as np
        from PIL import Image

        arr = v.to_numpy()
        if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
            arr = np.moveaxis(arr, 0, -1)
        if arr.ndim not in (2, 3):
            raise ValueError(f"a tensor image must be (H, W), (H, W, C) or (C, H, W), not {tuple(arr.shape)}")
        if arr.dtype != np.uint8:
            scale = 255.0 if float(np.nanmax(arr, initial=0)) <= 1.0 else 1.0
            arr = np.clip(np.nan_to_num(arr) * scale, 0, 255).round().astype(np.uint8)
        v = Image.fromarray(arr.squeeze(-1) if arr.ndim == 3 and arr.shape[-1] == 1 else arr)
    if hasattr(v, "save") and hasattr(v, "size"):  # a PIL image
        buf = io.BytesIO()
        v.save(buf, format="PNG", compress_level=1)
        return buf.getvalue()
    raise ValueError("must be image file bytes, base64 or a data: URL, a PIL image or a TensorPayload")


InputImage = Annotated[
    bytes,
    BeforeValidator(_image_bytes),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str, when_used="json"),
]


class Trajectory(_Wire):
    """Latents after every denoising step, with the timestep of each; a rollout's also the
    latents before the first step (`start`), the steps that were stochastic and each one's
    log-probability per row (`log_probs`, float32, rows x len(stochastic_steps))."""

    timesteps: list[float]
    latents: list[TensorPayload]
    start: TensorPayload | None = None
    stochastic_steps: list[int] | None = None
    log_probs: TensorPayload | None = None
    decoded: list[list[B64Bytes]] | None = Field(
        None, description="`return_trajectory_decoded`: per step, each image decoded from its latents (PNG)."
    )
