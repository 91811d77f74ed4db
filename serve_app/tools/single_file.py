"""Write a diffusers pipeline as one checkpoint file in the original ("LDM") layout, the layout
of the single-file checkpoints A1111, ComfyUI and model sites share:

    python -m serve_app.single_file builtin:tiny-sd tiny-sd.safetensors
    python -m serve_app.single_file ./my-sdxl-pipeline my-sdxl.safetensors
    python -m serve_app.single_file builtin:tiny-flux tiny-flux-Q4_0.gguf --quant Q4_0

Stable Diffusion 1.x, SDXL, SD3, FLUX and Wan (their transformers alone) pipelines; the layouts
are serve_app/formats/single_file_write.py's. A `.gguf` name writes a FLUX or Wan transformer as GGUF,
quantized in `--quant` (default Q8_0). (`python -m serve_app.tools.single_file` is the same
command.)
"""

from __future__ import annotations

import argparse

from serve_app.formats.single_file_write import write_gguf, write_single_file


def _load(source: str):
    if source.startswith("builtin:"):
        from serve_app.engine.builtin import build_builtin

        return build_builtin(source.removeprefix("builtin:"))
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(source, local_files_only=True, use_safetensors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m serve_app.single_file", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="builtin:<name> or a local diffusers pipeline directory")
    ap.add_argument("out", help="the .safetensors (or, for FLUX and Wan, .gguf) file to write")
    ap.add_argument("--quant", default="Q8_0", help="a .gguf file's type: Q8_0, Q5_0, Q4_0, ...")
    a = ap.parse_args(argv)
    if a.out.endswith(".gguf"):
        print(write_gguf(_load(a.source), a.out, a.quant))
    else:
        print(write_single_file(_load(a.source), a.out))


if __name__ == "__main__":
    main()
