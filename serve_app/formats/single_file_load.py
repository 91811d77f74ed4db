"""A pipeline from one checkpoint file in the original layout: the single `.safetensors` file of
A1111, ComfyUI and model sites, which holds the UNet, VAE and text encoders of Stable Diffusion
1.x or SDXL under their original names, SD3's MMDiT and VAE (and its text encoders where the
file has them: the others come with the configs), or FLUX's or Wan's transformer alone
(`flux_file.py`, `wan_file.py`), as a safetensors or a GGUF file.
diffusers' `from_single_file` and its converters turn the SD weights into diffusers' (each text
encoder by the prefix its layout puts it under, where diffusers would guess by width and take
the wrong one when two encoders are equally wide); nothing is downloaded: the pipeline's
configs (component configs, tokenizer, scheduler) come from `model.pipeline_config`, a local
diffusers directory or an embedded model's: the engine, which builds those, passes them in
(`Embedded`), since this package never imports it.

Every refusal is a `CheckpointRefused` that names the file (as configured) and says why; the
engine raises it as its own load error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from serve_app.config import BUILTIN_PREFIX, ModelConfig
from serve_app.formats.flux_file import flux_from_original
from serve_app.formats.layouts import (
    LAYOUTS,
    PICKLE_REASON,
    SAFETENSORS_SUFFIX,
    FileRefused,
    describe_layout,
    family_of,
    gguf_keys,
    gguf_layout,
    is_gguf_name,
    is_pickle_name,
    loadable_layout,
    safetensors_keys,
)
from serve_app.formats.wan_file import wan_from_original


class CheckpointRefused(RuntimeError):
    """A single-file checkpoint that cannot be loaded as configured; the message names the
    setting (`model.source`, `model.pipeline_config`) and says why."""


class Embedded(NamedTuple):
    """What a single file's pipeline takes of an embedded model (`builtin:<name>` as
    `model.pipeline_config`), from the engine that builds them."""

    build: Callable[..., Any]  # build(name, seed=...): the pipeline, whose parts stand in for the file's
    configs: Callable[[str], Path]  # configs(name): a diffusers directory of its configs, no weights


def load_single_file(
    cfg: ModelConfig, dtype: torch.dtype, embedded: Embedded, reuse: dict[str, Any] | None = None
):
    """The pipeline of `cfg.source`, a single-file checkpoint, on the CPU (the caller moves it);
    `reuse` components are taken as they are instead of being read from the file."""
    src = cfg.source
    path, keys, layout = _checked_file(src)
    config_dir = pipeline_config_dir(cfg.pipeline_config, embedded)
    index = json.loads((config_dir / "model_index.json").read_text())
    class_name, expected = index.get("_class_name", ""), LAYOUTS[layout][1]
    if family_of(class_name) != family_of(expected):
        raise CheckpointRefused(
            f"model.pipeline_config: {cfg.pipeline_config!r} describes a {class_name}; "
            f"{src!r} is {describe_layout(keys)} (a {expected})"
        )
    import diffusers

    def scrub(e: Exception) -> str:  # no server path in the message: the names as configured
        return str(e).replace(str(config_dir), str(cfg.pipeline_config)).replace(str(path), src)

    try:
        if layout in TRANSFORMER_ONLY:
            where = (path, layout, config_dir, class_name)
            pipe = _around_transformer(cfg, where, embedded, reuse or {}, dtype)
        else:
            parts = _converted_models(index, path, config_dir, src, layout, reuse or {})
            parts.update(_absent_text_encoders(cfg, layout, parts, config_dir, embedded))
            pipe = getattr(diffusers, class_name).from_single_file(
                str(path), config=str(config_dir), local_files_only=True, **parts
            )  # in the file's dtype: a weight it lacks stays on the meta device, found below
    except CheckpointRefused:
        raise
    except Exception as e:  # diffusers raises many types here; all mean "cannot load"
        raise CheckpointRefused(f"model.source: cannot load {src!r}: {type(e).__name__}: {scrub(e)}") from e
    _check_complete(pipe, src, LAYOUTS[layout][0])
    return pipe.to(dtype=dtype)


# Layouts whose files hold the denoiser alone (FLUX's and Wan's, as their makers and model sites
# share them): the pipeline's other parts come with `model.pipeline_config`, weights and all.
# Each: the transformer's diffusers class and what turns the file's names into diffusers'.
TRANSFORMER_ONLY = {
    "flux": ("FluxTransformer2DModel", flux_from_original),
    "wan": ("WanTransformer3DModel", wan_from_original),
}


def _around_transformer(
    cfg: ModelConfig, where: tuple[Path, str, Path, str], embedded: Embedded, reuse: dict, dtype: torch.dtype
):
    """The pipeline of `model.pipeline_config` (an embedded model built from `model.seed`, or a
    local diffusers directory's weights) with its transformer read from the file (a GGUF
    file's quantized, `_load_quantized`). `where`: the file, its layout, the configs'
    directory and the pipeline's class name."""
    path, layout, config_dir, class_name = where
    import diffusers
    from safetensors.torch import load_file

    model_class, from_original = TRANSFORMER_ONLY[layout]
    cls = getattr(diffusers, model_class)
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # buffers made at init (Wan's rope) are real
        transformer = cls.from_config(cls.load_config(config_dir / "transformer"))
    gguf = is_gguf_name(path)
    if gguf:
        from diffusers.models.model_loading_utils import load_gguf_checkpoint

        state = load_gguf_checkpoint(str(path))
    else:
        state = load_file(str(path))
    try:
        weights = from_original(state)
    except KeyError:  # FLUX's without img_in: nothing the transformer's widths can be read from
        weights = {}
    if gguf:
        missing = _load_quantized(transformer, weights, dtype, cfg.source)
    else:
        missing = transformer.load_state_dict(weights, strict=False, assign=True).missing_keys
    if missing:
        raise CheckpointRefused(
            f"model.source: {cfg.source!r} lacks {len(missing)} weights of the transformer "
            f"(e.g. {sorted(missing)[0]}); not a whole {LAYOUTS[layout][0]} transformer"
        )
    parts = {**reuse, "transformer": transformer.eval()}
    setting = cfg.pipeline_config or ""
    if setting.startswith(BUILTIN_PREFIX):
        pipe = embedded.build(setting[len(BUILTIN_PREFIX) :], seed=cfg.seed)
        pipe.register_modules(**parts)
        return pipe
    return getattr(diffusers, class_name).from_pretrained(config_dir, local_files_only=True, **parts)


def _load_quantized(transformer: torch.nn.Module, weights: dict, dtype: torch.dtype, src: str) -> list[str]:
    """Put a GGUF file's weights (diffusers' names) into `transformer` (on the meta device) as
    they are: each linear layer whose weight is quantized becomes diffusers' `GGUFLinear`, which
    dequantizes it at each call to `dtype`, so the weights stay quantized in memory; any other
    quantized tensor (a norm's, in BF16) is dequantized once. Returns the names of the weights
    the file lacks; CheckpointRefused for one whose shape is not the configs'."""
    from diffusers.quantizers.gguf.utils import (
        GGUFLinear,
        GGUFParameter,
        _replace_with_gguf_linear,
        dequantize_gguf_tensor,
    )

    # Modules the model keeps in float32 (Wan's time embedder casts its input to their weights'
    # dtype) stay plain layers, their weights dequantized once, as diffusers' GGUF loader does.
    keep = list(getattr(transformer, "_keep_in_fp32_modules", None) or [])
    _replace_with_gguf_linear(transformer, dtype, weights, modules_to_not_convert=keep)
    missing = []
    for key, like in transformer.state_dict(keep_vars=True).items():
        value = weights.get(key)
        if value is None:
            missing.append(key)
            continue
        quantized = isinstance(value, GGUFParameter)
        shape = tuple(value.quant_shape if quantized else value.shape)
        if shape != tuple(like.shape):
            raise CheckpointRefused(
                f"model.source: {src!r} holds {key} of shape {shape}; the transformer's configs "
                f"(model.pipeline_config) give {tuple(like.shape)}"
            )
        module, _, name = key.rpartition(".")
        owner = transformer.get_submodule(module)
        if quantized and not (isinstance(owner, GGUFLinear) and name == "weight"):
            value, quantized = dequantize_gguf_tensor(value).to(dtype), False
        if name in owner._buffers:
            owner._buffers[name] = value
        else:
            owner._parameters[name] = value if quantized else torch.nn.Parameter(value, requires_grad=False)
    return missing


def _checked_file(src: str) -> tuple[Path, list[str], str]:
    """The file, its tensor names and its layout, or CheckpointRefused saying why not."""
    field = "model.source"
    if is_pickle_name(src):
        raise CheckpointRefused(f"{field}: {src!r} is a pickle checkpoint: {PICKLE_REASON}")
    path = Path(src).expanduser()
    if not path.is_file():
        raise CheckpointRefused(f"{field}: no checkpoint file at {src!r}")
    gguf = is_gguf_name(path)
    if path.suffix != SAFETENSORS_SUFFIX and not gguf:  # diffusers reads other names as pickles
        raise CheckpointRefused(
            f"{field}: {src!r}: a single-file checkpoint's name ends in .safetensors or .gguf"
        )
    try:
        if gguf:
            keys = gguf_keys(path)
            return path, keys, gguf_layout(keys)
        keys = safetensors_keys(path)
        return path, keys, loadable_layout(keys)
    except FileRefused as e:
        raise CheckpointRefused(f"{field}: {src!r} {e}") from None


# Where each layout keeps a text encoder: (its layout, the prefix of its tensor names). SD3's
# CLIP-L ("clip_l") pools without a projection in Stability's code: where its file holds none,
# the identity stands for it, as in diffusers' loader.
TEXT_ENCODERS = {
    "sdxl": {"text_encoder": ("clip", "conditioner.embedders.0.transformer."),
             "text_encoder_2": ("open_clip", "conditioner.embedders.1.model.")},
    "sd3": {"text_encoder": ("clip_l", "text_encoders.clip_l.transformer."),
            "text_encoder_2": ("clip", "text_encoders.clip_g.transformer."),
            "text_encoder_3": ("t5", "text_encoders.t5xxl.transformer.")},
}  # fmt: skip
# Layouts whose files may leave the text encoders out: those come with `model.pipeline_config`.
OPTIONAL_TEXT = ("sd3",)


def _converted_models(
    index: dict, path: Path, config_dir: Path, src: str, layout: str, reuse: dict
) -> dict[str, Any]:
    """`reuse`, and each diffusers model of the pipeline (UNet, VAE) and the text encoders
    `TEXT_ENCODERS` places converted from the file one at a time, so that one the file holds
    only part of is named: diffusers fails such a model as it moves its empty weights."""
    import diffusers
    from diffusers.loaders.single_file_model import FromOriginalModelMixin
    from safetensors.torch import load_file

    out, state = dict(reuse), None
    for name, kind in index.items():
        if name in out or not isinstance(kind, list) or kind[1] is None:
            continue
        if name in TEXT_ENCODERS.get(layout, {}):
            state = load_file(str(path)) if state is None else state
            where = TEXT_ENCODERS[layout][name]
            if layout in OPTIONAL_TEXT and not any(k.startswith(where[1]) for k in state):
                continue  # model.pipeline_config brings it (_absent_text_encoders)
            out[name] = _text_encoder(kind, state, config_dir, name, where, src)
            continue
        cls = getattr(diffusers, kind[1], None) if kind[0] == "diffusers" else None
        if not (isinstance(cls, type) and issubclass(cls, FromOriginalModelMixin)):
            continue
        state = load_file(str(path)) if state is None else state
        try:
            out[name] = cls.from_single_file(  # a copy: SD3's converter renames in place
                dict(state), config=str(config_dir), subfolder=name, local_files_only=True
            )
        except NotImplementedError as e:
            if "meta tensor" not in str(e):
                raise
            raise CheckpointRefused(
                f"model.source: {src!r} lacks weights of the {name} (some of its tensors are absent); "
                "not a whole checkpoint"
            ) from None
    return out


def _absent_text_encoders(
    cfg: ModelConfig, layout: str, parts: dict, config_dir: Path, embedded: Embedded
) -> dict[str, Any]:
    """The text encoders a file of an `OPTIONAL_TEXT` layout left out, weights and all from
    `model.pipeline_config`: an embedded model (built from `model.seed`) or a directory's."""
    names = [n for n in TEXT_ENCODERS.get(layout, {}) if n not in parts]
    if layout not in OPTIONAL_TEXT or not names:
        return {}
    setting = cfg.pipeline_config or ""
    if setting.startswith(BUILTIN_PREFIX):
        pipe = embedded.build(setting[len(BUILTIN_PREFIX) :], seed=cfg.seed)
        return {n: getattr(pipe, n) for n in names}
    import transformers

    index, out = json.loads((config_dir / "model_index.json").read_text()), {}
    for name in names:
        try:
            cls = getattr(transformers, index[name][1])
            out[name] = cls.from_pretrained(config_dir, subfolder=name, local_files_only=True).eval()
        except (OSError, KeyError, TypeError, AttributeError):
            raise CheckpointRefused(
                f"model.source: {cfg.source!r} holds no {name} weights (no {TEXT_ENCODERS[layout][name][1]}* "
                f"tensors) and model.pipeline_config {setting!r} has none either"
            ) from None
    return out


def _text_encoder(kind: list, state: dict, config_dir: Path, name: str, where: tuple[str, str], src: str):
    """The transformers text encoder `name` from the file's tensors under `where`'s prefix,
    converted by diffusers' converter for its layout; CheckpointRefused if any weight is absent."""
    import transformers
    from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint, convert_open_clip_checkpoint

    layout, prefix = where
    cls = getattr(transformers, kind[1])
    config = cls.config_class.from_pretrained(config_dir / name, local_files_only=True)
    mine = {k: v for k, v in state.items() if k.startswith(prefix)}
    if layout == "open_clip":
        with torch.device("meta"):  # the converter reads only the model's config
            weights = convert_open_clip_checkpoint(cls(config), mine, prefix=prefix)
    elif layout == "t5":
        weights = {k.removeprefix(prefix): v for k, v in mine.items()}
    else:
        weights = convert_ldm_clip_checkpoint(mine, prefix)
    with torch.device("meta"):
        has_wrapper = hasattr(cls(config), "text_model")
    # fp8 files (`..._t5xxlfp8`): widened here, cast to model.dtype with the rest of the pipeline
    weights = {
        k: v.float() if v.is_floating_point() and v.element_size() == 1 else v for k, v in weights.items()
    }
    if layout == "clip_l" and "text_projection.weight" not in weights:
        weights["text_projection.weight"] = torch.eye(config.hidden_size)
    if layout != "t5" and not has_wrapper:  # transformers 5.6 flattened CLIPTextModel
        weights = {k.removeprefix("text_model."): v for k, v in weights.items()}
    model, info = cls.from_pretrained(None, config=config, state_dict=weights, output_loading_info=True)
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise CheckpointRefused(
            f"model.source: {src!r} lacks {len(missing)} weights of the {name} (e.g. {missing[0]}); "
            "not a whole checkpoint"
        )
    return model.eval()


def _check_complete(pipe, src: str, layout: str) -> None:
    """Refuse a pipeline some of whose weights the file did not hold (diffusers leaves a text
    encoder's on the meta device, to fail later)."""
    for name, module in pipe.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        missing = [k for k, v in module.state_dict().items() if v.is_meta]
        if missing:
            raise CheckpointRefused(
                f"model.source: {src!r} lacks {len(missing)} weights of the {name} (e.g. {missing[0]}); "
                f"not a whole {layout} checkpoint"
            )


def pipeline_config_dir(setting: str | None, embedded: Embedded) -> Path:
    """The local directory that holds the pipeline's configs for `model.pipeline_config`."""
    field = "model.pipeline_config"
    if setting is None:
        raise CheckpointRefused(
            f"{field}: a single-file source needs the pipeline's configs: a local diffusers directory "
            "(model_index.json, component configs, tokenizer, scheduler) or builtin:<name>"
        )
    if setting.startswith(BUILTIN_PREFIX):
        return embedded.configs(setting[len(BUILTIN_PREFIX) :])
    path = Path(setting).expanduser()
    if not (path / "model_index.json").is_file():
        raise CheckpointRefused(
            f"{field}: {setting!r} is not a local diffusers pipeline directory (no model_index.json); "
            "nothing is downloaded"
        )
    return path


def write_configs(pipe, out: Path) -> None:
    """`pipe`'s model_index.json and each component's config, tokenizer files or scheduler
    config, laid out as a diffusers pipeline directory without weights."""
    from diffusers import ModelMixin, SchedulerMixin
    from transformers import PreTrainedModel

    pipe.save_config(out)
    for name, part in pipe.components.items():
        if part is None or not hasattr(part, "save_pretrained") and not hasattr(part, "save_config"):
            continue
        target = out / name
        if isinstance(part, ModelMixin | SchedulerMixin):
            part.save_config(target)
        elif isinstance(part, PreTrainedModel):
            part.config.save_pretrained(target)
        else:  # tokenizers, feature extractors
            part.save_pretrained(target)
