"""The wire format: every request and result that crosses a process boundary, by API.

* `base`: the base model `_Wire`, constants and patterns, the checked field types (the output
  formats and their media types are `serve_app.media_types`', re-exported here);
* `payloads`: tensors and images as they travel;
* `generation`: the Python API's requests (`GenerationRequest`, `BatchGenerationRequest`), used
  by handle callers and mapped onto by the HTTP bodies;
* `internal`: the hand-offs between the ingress and the replicas (`PreparedRequest`,
  `GenerationResult`, `StageMetrics`, `StepEvent`, `ModelDescription`);
* `openai`: the HTTP API, compatible with the OpenAI Images API (`ImagesGenerationRequest`,
  `ImagesResponse`, the model list, the error body);
* `control`: status, request state and abort, adapters, profiling and RPC;
* `jobs`: asynchronous jobs.

Import from here: every name is re-exported.
"""

from serve_app.media_types import IMAGE_FORMATS, MEDIA_TYPES, VIDEO_FORMATS
from serve_app.schemas.base import (
    MAX_SEED,
    NOT_BLANK,
    REQUEST_ID_PATTERN,
    REQUEST_ID_REGEX,
    B64Bytes,
    Extra,
    MemoryKind,
    OutputFormat,
    Prompt,
    Prompts,
    RequestId,
    new_request_id,
    odd_json,
)
from serve_app.schemas.base import _b64decode as _b64decode
from serve_app.schemas.base import _bad_text as _bad_text
from serve_app.schemas.base import _check_prompt as _check_prompt
from serve_app.schemas.base import _check_prompts as _check_prompts
from serve_app.schemas.base import _check_request_id as _check_request_id
from serve_app.schemas.base import _Wire as _Wire
from serve_app.schemas.control import (
    AbortResponse,
    CheckpointAdd,
    LoraAdd,
    LoraPin,
    ModelStatus,
    Outcome,
    ProfileStart,
    ReplicaStats,
    RequestState,
    RpcCall,
    StatusResponse,
    TenantStatus,
)
from serve_app.schemas.generation import _LORA_ALIASES as _LORA_ALIASES
from serve_app.schemas.generation import (
    LORA_NAME_CHARS,
    LORA_SCALE,
    BatchGenerationRequest,
    GenerationParams,
    GenerationRequest,
    LoraRef,
    Rollout,
)
from serve_app.schemas.generation import _ImageInputs as _ImageInputs
from serve_app.schemas.internal import (
    CHECKPOINT_ID,
    EMBEDS_FIELDS,
    GenerationResult,
    ModelDescription,
    PreparedRequest,
    StageMetrics,
    StepEvent,
)
from serve_app.schemas.jobs import (
    FINISHED,
    DeletedJob,
    Job,
    JobList,
    JobOutput,
    JobRecord,
    JobState,
    JobTensors,
    VideoJob,
    WebhookDelivery,
    WebhookEvent,
)
from serve_app.schemas.openai import (
    QUALITY_ACCELERATION,
    SERVED_QUALITY,
    ErrorBody,
    ErrorResponse,
    ImageData,
    ImagesBatchRequest,
    ImagesEditRequest,
    ImagesGenerationRequest,
    ImagesResponse,
    ImagesUsage,
    ModelCard,
    ModelList,
    SamplerCard,
    VideosGenerationRequest,
    parse_size,
)
from serve_app.schemas.openai import _ImagesCommon as _ImagesCommon
from serve_app.schemas.payloads import InputImage, PixelPayload, TensorPayload, Trajectory
from serve_app.schemas.payloads import _image_bytes as _image_bytes
from serve_app.schemas.videos import Video, VideoDeleted, VideoList

__all__ = [
    "CHECKPOINT_ID",
    "EMBEDS_FIELDS",
    "FINISHED",
    "IMAGE_FORMATS",
    "MAX_SEED",
    "MEDIA_TYPES",
    "QUALITY_ACCELERATION",
    "SERVED_QUALITY",
    "REQUEST_ID_PATTERN",
    "REQUEST_ID_REGEX",
    "NOT_BLANK",
    "VIDEO_FORMATS",
    "odd_json",
    "AbortResponse",
    "CheckpointAdd",
    "B64Bytes",
    "BatchGenerationRequest",
    "Rollout",
    "ErrorBody",
    "ErrorResponse",
    "Extra",
    "GenerationParams",
    "GenerationRequest",
    "GenerationResult",
    "ImageData",
    "ImagesBatchRequest",
    "ImagesEditRequest",
    "ImagesGenerationRequest",
    "ImagesResponse",
    "ImagesUsage",
    "InputImage",
    "DeletedJob",
    "Job",
    "JobList",
    "JobOutput",
    "JobTensors",
    "Video",
    "VideoDeleted",
    "VideoJob",
    "VideoList",
    "JobRecord",
    "JobState",
    "LoraAdd",
    "LoraPin",
    "LoraRef",
    "LORA_NAME_CHARS",
    "LORA_SCALE",
    "MemoryKind",
    "ModelCard",
    "ModelDescription",
    "ModelList",
    "Outcome",
    "OutputFormat",
    "PixelPayload",
    "PreparedRequest",
    "ProfileStart",
    "Prompt",
    "Prompts",
    "ModelStatus",
    "ReplicaStats",
    "RequestId",
    "RequestState",
    "RpcCall",
    "SamplerCard",
    "StageMetrics",
    "StatusResponse",
    "TenantStatus",
    "StepEvent",
    "TensorPayload",
    "Trajectory",
    "VideosGenerationRequest",
    "WebhookDelivery",
    "WebhookEvent",
    "new_request_id",
    "parse_size",
]
