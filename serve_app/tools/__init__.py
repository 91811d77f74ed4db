"""The operator's tools, outside the request path: nothing the app serves with imports them
(tests/test_layout.py).

* `cli`: `diffusion-serve`, the console client of a running server, and `diffusion-serve serve`,
  which starts one (`serve run` with the proxy guard set);
* `check`: a model checked before it is deployed (`python -m serve_app.check`);
* `kube`: the KubeRay manifest's Serve config, written from a `configs/` file (`python -m serve_app.kube`);
* `lora`: adapters to try the server with (`python -m serve_app.lora`);
* `single_file`: a pipeline written as one checkpoint file (`python -m serve_app.single_file`).
"""
