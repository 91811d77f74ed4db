"""Alias: `serve_app.proxy:middlewares`, the documented value of Serve's proxy callback
(`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`: the Dockerfile, docs/deploying.md and
`diffusion-serve serve` set it). The guard itself is `serve_app.ingress.proxy`; this module
stays as light as it, since every Serve proxy imports it when it starts."""

from serve_app.ingress.proxy import middlewares

__all__ = ["middlewares"]
