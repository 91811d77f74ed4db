"""The trainer of `builtin:shapes` (docs/shapes-model.md), outside the request path; its command
line is `python -m serve_app.train_tiny`.

* `model`: the untrained pipeline (tokenizer, text encoder, VAE, UNet, scheduler) and how it is saved;
* `data`: the training scenes, their prompts and latents;
* `stages`: the training stages, each printing its loss, and the runs that chain them;
* `evaluation`: the checker's reading of a trained model, a sheet of samples, its step time.
"""
