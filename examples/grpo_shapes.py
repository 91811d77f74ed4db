"""GRPO on the embedded model: a trainer and the server on one Ray cluster (docs/rollouts.md).

The server serves `builtin:shapes`; the trainer holds its own copy of the same UNet with a LoRA.
Each step:
1. for a few prompts of the model's training distribution, the trainer asks the server by handle
   for a group of rollouts (`n` seeds, DDIM with eta 1 under the current LoRA version): each
   image with its trajectory and the per-step log-probabilities the server computed;
2. it scores each image with the project's shape-and-colour checker (`serve_app.shapes.scenes`:
   the share of colour, shape, place and background that match the prompt) and turns the
   scores into advantages within each group (GRPO);
3. it recomputes each step's log-probability under its own LoRA from the returned trajectory
   (on the first step this equals the server's: the parity printed), takes the clipped policy
   gradient, and pushes the new LoRA to every replica (`push_lora`): the next rollouts carry the
   next `policy_version`, which the trainer checks.
Before the first step and after the last it measures the mean reward on fixed held prompts and
seeds, both sampled as in training and plain (deterministic DDIM).

python examples/grpo_shapes.py                 # starts Ray and the app itself, on this machine
python examples/grpo_shapes.py --steps 2 --prompts 2 --group 4   # a quick look
"""

from __future__ import annotations

import argparse
import io
import json
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

ADAPTER = "grpo"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


@dataclass
class Settings:
    steps: int = 10  # GRPO updates
    prompts: int = 4  # prompts per update
    group: int = 8  # rollouts per prompt (GRPO's group)
    denoise_steps: int = 10
    guidance: float = 4.0
    eta: float = 1.0  # DDIM's noise: each step's transition is a Gaussian
    lr: float = 3e-4
    rank: int = 8
    clip: float = 0.2  # PPO-style ratio clip
    eval_prompts: int = 16
    eval_seeds: int = 2
    seed: int = 0


def served_args(root: str) -> dict:
    """The app this example starts: builtin:shapes on CPU, with a root for pushed adapters."""
    return {
        "model": {"source": "builtin:shapes", "device": "cpu", "dtype": "float32", "default_height": 64,
                  "default_width": 64},
        "replica": {"num_replicas": 1, "num_cpus": 0},
        "ingress": {"num_cpus": 0},
        "batching": {"max_batch_images": 16},
        "limits": {"max_images": 16},
        "lora": {"registry_path": f"{root}/registry.json", "allowed_roots": [root]},
        "jobs": {"store": f"{root}/store"},
    }  # fmt: skip


def reward(png: bytes, scene) -> float:
    """The checker's share of the prompt's parts the image shows (0 to 1)."""
    from PIL import Image

    from serve_app.shapes.scenes import read_image

    r = read_image(Image.open(io.BytesIO(png)))
    hits = (r.colour == scene.colour, r.shape == scene.shape, r.position == scene.position,
            r.background == scene.background)  # fmt: skip
    return float(np.mean(hits))


class Trainer:
    """The policy: the shapes UNet with a LoRA (zero at first, so version 1 is the base model)."""

    def __init__(self, s: Settings):
        from diffusers import DDIMScheduler
        from peft import LoraConfig

        from serve_app.engine.builtin import load_shapes

        torch.manual_seed(s.seed)
        self.s = s
        self.pipe = load_shapes()
        self.unet = self.pipe.unet
        self.unet.requires_grad_(False)
        self.unet.add_adapter(LoraConfig(r=s.rank, lora_alpha=s.rank, target_modules=TARGETS))
        self.params = [p for n, p in self.unet.named_parameters() if "lora_" in n]
        for p in self.params:
            p.requires_grad_(True)
        self.opt = torch.optim.Adam(self.params, lr=s.lr)
        self.sched = DDIMScheduler.from_config(self.pipe.scheduler.config)
        self.sched.set_timesteps(s.denoise_steps)

    def weights(self) -> dict[str, torch.Tensor]:
        """The LoRA as the server loads it (diffusers' names: `unet.` + peft's)."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.unet)
        return {f"unet.{k}": v.detach().clone().contiguous() for k, v in state.items()}

    @torch.no_grad()
    def _embeds(self, prompt: str, rows: int) -> torch.Tensor:
        cond, uncond = self.pipe.encode_prompt(prompt, "cpu", 1, True)
        return torch.cat([uncond.expand(rows, -1, -1), cond.expand(rows, -1, -1)])

    def step_log_prob(self, emb, x, x_next, t: float) -> torch.Tensor:
        """Per row: the log-probability of the transition x -> x_next under the LoRA policy
        (the guided v-prediction, DDIM's mean at eta, its std), as the server computes it."""
        from serve_app.engine.rollout import gaussian_log_prob

        t = int(round(t))
        v_uncond, v_cond = self.unet(torch.cat([x, x]), t, encoder_hidden_states=emb).sample.chunk(2)
        v = v_uncond + self.s.guidance * (v_cond - v_uncond)
        mean = self.sched.step(v, t, x, eta=self.s.eta, variance_noise=torch.zeros_like(x)).prev_sample
        prev_t = t - self.sched.config.num_train_timesteps // self.sched.num_inference_steps
        std = self.s.eta * float(self.sched._get_variance(t, prev_t)) ** 0.5
        return gaussian_log_prob(x_next, mean, std)

    def update(self, groups: list[tuple[str, object, np.ndarray]]) -> dict[str, float]:
        """One clipped policy-gradient step over the groups (prompt, result, advantages); the
        largest gap between the server's log-probabilities and this policy's before the update."""
        self.opt.zero_grad()
        gap, terms = 0.0, sum(len(r.trajectory.stochastic_steps) for _, r, _ in groups)
        for prompt, result, adv in groups:
            traj = result.trajectory
            states = [traj.start.to_torch(), *(x.to_torch() for x in traj.latents)]
            old = traj.log_probs.to_torch()
            emb, adv = self._embeds(prompt, len(adv)), torch.as_tensor(adv, dtype=torch.float32)
            for k, i in enumerate(traj.stochastic_steps):
                new = self.step_log_prob(emb, states[i], states[i + 1], traj.timesteps[i])
                gap = max(gap, float((new.detach() - old[:, k]).abs().max()))
                ratio = torch.exp(new - old[:, k])
                clipped = torch.clamp(ratio, 1 - self.s.clip, 1 + self.s.clip)
                loss = -torch.minimum(ratio * adv, clipped * adv).mean() / terms
                loss.backward()  # step by step: one step's graph at a time
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, 1.0))
        self.opt.step()
        return {"log_prob_gap": gap, "grad_norm": norm}


def _scenes(rng, n: int):
    from serve_app.shapes.scenes import random_scene

    return [random_scene(rng) for _ in range(n)]


def _ask(handle, s: Settings, scene, seed: int, n: int, rollout: bool):
    body = {"prompt": scene.prompt(), "seed": seed, "num_images": n, "width": 64, "height": 64,
            "num_inference_steps": s.denoise_steps, "guidance_scale": s.guidance,
            "lora": {"name": ADAPTER}}  # fmt: skip
    if rollout:
        body["rollout"] = {"sampler": "ddim", "noise_level": s.eta}
    return handle.generate.remote(body)


def evaluate(handle, s: Settings) -> dict[str, float]:
    """Mean reward on fixed prompts and seeds: sampled as in training, and plain."""
    scenes = _scenes(np.random.default_rng(10_000 + s.seed), s.eval_prompts)
    out = {}
    for name, rollout in (("rollout", True), ("plain", False)):
        calls = [_ask(handle, s, sc, 1000 + i * 10, s.eval_seeds, rollout) for i, sc in enumerate(scenes)]
        rewards = [
            reward(png, sc) for sc, call in zip(scenes, calls, strict=True) for png in call.result().images
        ]
        out[name] = float(np.mean(rewards))
    return out


def train(handle, s: Settings, log=print) -> dict:
    """GRPO against the app behind `handle`; returns the report (rewards, timings, versions)."""
    trainer = Trainer(s)
    version = handle.push_lora.remote(ADAPTER, trainer.weights()).result()["version"]
    report = {"settings": asdict(s), "before": evaluate(handle, s), "steps": []}
    log(f"reward before: {report['before']}")
    rng = np.random.default_rng(s.seed)
    for step in range(1, s.steps + 1):
        t0 = time.perf_counter()
        scenes = _scenes(rng, s.prompts)
        calls = [_ask(handle, s, sc, int(rng.integers(1 << 30)), s.group, True) for sc in scenes]
        results = [c.result() for c in calls]
        if any(r.policy_version != version for r in results):
            raise RuntimeError(f"rollouts of version {[r.policy_version for r in results]}, pushed {version}")
        groups, rewards = [], []
        for sc, r in zip(scenes, results, strict=True):
            got = np.array([reward(png, sc) for png in r.images])
            rewards.append(got.mean())
            groups.append((sc.prompt(), r, (got - got.mean()) / (got.std() + 1e-4)))
        t1 = time.perf_counter()
        stats = trainer.update(groups)
        t2 = time.perf_counter()
        version = handle.push_lora.remote(ADAPTER, trainer.weights()).result()["version"]
        t3 = time.perf_counter()
        row = {"step": step, "reward": float(np.mean(rewards)), **stats, "policy_version": version,
               "rollout_s": t1 - t0, "train_s": t2 - t1, "push_s": t3 - t2}  # fmt: skip
        report["steps"].append(row)
        log(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    report["after"] = evaluate(handle, s)
    report["step_s"] = float(np.mean([r["rollout_s"] + r["train_s"] + r["push_s"] for r in report["steps"]]))
    log(f"reward after: {report['after']}; {report['step_s']:.2f} s per step")
    return report


def main(argv: list[str] | None = None) -> None:
    import tempfile

    import ray
    from ray import serve

    from serve_app.app import build_app

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field, default in asdict(Settings()).items():
        ap.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    ap.add_argument("--out", help="write the report (JSON) here")
    args = vars(ap.parse_args(argv))
    out = args.pop("out")
    s = Settings(**args)
    ray.init(log_to_driver=False)
    root = tempfile.mkdtemp(prefix="grpo-shapes-")
    handle = serve.run(build_app(served_args(root)), name="grpo-shapes", route_prefix="/grpo")
    try:
        report = train(handle, s)
    finally:
        serve.shutdown()
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
