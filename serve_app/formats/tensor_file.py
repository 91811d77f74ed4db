"""A result's tensors as one file for HTTP callers: safetensors (or NumPy's `.npz`), so a trainer
reads latents, trajectories and log-probs without base64 JSON.

The file holds, by name: `latents`; `trajectory.latents` (the steps stacked: steps x rows x ...),
`trajectory.start`, `trajectory.timesteps`, `trajectory.stochastic_steps`, `trajectory.log_probs`;
`images.<i>` (each encoded image or video file as uint8 bytes) and `trajectory.decoded.<step>.<i>`
(PNG bytes). The rest of the result (request id, model, seeds, prompt indices, metrics, versions)
is JSON in the metadata entry `response` (safetensors) or the 0-d string array `response` (npz)."""

from __future__ import annotations

import io
import json

import numpy as np

from serve_app.schemas import GenerationResult

SAFETENSORS = "application/vnd.safetensors"
NPZ = "application/x-npz"
MEDIA_TYPES = (SAFETENSORS, NPZ)
_SUFFIX = {SAFETENSORS: "safetensors", NPZ: "npz"}


def wanted(accept: str | None) -> str | None:
    """The tensor file format an `Accept` header asks for, or None (the JSON answer)."""
    asked = set()
    for part in (accept or "").split(","):
        media, *params = (p.strip().lower() for p in part.split(";"))
        if not any(p.replace(" ", "") in ("q=0", "q=0.0", "q=0.00", "q=0.000") for p in params):
            asked.add(media)  # `q=0` says "not this one"
    return next((m for m in MEDIA_TYPES if m in asked), None)


def suffix(media_type: str) -> str:
    return _SUFFIX[media_type]


def has_tensors(result: GenerationResult) -> bool:
    return result.latents is not None or result.trajectory is not None


def arrays(result: GenerationResult) -> dict[str, np.ndarray]:
    """Every tensor and file of a result, by its name in the file."""
    out: dict[str, np.ndarray] = {}
    if result.latents is not None:
        out["latents"] = result.latents.to_numpy()
    if (t := result.trajectory) is not None:
        out["trajectory.timesteps"] = np.asarray(t.timesteps, dtype=np.float32)
        if t.latents:
            out["trajectory.latents"] = np.stack([step.to_numpy() for step in t.latents])
        for name, payload in (("start", t.start), ("log_probs", t.log_probs)):
            if payload is not None:
                out[f"trajectory.{name}"] = payload.to_numpy()
        if t.stochastic_steps is not None:
            out["trajectory.stochastic_steps"] = np.asarray(t.stochastic_steps, dtype=np.int64)
        for s, step in enumerate(t.decoded or []):
            for i, png in enumerate(step):
                out[f"trajectory.decoded.{s}.{i}"] = np.frombuffer(png, dtype=np.uint8)
    for i, data in enumerate(result.images):
        out[f"images.{i}"] = np.frombuffer(data, dtype=np.uint8)
    return out


def encode(result: GenerationResult, media_type: str) -> bytes:
    """The result as a file of `media_type`."""
    tensors = arrays(result)
    rest = result.model_dump(mode="json", exclude={"images", "latents", "trajectory"}, exclude_none=True)
    response = json.dumps(rest, separators=(",", ":"))
    if media_type == SAFETENSORS:
        from safetensors.numpy import save

        return save(tensors, metadata={"response": response})
    buf = io.BytesIO()
    np.savez(buf, response=np.asarray(response), **tensors)
    return buf.getvalue()


def convert(data: bytes, media_type: str) -> bytes:
    """A stored safetensors file in the format asked for (itself, or as `.npz`)."""
    if media_type == SAFETENSORS:
        return data
    from safetensors.numpy import load

    buf = io.BytesIO()
    np.savez(buf, response=np.asarray(read_metadata(data).get("response", "{}")), **load(data))
    return buf.getvalue()


def read_metadata(data: bytes) -> dict[str, str]:
    """A safetensors file's metadata (its header's `__metadata__`)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__") or {}
