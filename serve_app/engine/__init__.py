"""The diffusion engine: plain Python over diffusers, with no Ray inside."""

from serve_app.engine.engine import (
    CallParams,
    DiffusionEngine,
    EngineOutput,
    LoraError,
    ModelLoadError,
    Row,
    encode_image,
)

__all__ = [
    "CallParams",
    "DiffusionEngine",
    "EngineOutput",
    "LoraError",
    "ModelLoadError",
    "Row",
    "encode_image",
]
