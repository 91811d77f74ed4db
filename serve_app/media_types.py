"""The output formats a result is encoded in, and their media types: the wire schema accepts
them (`schemas`), the engine encodes them (`engine/media.py`), the jobs store serves them. Plain
constants, so the engine need not import the wire schema."""

IMAGE_FORMATS = ("png", "jpeg", "webp")
VIDEO_FORMATS = ("mp4", "webp", "gif")  # webp: animated
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "gif": "image/gif",
               "mp4": "video/mp4"}  # fmt: skip
