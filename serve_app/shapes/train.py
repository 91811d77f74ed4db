"""Train `builtin:shapes`: a tiny Stable-Diffusion pipeline that draws the scenes of
`serve_app.shapes.scenes` from their prompts, trained from a seed on a CPU (docs/shapes-model.md).

    python -m serve_app.train_tiny                  # all stages; writes serve_app/engine/weights/
    python -m serve_app.train_tiny --evaluate       # the checker's reading of the saved model
    python -m serve_app.train_tiny --lora-only      # only the green adapter, on the saved pipeline

Stages, each printing its loss: the VAE (64x64 RGB <-> 4x32x32 latents), the UNet with the text
encoder (v-prediction, zero-terminal-SNR schedule, the EMA of the weights is kept), a second
learning-rate cycle on fresh scenes aimed at the shape (more of the shapes drawn worst, the
object's pixels and the noisy timesteps weighted), and a LoRA on the text encoder that makes the
prompt's object green.
Data, noise and order all come from `--seed`; with the same seed and `--threads` a run writes
the same bytes. (`python -m serve_app.shapes.train` is the same command.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from serve_app.engine.builtin import WEIGHTS, load_shapes
from serve_app.shapes.evaluation import evaluate, sheet, step_time
from serve_app.shapes.stages import later_stages, lora_only, train


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
