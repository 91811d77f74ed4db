"""Weight files: what a file is, the checks before one is loaded, and the converters between
the community's layouts and diffusers'.

* `layouts`: what a weights file is, from its first bytes and its header (no torch: the ingress
  checks files with it), and the family of a pipeline class;
* `sources`: the allowed roots, paths as callers may see them, and the checks on a checkpoint's
  source (a diffusers directory, a single file, a hub id) before it is registered;
* `lora`: community LoRA files: the checks on an adapter file or directory, the kohya (A1111)
  converter, and the writer of diffusers/peft adapters;
* `single_file_load`: a pipeline from one checkpoint file in the original layout;
* `single_file_write`: a pipeline written as one such file;
* `flux_file`: FLUX's transformer in Black Forest Labs' layout, both ways.

This package never imports the engine, the replica, the ingress or Ray (tests/test_layout.py):
what it needs of the embedded models (their configs, a built pipeline) is passed in by its
caller. The engine loads files through it; the ingress checks them with it.
"""
