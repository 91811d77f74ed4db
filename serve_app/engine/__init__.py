"""The diffusion engine: plain Python over diffusers, with no Ray inside."""

from serve_app.engine.engine import DiffusionEngine
from serve_app.engine.media import encode_image
from serve_app.engine.protocol import Engine
from serve_app.engine.types import (
    CallParams,
    EngineOutput,
    InvalidArguments,
    LoraError,
    ModelLoadError,
    Row,
    exported,
    is_fatal_device_error,
    rpc_methods,
)

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
