"""The embedded model `builtin:shapes` (docs/shapes-model.md): the scenes it learns from and
its trainer, outside the request path (the engine loads its weights from `engine/weights/`).

* `scenes`: the grammar of scenes (a shape, its colour, size and place, the background), their
  prompts and pixels, and the checker that reads a scene back from an image;
* `model`: the untrained pipeline (tokenizer, text encoder, VAE, UNet, scheduler) and how it is saved;
* `data`: the training scenes, their prompts and latents;
* `stages`: the training stages, each printing its loss, and the runs that chain them;
* `evaluation`: the checker's reading of a trained model, a sheet of samples, its step time;
* `train`: the command line, `python -m serve_app.train_tiny` (or `python -m serve_app.shapes.train`).
"""
