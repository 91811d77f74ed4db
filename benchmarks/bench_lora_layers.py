"""What a LoRA costs per layer type: base layer, merged adapter, one unmerged adapter, a batch
with a different adapter per row as the engine runs it when requests with different adapters
share a call (`serve_app.engine.row_lora`: gathered per-row weights, batched products), and
the same batch through PEFT's own mixed batches (`adapter_names`, one sub-batch per adapter).
Same process, same shapes, one run.

    python benchmarks/bench_lora_layers.py                     # CPU
    python benchmarks/bench_lora_layers.py --device cuda --scale 2

Layer shapes are those of an SD-1.5 UNet block at 512 px divided by `--div` (CPU default 2):
a linear layer (an attention projection or feed-forward) over a (batch, tokens, channels)
input, and a 3x3 convolution over (batch, channels, height, width). Prints milliseconds per
call and the ratio to the base layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


def timed(fn, iters: int, sync) -> float:
    for _ in range(2):
        fn()
    sync()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--div", type=int, default=2, help="divide the SD-1.5 shapes by this")
    ap.add_argument("--batch", type=int, default=8, help="rows (images) in the call")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    from peft import LoraConfig, get_peft_model

    from serve_app.engine.row_lora import apply_row_adapters

    torch.manual_seed(0)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    c, side = 320 // a.div, 64 // a.div
    cases = {
        "linear (attention projection)": (nn.Linear(c, c), torch.randn(a.batch, side * side, c)),
        "conv 3x3": (nn.Conv2d(c, c, 3, padding=1), torch.randn(a.batch, c, side, side)),
    }
    names = [f"t{i}" for i in range(a.batch)]
    print(f"{a.device}, batch {a.batch}, rank {a.rank}, channels {c}, {side}x{side}")
    head = f"{'base':>9}{'merged':>9}{'1 adapter':>11}{'per-row':>10}{'peft-mix':>10}"
    print(f"{'layer':<32}{head}   ratios to base")
    with torch.no_grad():
        for label, (layer, x) in cases.items():
            model = nn.Sequential()
            model.add_module("layer", layer)
            x = x.to(dev)
            cfg = LoraConfig(r=a.rank, lora_alpha=a.rank, target_modules=["layer"], init_lora_weights=False)
            peft_model = get_peft_model(model.to(dev), cfg, adapter_name=names[0])
            for n in names[1:]:
                peft_model.add_adapter(n, cfg)
            peft_model.eval()
            lora_layer = peft_model.base_model.model.layer
            base = timed(lambda: lora_layer.base_layer(x), a.iters, sync)  # noqa: B023
            peft_model.set_adapter(names[0])
            one = timed(lambda: peft_model(x), a.iters, sync)  # noqa: B023
            peft_mixed = timed(lambda: peft_model(x, adapter_names=names), a.iters, sync)  # noqa: B023
            undo = apply_row_adapters(peft_model, [((n, 1.0),) for n in names])
            try:
                mixed = timed(lambda: peft_model(x), a.iters, sync)  # noqa: B023
            finally:
                undo()
            peft_model.merge_adapter()
            merged = timed(lambda: peft_model(x), a.iters, sync)  # noqa: B023
            peft_model.unmerge_adapter()
            ratios = (
                f"merged {merged / base:.2f}x, one {one / base:.2f}x, per-row {mixed / base:.2f}x, "
                f"peft-mix {peft_mixed / base:.2f}x"
            )
            times = f"{base:>9.2f}{merged:>9.2f}{one:>11.2f}{mixed:>10.2f}{peft_mixed:>10.2f}"
            print(f"{label:<32}{times}   {ratios}")


if __name__ == "__main__":
    main()
