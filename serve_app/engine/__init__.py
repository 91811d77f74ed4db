"""The diffusion engine: plain Python over diffusers, with no Ray inside."""

from serve_app.engine.engine import (
    CallParams,
    DiffusionEngine,
    EngineOutput,
    InvalidArguments,
    LoraError,
    ModelLoadError,
    Row,
    encode_image,
    exported,
    is_fatal_device_error,
    rpc_methods,
)
from serve_app.engine.protocol import Engine

__all__ = [
    "CallParams",
    "DiffusionEngine",
    "Engine",
    "EngineOutput",
    "InvalidArguments",
    "LoraError",
    "ModelLoadError",
    "Row",
    "encode_image",
    "exported",
    "is_fatal_device_error",
    "rpc_methods",
]
