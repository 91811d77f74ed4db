"""Train `builtin:shapes`: a tiny Stable-Diffusion pipeline that draws the scenes of
`serve_app.shapes` from their prompts, trained from a seed on a CPU (docs/shapes-model.md).

    python -m serve_app.train_tiny                  # all stages; writes serve_app/engine/weights/
    python -m serve_app.train_tiny --evaluate       # the checker's reading of the saved model
    python -m serve_app.train_tiny --lora-only      # only the green adapter, on the saved pipeline

Stages, each printing its loss: the VAE (64x64 RGB <-> 4x32x32 latents), the UNet with the text
encoder (v-prediction, zero-terminal-SNR schedule, the EMA of the weights is kept), a second
learning-rate cycle on fresh scenes aimed at the shape (more of the shapes drawn worst, the
object's pixels and the noisy timesteps weighted), and a LoRA on the text encoder that makes the
prompt's object green.
Data, noise and order all come from `--seed`; with the same seed and `--threads` a run writes
the same bytes.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from serve_app import shapes
from serve_app.engine.builtin import GREEN_LORA, WEIGHTS, add_grid_positions, load_shapes

MAX_TOKENS = 24
LATENT_CHANNELS = 4
TE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


# ---------------------------------------------------------------------------- the model


def _words() -> list[str]:
    words = {"a", "on", "background", ",", *shapes.COLOURS, *shapes.SHAPES, *shapes.SIZES}
    for p in shapes.POSITIONS:
        words.update(p.split())
    return sorted(words)


def build_tokenizer(directory: Path):
    """A CLIP tokenizer whose BPE merges make every word of the grammar one token; any other
    text still tokenizes, character by character (the base vocabulary is printable ASCII)."""
    from transformers import CLIPTokenizer

    chars = [chr(c) for c in range(33, 127)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    # BPE learning on the grammar's words: merge the most frequent adjacent pair until every
    # word is one symbol. Encoding replays merges in this order, so each word comes back whole.
    corpus = {w: list(w[:-1]) + [w[-1] + "</w>"] for w in _words()}
    merges: list[tuple[str, str]] = []
    while any(len(s) > 1 for s in corpus.values()):
        pairs = collections.Counter(p for s in corpus.values() for p in zip(s, s[1:], strict=False))
        best = min(pairs, key=lambda p: (-pairs[p], p))  # ties broken by name: deterministic
        merges.append(best)
        joined = best[0] + best[1]
        vocab.setdefault(joined, len(vocab))
        for w, s in corpus.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            corpus[w] = out
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return CLIPTokenizer(
        str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=MAX_TOKENS
    )


def build_pipeline(seed: int):
    """The untrained pipeline: every part at its initial weights, drawn from `seed`."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as d:
        tok = build_tokenizer(Path(d))
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=MAX_TOKENS,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    # Token embeddings drawn large (std 1, not CLIP's 0.02): each word then dominates its own
    # position's output from the first step. With CLIP's initialisation the words late in a
    # prompt (the place) were drowned by attention and the UNet never learned to use them.
    with torch.no_grad():
        text.get_input_embeddings().weight.normal_(0.0, 1.0)
    vae = AutoencoderKL(
        block_out_channels=[16, 32],
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=LATENT_CHANNELS,
        layers_per_block=1,
        sample_size=shapes.SIZE,
        mid_block_add_attention=False,
        norm_num_groups=8,
    )
    unet = UNet2DConditionModel(
        sample_size=shapes.SIZE // 2,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        block_out_channels=(32, 64, 96),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64,
        attention_head_dim=8,
        norm_num_groups=16,
    )
    add_grid_positions(unet)
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        timestep_spacing="trailing",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=tok,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


# ---------------------------------------------------------------------------- the data


def _prompt(scene: shapes.Scene, rng: np.random.Generator, name_small: bool = False) -> str:
    """The scene's prompt with parts left out at random, so short prompts leave choices open.
    `name_small`: a small object's prompt always says so (a prompt without a size then means
    a large object)."""
    if rng.random() < 0.1:
        return ""  # the unconditional prompt of classifier-free guidance
    parts = _parts(rng)
    if name_small and scene.size == "small":
        parts["size"] = True
    return scene.prompt(**parts)


def _parts(rng: np.random.Generator) -> dict[str, bool]:
    """Which optional parts a training prompt names: background and place 80%, size 50%."""
    return {"background": rng.random() > 0.2, "position": rng.random() > 0.2, "size": rng.random() > 0.5}


def make_scenes(n: int, rng: np.random.Generator, keep: dict[str, float] | None = None
                ) -> tuple[list[shapes.Scene], torch.Tensor]:  # fmt: skip
    """`n` training scenes (held-out colour-shape pairs never among them) and their images in
    [-1, 1], (n, 3, 64, 64). `keep`: the share of the grammar's scenes of each shape that are
    kept (default 1), to draw some shapes more often."""
    scenes = []
    while len(scenes) < n:
        scene = shapes.random_scene(rng)
        if keep is None or rng.random() < keep.get(scene.shape, 1.0):
            scenes.append(scene)
    pixels = np.stack([shapes.render(s) for s in scenes])
    return scenes, torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1


def _object_weight(images: torch.Tensor, extra: float = 7.0) -> torch.Tensor:
    """Per-pixel loss weight: the object's pixels (far from the corner's colour) count 1 + `extra` times."""
    corner = images[:, :, :1, :1]
    far = (images - corner).abs().sum(1, keepdim=True) > 0.2
    return 1 + extra * far.float()


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
    right = [shapes.read_image(p).shape == s.shape for p, s in zip(pixels, scenes, strict=True)]
    report = {"all": float(np.mean(right))}
    for name in shapes.SHAPES:
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


def _encode_prompts(pipe, prompts: list[str]) -> torch.Tensor:
    ids = pipe.tokenizer(
        prompts, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt"
    ).input_ids
    return pipe.text_encoder(ids)[0]


@torch.no_grad()
def encode_latents(pipe, images: torch.Tensor) -> torch.Tensor:
    """The images' latent means, scaled by the VAE's scaling factor."""
    out = [pipe.vae.encode(images[i : i + 256]).latent_dist.mean for i in range(0, len(images), 256)]
    return torch.cat(out) * pipe.vae.config.scaling_factor


def train_text_to_image(pipe, latents: torch.Tensor, scenes: list[shapes.Scene], steps: int, batch: int,
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
            scene = shapes.random_scene(rng)
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


def save_pipeline(pipe, directory: Path) -> None:
    """The pipeline as a diffusers folder of float16 safetensors (it loads as float32), with no
    trace of where it was loaded from (diffusers records the path in each config)."""
    pipe.to(torch.float16).save_pretrained(directory, safe_serialization=True)
    pipe.to(torch.float32)
    for f in directory.rglob("*.json"):
        config = json.loads(f.read_text())
        if isinstance(config, dict) and config.pop("_name_or_path", None) is not None:
            f.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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


# ---------------------------------------------------------------------------- evaluation


def generate(pipe, prompts: list[str], seeds: list[int], steps: int = 20, guidance: float = 4.0, **kw):
    """Images for (prompt, seed) pairs, as (64, 64, 3) uint8 arrays."""
    out = []
    for p, s in zip(prompts, seeds, strict=True):
        g = torch.Generator().manual_seed(s)
        kw |= {"height": 64, "width": 64, "generator": g}
        im = pipe(p, num_inference_steps=steps, guidance_scale=guidance, **kw)
        out.append(np.asarray(im.images[0]))
    return out


def evaluate(pipe, n: int = 40, guidance: float = 4.0) -> dict[str, dict[str, float]]:
    """The checker's accuracy on the model's images of `n` full prompts each from the training
    distribution and from held-out colour-shape pairs."""
    report = {}
    for name, held in (("train", False), ("held_out", True)):
        rng = np.random.default_rng(777 + held)
        scenes = [shapes.random_scene(rng, held_out=held) for _ in range(n)]
        images = generate(pipe, [s.prompt() for s in scenes], list(range(n)), guidance=guidance)
        hits = collections.Counter()
        for s, im in zip(scenes, images, strict=True):
            r = shapes.read_image(im)
            got = {"colour": r.colour == s.colour, "shape": r.shape == s.shape}
            got |= {"position": r.position == s.position, "background": r.background == s.background}
            got["all"] = all(got.values())
            hits.update(k for k, v in got.items() if v)
        report[name] = {k: hits[k] / n for k in ("colour", "shape", "position", "background", "all")}
    return report


def sheet(pipe, path: Path, guidance: float = 4.0) -> None:
    """A grid of samples: one row per shape, one prompt per column (seed 0 each), 4x enlarged."""
    rng = np.random.default_rng(5)
    prompts = [
        shapes.random_scene(rng, held_out=col >= 5).prompt() for _ in shapes.SHAPES for col in range(6)
    ]
    images = generate(pipe, prompts, [0] * len(prompts), guidance=guidance)
    grid = np.concatenate([np.concatenate(images[r * 6 : r * 6 + 6], 1) for r in range(len(shapes.SHAPES))])
    from PIL import Image

    Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(path)
    print(f"wrote {path}: " + "; ".join(prompts))


def step_time(pipe, other, steps: int = 20, rounds: int = 5) -> tuple[float, float]:
    """Median seconds per denoising step of `pipe` and `other` at 64x64, guidance on, taken in
    alternating rounds so that both see the same machine."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(rounds):
        for k, p in enumerate((pipe, other)):
            t0 = time.perf_counter()
            p("a red circle", num_inference_steps=steps, guidance_scale=4.0, height=64, width=64)
            times[k].append((time.perf_counter() - t0) / steps)
    return float(np.median(times[0])), float(np.median(times[1]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m serve_app.train_tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(WEIGHTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scenes", type=int, default=6000)
    ap.add_argument("--vae-steps", type=int, default=800)
    ap.add_argument("--unet-steps", type=int, default=1500)
    ap.add_argument("--shape-steps", type=int, default=2100)
    ap.add_argument("--lora-steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--shape-only", action="store_true", help="the shape cycle (then the adapter) only")
    ap.add_argument("--lora-only", action="store_true")
    ap.add_argument("--evaluate", action="store_true", help="read the saved model's images with the checker")
    ap.add_argument("--guidance", type=float, default=4.0, help="of --evaluate and --sheet")
    ap.add_argument("--sheet", help="write a grid of samples to this PNG")
    args = ap.parse_args(argv)
    if args.evaluate or args.sheet:
        torch.set_num_threads(args.threads)
        pipe = load_shapes(Path(args.out) / "shapes")
        pipe.set_progress_bar_config(disable=True)
        if args.sheet:
            sheet(pipe, Path(args.sheet), args.guidance)
        if args.evaluate:
            print(json.dumps(evaluate(pipe, guidance=args.guidance), indent=1))
            from serve_app.engine.builtin import build_builtin

            tiny = build_builtin("tiny-sd")
            tiny.set_progress_bar_config(disable=True)
            mine, theirs = step_time(pipe, tiny)
            print(f"step time at 64x64: shapes {mine * 1e3:.1f} ms, tiny-sd {theirs * 1e3:.1f} ms")
    elif args.shape_only:
        later_stages(args)
    elif args.lora_only:
        lora_only(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
