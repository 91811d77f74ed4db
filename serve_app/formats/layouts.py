"""What a weights file is, read from its first bytes and its header alone. No torch here: the
ingress checks adapter and checkpoint files with it before any replica loads them.

A `.safetensors` file is 8 bytes (the header's length, little-endian), a JSON header naming
every tensor with its dtype, shape and byte range, then the tensors. Its header tells a file
that is no safetensors file (a pickle under that name, say) or one cut short from a good one,
and its tensor names tell the layout of a single-file checkpoint, before anything is loaded.
A `.gguf` file (GGUF, llama.cpp's format: quantized tensors, as the community publishes FLUX
transformers, and Wan's) is read the same way: its header, checked against the file, names every tensor
with its type. A layout's pipeline class tells its family (`family_of`), as the engine names
families.
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from pathlib import Path

# Weights in Python's pickle format (torch.save's): loading one runs the code it carries.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SAFETENSORS_SUFFIX = ".safetensors"
GGUF_SUFFIX = ".gguf"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound
# A header past this is read in a process of its own (`file_layout`): parsing it holds the
# interpreter's lock for seconds (35 MB: 1.5 s), which would stall every thread of the caller.
LARGE_HEADER_BYTES = 8 * 2**20

PICKLE_REASON = "loading a pickle runs the code it carries, so only .safetensors weights are loaded"

# The GGUF tensor types diffusers' GGUF loader reads (its SUPPORTED_GGUF_QUANT_TYPES, and F32 and
# F16 as they are), by gguf's names; tests/test_gguf.py holds this to diffusers' list.
GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
              "Q6_K", "IQ4_NL", "IQ4_XS")  # fmt: skip
# Layouts a GGUF file is loaded in: the transformer-only ones (the rest come with the configs).
GGUF_LAYOUTS = ("flux", "wan")
# Bounds on a GGUF header's counts, far above real files' (FLUX.1: ~780 tensors, ~10 fields):
# a header that claims more is refused before it is parsed.
MAX_GGUF_TENSORS = 50_000
MAX_GGUF_FIELDS = 10_000
MAX_GGUF_ITEMS = 100_000  # array items in all fields (the gguf package reads them one by one)
# GGUF's metadata value types: the size of each fixed-size one (8: a string, 9: an array).
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

# Single-file checkpoint layouts (the original repositories' key names), each by the tensor
# names that mark it, with its diffusers pipeline; only `LOADABLE` ones are served.
LAYOUTS = {
    "sd1": ("Stable Diffusion 1.x", "StableDiffusionPipeline"),
    "sd2": ("Stable Diffusion 2.x", "StableDiffusionPipeline"),
    "sdxl": ("SDXL", "StableDiffusionXLPipeline"),
    "sd3": ("SD3", "StableDiffusion3Pipeline"),
    "flux": ("FLUX", "FluxPipeline"),
    "wan": ("Wan", "WanPipeline"),
}
LOADABLE = ("sd1", "sdxl", "sd3", "flux", "wan")
# The parts a loadable layout's file holds, by the prefix of their tensor names.
PARTS = {
    "sd1": {"UNet": "model.diffusion_model.", "VAE": "first_stage_model.",
            "text encoder": "cond_stage_model.transformer."},
    "sdxl": {"UNet": "model.diffusion_model.", "VAE": "first_stage_model.",
             "text encoder": "conditioner.embedders.0.transformer.",
             "second text encoder": "conditioner.embedders.1.model."},
    # SD3's text encoders are optional: many files leave them out (`sd3_medium.safetensors`),
    # and those come with `model.pipeline_config`.
    "sd3": {"transformer": "model.diffusion_model.", "VAE": "first_stage_model."},
}  # fmt: skip


class FileRefused(ValueError):
    """Why a file cannot be loaded, worded to follow its name ("... is cut short")."""


def is_single_file(source: str) -> bool:
    """Whether a model source names one weights file (safetensors, GGUF or a pickle) by its suffix."""
    return Path(source).suffix.lower() in (SAFETENSORS_SUFFIX, GGUF_SUFFIX, *PICKLE_SUFFIXES)


def is_gguf_name(source: str | Path) -> bool:
    return Path(source).suffix.lower() == GGUF_SUFFIX


def is_pickle_name(source: str) -> bool:
    return Path(source).suffix.lower() in PICKLE_SUFFIXES


def safetensors_keys(path: str | Path) -> list[str]:
    """The tensor names of a safetensors file, its header checked against the file's size;
    FileRefused if it is a pickle, is cut short, or is no safetensors file at all."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(9)  # the header's length, then its first byte: '{' in every safetensors file
        # A header length whose low bytes read as a pickle's opening is still a safetensors file.
        if _is_pickle(head) and head[8:9] != b"{":
            raise FileRefused(f"holds a pickle (torch.save's format), not safetensors: {PICKLE_REASON}")
        if len(head) < 9:
            raise FileRefused("is not a safetensors file (shorter than its header)")
        n = int.from_bytes(head[:8], "little")
        if n > MAX_HEADER_BYTES:
            raise FileRefused("is not a safetensors file (its first bytes give no header length)")
        if 8 + n > size:
            raise FileRefused(f"is cut short: its header needs {8 + n} bytes and the file has {size}")
        f.seek(8)
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise FileRefused("is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise FileRefused("is not a safetensors file (its header is not a JSON object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        ranges = [v["data_offsets"] for v in tensors.values()]
        if not all(type(a) is int and type(b) is int and 0 <= a <= b for a, b in ranges):
            raise ValueError
        end = max((b for _, b in ranges), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise FileRefused("is not a safetensors file (its header has no byte ranges)") from None
    if 8 + n + end > size:
        raise FileRefused(f"is cut short: its tensors need {8 + n + end} bytes and the file has {size}")
    return list(tensors)


def gguf_keys(path: str | Path) -> list[str]:
    """The tensor names of a GGUF file, read from its header, every length in it checked
    against what is left of the file and every tensor's bytes against the file's size (a
    length no file can hold, such as an array of 2**63 items, makes the `gguf` package's own
    parser loop for ever, growing); FileRefused if it is a pickle, no GGUF file, cut short, or
    holds a tensor type diffusers cannot read (naming the type and a tensor of it)."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(24)  # magic, version, tensor count, field count
    if _is_pickle(head):
        raise FileRefused(f"holds a pickle (torch.save's format), not GGUF: {PICKLE_REASON}")
    if len(head) < 24 or head[:4] != b"GGUF":
        raise FileRefused("is not a GGUF file (it does not begin with GGUF's magic)")
    version, tensors, fields = (int.from_bytes(head[a:b], "little") for a, b in ((4, 8), (8, 16), (16, 24)))
    if version not in (2, 3):
        raise FileRefused(f"is a GGUF file of version {version}; versions 2 and 3 are read")
    if tensors > MAX_GGUF_TENSORS or fields > MAX_GGUF_FIELDS:
        raise FileRefused(
            f"is not a GGUF file this server reads (its header claims {tensors} tensors and {fields} fields)"
        )
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return _GgufHeader(m, size).tensor_names(fields, tensors)


class _GgufHeader:
    """A walk through a GGUF header's fields and tensor descriptions, bounded by the file."""

    def __init__(self, data, size: int):
        self.data, self.size, self.at, self.items = data, size, 24, 0
        self.alignment = 32

    def take(self, n: int) -> int:
        if n < 0 or self.at + n > self.size:
            raise FileRefused(f"is cut short: its header needs more than the {self.size} bytes the file has")
        self.at += n
        return self.at - n

    def number(self, n: int) -> int:
        start = self.take(n)
        return int.from_bytes(self.data[start : self.at], "little")

    def text(self) -> str:
        start = self.take(self.number(8))
        return bytes(self.data[start : self.at]).decode("utf-8", "replace")

    def value(self, kind: int, depth: int = 0) -> None:
        if kind in _GGUF_SIZES:
            self.take(_GGUF_SIZES[kind])
        elif kind == 8:
            self.take(self.number(8))
        elif kind == 9 and depth < 4:
            inner, count = self.number(4), self.number(8)
            self.items += count
            if self.items > MAX_GGUF_ITEMS:
                raise FileRefused(
                    f"is not a GGUF file this server reads (its fields hold over {MAX_GGUF_ITEMS} items)"
                )
            if inner in _GGUF_SIZES:
                self.take(count * _GGUF_SIZES[inner])
            else:
                for _ in range(count):
                    self.value(inner, depth + 1)
        else:
            raise FileRefused(f"is not a GGUF file (a field of unknown type {kind})")

    def tensor_names(self, fields: int, tensors: int) -> list[str]:
        for _ in range(fields):
            key, kind = self.text(), self.number(4)
            if key == "general.alignment" and kind == 4:  # a uint32
                self.alignment = self.number(4)
                if self.alignment == 0 or self.alignment & (self.alignment - 1):
                    raise FileRefused(f"is not a GGUF file (an alignment of {self.alignment})")
            else:
                self.value(kind)
        described = []
        for _ in range(tensors):
            name, dims = self.text(), self.number(4)
            if dims > 8:
                raise FileRefused(f"is not a GGUF file ({name[:80]!r} has {dims} dimensions)")
            shape = [self.number(8) for _ in range(dims)]
            described.append((name, shape, self.number(4), self.number(8)))
        start = -(-self.at // self.alignment) * self.alignment  # the data, aligned
        for name, shape, kind, offset in described:
            block, nbytes = _gguf_type(name, kind)
            elements = 1
            for d in shape:
                elements *= d
            if shape and shape[0] % block:  # GGUF lists the fastest dimension first
                raise FileRefused(
                    f"is not a GGUF file ({name[:80]!r} does not fill whole blocks of its type)"
                )
            if (end := start + offset + elements // block * nbytes) > self.size:
                raise FileRefused(
                    f"is cut short: tensor {name[:80]!r} needs {end} bytes and the file has {self.size}"
                )
        return [name for name, *_ in described]


def _gguf_type(name: str, kind: int) -> tuple[int, int]:
    """(elements a block, bytes a block) of GGUF tensor type `kind`; FileRefused unless diffusers
    reads it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        quant = GGMLQuantizationType(kind)
    except ValueError:
        raise FileRefused(f"holds {name[:80]!r} in GGUF type {kind}, which no GGUF reader knows") from None
    if quant.name not in GGUF_TYPES:
        raise FileRefused(
            f"holds {name[:80]!r} in GGUF type {quant.name}, which diffusers cannot read "
            f"(it reads {', '.join(GGUF_TYPES)})"
        )
    return GGML_QUANT_SIZES[quant]


def gguf_layout(keys: list[str]) -> str:
    """`loadable_layout` of a GGUF file's tensor names, which must be one of `GGUF_LAYOUTS`;
    FileRefused if not."""
    layout = checkpoint_layout(keys)
    if layout is not None and layout not in GGUF_LAYOUTS:
        raise FileRefused(
            f"is a GGUF file in the {LAYOUTS[layout][0]} layout; GGUF files are loaded as "
            + ", ".join(LAYOUTS[name][0] for name in GGUF_LAYOUTS)
            + " transformers only"
        )
    return loadable_layout(keys)


def _is_pickle(head: bytes) -> bool:
    """A pickle (protocol 2 or later: 0x80 and the protocol) or torch.save's zip of one."""
    return head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def checkpoint_layout(keys: list[str]) -> str | None:
    """The `LAYOUTS` name of a single-file checkpoint with these tensor names; None if none."""

    def has(prefix: str) -> bool:
        return any(k.startswith(prefix) for k in keys)

    unet = "model.diffusion_model."
    if has("conditioner.embedders.") and has(unet + "input_blocks."):
        return "sdxl"
    if has(unet + "joint_blocks.") or has("joint_blocks."):
        return "sd3"
    if has(unet + "double_blocks.") or has("double_blocks."):
        return "flux"
    if any(has(p + "patch_embedding.") and has(p + "blocks.0.self_attn.") for p in ("", unet)):
        return "wan"
    if has(unet + "input_blocks."):
        if has("cond_stage_model.transformer."):
            return "sd1"
        if has("cond_stage_model.model."):
            return "sd2"
    return None


def describe_layout(keys: list[str]) -> str:
    """The layout's name for a message, or what the file's names look like."""
    layout = checkpoint_layout(keys)
    if layout is not None:
        return f"a checkpoint in the {LAYOUTS[layout][0]} layout"
    tops = sorted({k.split(".", 1)[0][:40] for k in keys})[:4]
    return "of no checkpoint layout this server knows (its tensors begin " + ", ".join(map(repr, tops)) + ")"


def loadable_layout(keys: list[str]) -> str:
    """The layout of a whole single-file checkpoint this server loads; FileRefused saying why
    a file with these tensor names is not one."""
    layout = checkpoint_layout(keys)
    if layout not in LOADABLE:
        raise FileRefused(
            f"is {describe_layout(keys)}; single files are loaded in the "
            + ", ".join(LAYOUTS[name][0] for name in LOADABLE)
            + " layouts only (give a diffusers directory for other models)"
        )
    if (why := missing_part(layout, keys)) is not None:
        raise FileRefused(why)
    return layout


def file_layout(path: str | Path) -> str:
    """`loadable_layout` of a safetensors or GGUF file's tensor names. A safetensors header
    larger than real models' (`LARGE_HEADER_BYTES`), and every GGUF header (parsed field by
    field in Python), is read by a child process, so the caller's other threads (an ingress's
    event loop) go on meanwhile; FileRefused either way."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    small = not LARGE_HEADER_BYTES < n <= min(MAX_HEADER_BYTES, Path(path).stat().st_size - 8)
    if small and not is_gguf_name(path):
        return loadable_layout(safetensors_keys(path))  # small, or refused without reading it
    try:
        done = subprocess.run(
            [sys.executable, "-m", "serve_app.formats.layouts", str(path)], capture_output=True, timeout=300
        )
        answer = json.loads(done.stdout or b"{}")
    except (subprocess.TimeoutExpired, ValueError, OSError):
        answer = {}
    if "layout" in answer:
        return answer["layout"]
    unread = (
        "its header could not be read here" if is_gguf_name(path) else "its header is too large to read here"
    )
    raise FileRefused(answer.get("refused", f"could not be read ({unread})"))


def missing_part(layout: str, keys: list[str]) -> str | None:
    """Why a file of a loadable layout is not a whole checkpoint (a part of it absent); None if
    every part is there."""
    for part, prefix in PARTS.get(layout, {}).items():
        if not any(k.startswith(prefix) for k in keys):
            return (
                f"holds no {part} weights (no {prefix}* tensors); not a whole {LAYOUTS[layout][0]} checkpoint"
            )
    return None


# The project's family names (`engine/families.py`) for diffusers pipeline classes, by class
# name prefix, the longest first; plain Stable Diffusion only for its own three pipelines.
_FAMILY_PREFIXES = (
    ("StableDiffusionXL", "sdxl"),
    ("StableDiffusion3", "sd3"),
    ("Flux2", "flux2"),
    ("Flux", "flux"),
    ("Wan", "wan"),
    ("QwenImage", "qwen-image"),
    ("ZImage", "z-image"),
    ("LTX", "ltx"),
    ("HunyuanVideo15", "hunyuan-video"),
)
_SD_CLASSES = ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline")


def family_of(pipeline_class_name: str) -> str | None:
    """The family name `engine/families.py` gives pipelines of this class; None if unknown."""
    if pipeline_class_name in _SD_CLASSES:
        return "sd"
    for prefix, family in _FAMILY_PREFIXES:
        if pipeline_class_name.startswith(prefix) and pipeline_class_name.endswith("Pipeline"):
            return family
    return None


if __name__ == "__main__":  # `file_layout`'s reader of a large header: its answer as JSON
    try:
        if is_gguf_name(sys.argv[1]):
            print(json.dumps({"layout": gguf_layout(gguf_keys(sys.argv[1]))}))
        else:
            print(json.dumps({"layout": loadable_layout(safetensors_keys(sys.argv[1]))}))
    except FileRefused as e:
        print(json.dumps({"refused": str(e)}))
