"""The training stages, each printing its loss: the VAE, the UNet with the text encoder, the
shape cycle on saved weights and the green adapter; `train` and `later_stages` chain them.
Data, noise and order all come from `args.seed`."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from serve_app.engine.builtin import GREEN_LORA, load_shapes
from serve_app.shapes.data import (
    _encode_prompts,
    _object_weight,
    _parts,
    _prompt,
    encode_latents,
    make_scenes,
)
from serve_app.shapes.model import TE_LORA_TARGETS, build_pipeline, save_pipeline
from serve_app.shapes.scenes import SHAPES, Scene, random_scene, read_image


class _Progress:
    """A stage's optimiser step, and its mean loss printed every 50 steps."""

    def __init__(self, stage: str, steps: int, opt, params, clip: float | None = 1.0, lrs=None):
        self.stage, self.steps, self.opt, self.params, self.clip, self.lrs = (
            stage,
            steps,
            opt,
            params,
            clip,
            lrs,
        )
        self.t0, self.losses = time.monotonic(), []

    def step(self, step: int, loss: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        if self.lrs is not None:
            self.lrs.step()
        self.losses.append(loss.item())
        if step % 50 == 0 or step == self.steps:
            took = time.monotonic() - self.t0
            print(
                f"{self.stage} step {step}/{self.steps} loss {np.mean(self.losses):.5f} ({took:.0f} s)",
                flush=True,
            )
            self.losses = []


def train_vae(vae, images: torch.Tensor, steps: int, batch: int, rng: np.random.Generator) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.05)
    vae.train()
    progress = _Progress("vae", steps, opt, list(vae.parameters()), lrs=sched)
    for step in range(1, steps + 1):
        x = images[torch.from_numpy(rng.integers(len(images), size=batch))]
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.mode()).sample  # deterministic: the sampling noise slows learning
        progress.step(step, ((rec - x) ** 2 * _object_weight(x)).mean() + 1e-6 * post.kl().mean())
    vae.eval()
    collapse_variance(vae)


@torch.no_grad()
def round_trip_reading(vae, n: int = 200, seed: int = 5) -> dict[str, float]:
    """How often the checker reads each shape right on the VAE's reconstructions of `n` fresh
    scenes: the ceiling of what the UNet, which works in the VAE's latents, can draw."""
    scenes, images = make_scenes(n, np.random.default_rng(seed))
    rec = vae.decode(vae.encode(images).latent_dist.mean).sample
    pixels = ((rec.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    right = [read_image(p).shape == s.shape for p, s in zip(pixels, scenes, strict=True)]
    report = {"all": float(np.mean(right))}
    for name in SHAPES:
        report[name] = float(np.mean([r for r, s in zip(right, scenes, strict=True) if s.shape == name]))
    return report


@torch.no_grad()
def collapse_variance(vae) -> None:
    """Make the posterior's variance ~0, so that a sample of it is its mean.

    Trained on the mean, the VAE leaves its variance untrained (near 1, against latents of std
    ~0.6): img2img and inpainting, which sample it, would drown the input image in noise.
    """
    c = vae.config.latent_channels
    vae.quant_conv.weight[c:] = 0
    vae.quant_conv.bias[c:] = -30.0  # log-variance; diffusers clamps it to [-30, 20]


class _EMA:
    def __init__(self, modules, decay: float):
        self.params = [p for m in modules for p in m.parameters()]
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay, self.n = decay, 0

    @torch.no_grad()
    def update(self) -> None:
        self.n += 1
        d = min(self.decay, (1 + self.n) / (10 + self.n))
        for s, p in zip(self.shadow, self.params, strict=True):
            s.lerp_(p.detach(), 1 - d)

    @torch.no_grad()
    def copy_to(self) -> None:
        for s, p in zip(self.shadow, self.params, strict=True):
            p.copy_(s)


def train_text_to_image(pipe, latents: torch.Tensor, scenes: list[Scene], steps: int, batch: int,
                        rng: np.random.Generator, lr: float, weights: torch.Tensor | None = None,
                        noisy: tuple[int, int, float] | None = None, name_small: bool = False
                        ) -> None:  # fmt: skip
    """The UNet and the text encoder together, v-prediction on (latent, prompt) pairs; the EMA
    of their weights is what stays. `weights`: a loss weight per latent pixel (one map per
    latent); `noisy` (low, high, share): that share of the timesteps drawn from [low, high);
    `name_small`: see `_prompt`."""
    modules = [pipe.unet, pipe.text_encoder]
    for m in modules:
        m.requires_grad_(True).train()
    ema = _EMA(modules, decay=0.995)
    params = [p for m in modules for p in m.parameters()]
    sch = pipe.scheduler
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-2)
    warm = max(1, steps // 20)

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(step / steps, 1.0)))

    lrs = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    progress = _Progress("unet", steps, opt, params, lrs=lrs)
    for step in range(1, steps + 1):
        idx = rng.integers(len(latents), size=batch)
        rows = torch.from_numpy(idx)
        x0 = latents[rows]
        cond = _encode_prompts(pipe, [_prompt(scenes[i], rng, name_small) for i in idx])
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, sch.config.num_train_timesteps, (batch,), generator=gen)
        if noisy is not None:
            low, high, share = noisy
            t = torch.where(torch.rand(batch, generator=gen) < share,
                            torch.randint(low, high, (batch,), generator=gen), t)  # fmt: skip
        xt = sch.add_noise(x0, noise, t)
        target = sch.get_velocity(x0, noise, t)
        pred = pipe.unet(xt, t, encoder_hidden_states=cond).sample
        if weights is None:
            loss = F.mse_loss(pred, target)
        else:
            w = weights[rows]
            loss = ((pred - target) ** 2 * w).mean() / w.mean()
        progress.step(step, loss)
        ema.update()
    ema.copy_to()
    for m in modules:
        m.requires_grad_(False).eval()


def train_green_lora(pipe, steps: int, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """A LoRA on the text encoder that makes a prompt's object green, whatever colour it names.

    Trained by distillation, no images needed: with the adapter, the encoder's output for "a red
    circle on a blue background" must equal its output, without it, for "a green circle on a
    blue background" (every token, padding included: the UNet attends to all of them). Prompts
    whose object is green already, or that name no colour, must come out unchanged. Seeded on
    its own (`seed + 1000`). Returns the state dict in diffusers' key names.
    """
    import dataclasses

    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    rng = np.random.default_rng(seed + 1000)
    torch.manual_seed(seed + 1000)
    te = pipe.text_encoder

    def pairs(n: int) -> tuple[list[str], list[str]]:
        asked, wanted = [], []
        for _ in range(n):
            scene = random_scene(rng)
            if scene.background == "green":
                scene = dataclasses.replace(scene, background="blue" if scene.colour != "blue" else "red")
            flags = _parts(rng)
            if rng.random() < 0.05:
                asked.append("")
                wanted.append("")
                continue
            asked.append(scene.prompt(**flags))
            wanted.append(dataclasses.replace(scene, colour="green").prompt(**flags))
        return asked, wanted

    cfg = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=TE_LORA_TARGETS)
    inject_adapter_in_model(cfg, te)
    params = [p for n, p in te.named_parameters() if "lora_" in n]
    for n, p in te.named_parameters():
        p.requires_grad_("lora_" in n)
    progress = _Progress("lora", steps, torch.optim.Adam(params, lr=1e-2), params, clip=None)
    for step in range(1, steps + 1):
        asked, wanted = pairs(batch)
        with torch.no_grad(), _adapters_off(te):
            target = _encode_prompts(pipe, wanted)
        progress.step(step, F.mse_loss(_encode_prompts(pipe, asked), target))
    te.eval()
    state = get_peft_model_state_dict(te)
    return {f"text_encoder.{k}": v.detach().to(torch.float16).contiguous() for k, v in state.items()}


class _adapters_off:
    """Within it, `model`'s LoRA layers act as their base layers."""

    def __init__(self, model):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    def __enter__(self):
        for m in self.layers:
            m.enable_adapters(False)

    def __exit__(self, *exc):
        for m in self.layers:
            m.enable_adapters(True)


def train(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    t0 = time.monotonic()
    pipe = build_pipeline(args.seed)
    scenes, images = make_scenes(args.scenes, rng)
    print(f"{len(scenes)} scenes rendered ({time.monotonic() - t0:.0f} s)", flush=True)
    train_vae(pipe.vae, images, args.vae_steps, 32, rng)
    pipe.vae.requires_grad_(False)
    reading = round_trip_reading(pipe.vae, n=min(200, args.scenes))
    print("shapes the checker reads right after a VAE round trip: "
          + ", ".join(f"{k} {v:.0%}" for k, v in reading.items()), flush=True)  # fmt: skip
    latents = encode_latents(pipe, images) / pipe.vae.config.scaling_factor
    scaling = float(1 / latents.std())
    pipe.vae.register_to_config(scaling_factor=scaling)
    latents = latents * scaling
    print(f"latent scaling factor {scaling:.4f}", flush=True)
    train_text_to_image(pipe, latents, scenes, args.unet_steps, args.batch, rng, lr=args.lr)
    save_pipeline(pipe, out / "shapes")
    print(f"wrote {out / 'shapes'} ({time.monotonic() - t0:.0f} s)", flush=True)
    later_stages(args)
    print(f"done in {time.monotonic() - t0:.0f} s", flush=True)


def later_stages(args) -> None:
    """The stages that start from saved weights, the shape cycle then the adapter, each unless
    its step count is 0."""
    if args.shape_steps:
        sharpen_shapes(args)
    if args.lora_steps:
        lora_only(args)


# How often the shape cycle keeps each shape of the grammar's scenes: the shapes the first cycle
# draws worst most (stars and squares), and circles often enough that a red circle stays one.
BALANCE = {"star": 1.0, "square": 0.8, "triangle": 0.6, "circle": 0.8}
# The shape cycle's scenes and noise are seeded `seed + 3`: the offset of this cycle when it was
# the fourth of five stages, kept so that the shipped weights are what this code writes.
SHAPE_SEED_OFFSET = 3


def sharpen_shapes(args) -> None:
    """A second learning-rate cycle on the saved pipeline (fresh scenes, half the learning rate),
    aimed at the shape: the object's latent pixels weigh 4 times in the loss, 60% of the
    timesteps are drawn from the noisy half where the outline is laid out (450-950), the scenes
    hold more of the shapes drawn worst (`BALANCE`), and every small object's prompt names its
    size, so that a prompt without a size asks for a large one (small stars, 18 pixels across,
    come out as blobs; large ones the model can draw)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed + SHAPE_SEED_OFFSET)
    rng = np.random.default_rng(args.seed + SHAPE_SEED_OFFSET)
    t0 = time.monotonic()
    pipe = load_shapes(Path(args.out) / "shapes")
    scenes, images = make_scenes(args.scenes, rng, BALANCE)
    latents = encode_latents(pipe, images)
    weights = F.avg_pool2d(_object_weight(images, extra=3.0), images.shape[-1] // latents.shape[-1])
    train_text_to_image(pipe, latents, scenes, args.shape_steps, args.batch, rng, lr=args.lr / 2,
                        weights=weights, noisy=(450, 950, 0.6), name_small=True)  # fmt: skip
    save_pipeline(pipe, Path(args.out) / "shapes")
    print(f"sharpened {Path(args.out) / 'shapes'} ({time.monotonic() - t0:.0f} s)", flush=True)


def lora_only(args) -> None:
    """The green adapter, trained on the saved pipeline (as a full run does, so both agree)."""
    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    pipe = load_shapes(Path(args.out) / "shapes")
    state = train_green_lora(pipe, args.lora_steps, args.batch, args.seed)
    save_file(state, str(Path(args.out) / GREEN_LORA.name))
