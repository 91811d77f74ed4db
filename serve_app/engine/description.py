"""What an engine says of its model (`DiffusionEngine.describe`): the ingress's source of
defaults, inputs and the RPC allow-list, and what `GET /v1/models` shows."""

from __future__ import annotations

from typing import Any

from serve_app.engine.loading import find_denoiser, weights_held
from serve_app.engine.types import rpc_methods


def describe_engine(engine) -> dict[str, Any]:
    fam = engine.family
    return {
        "model": engine.model_name,
        "source": engine.cfg.source,
        "pipeline": type(engine.pipe).__name__,
        "family": fam.name,
        "modality": fam.modality,
        "tasks": engine.tasks,
        "inputs": fam.inputs()
        + (["image"] if {"img2img", "edit"} & set(engine.tasks) else [])
        + (["mask"] if "inpaint" in engine.tasks else []),
        "takes_guidance": fam.guidance,
        "reference_images": fam.image_input == "references",
        "image_input": fam.image_input,
        "embeds_dim": fam.embeds_dim,
        "embeds_tokens": fam.embeds_tokens,
        "pooled_dim": fam.pooled_dim,
        "default_num_frames": engine.default_num_frames,
        "default_fps": engine.cfg.default_fps if engine.video else None,
        "frame_rule": list(fam.frame_rule) if fam.frame_rule else None,
        "edit_strength": engine._checks.edit_strength(),
        "scheduler": type(engine.pipe.scheduler).__name__,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "default_height": engine.default_height,
        "default_width": engine.default_width,
        "default_steps": engine.cfg.default_steps,
        "default_guidance_scale": engine.cfg.default_guidance_scale,
        "accelerations": list(engine.accelerations),
        "samplers": engine.schedulers.describe(),
        "default_sampler": engine.schedulers.default[0],
        "default_sigma_schedule": engine.schedulers.default[1],
        "sampler_kind": "flow" if engine.schedulers.flow else "discrete",
        "load_s": round(engine.load_s, 3),
        "fast_path": engine.fast.status() if engine.fast is not None else None,
        **weights_held(find_denoiser(engine.pipe)),
        "rpc_methods": rpc_methods(engine),
    }
