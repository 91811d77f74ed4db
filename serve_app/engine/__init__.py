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
    rpc_methods,
)

__all__ = [
    "CallParams",
    "DiffusionEngine",
    "EngineOutput",
    "InvalidArguments",
    "LoraError",
    "ModelLoadError",
    "Row",
    "encode_image",
    "exported",
    "rpc_methods",
]
