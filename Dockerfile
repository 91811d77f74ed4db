# The image of every pod of the KubeRay RayService (deploy/kubernetes/rayservice.yaml): a CUDA
# runtime, Python, and this project installed by the README's own command. No model weights are
# baked in: replicas download them when they start, into HF_HOME (the shared volume).
#
#   docker build -t registry.example.com/diffusion-serve:0.1.0 .
#   docker build --build-arg EXTRA_PIP="s3fs" ...     # a store or registry on s3:// (gcsfs: gs://)
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ARG EXTRA_PIP=""
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# KubeRay starts Ray with bash and (for older probes) wget; the hub downloads need CA certificates.
# The pods run as uid 1000 (the base's own user of that uid, ubuntu, makes way).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv bash wget ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --create-home --uid 1000 ray

USER ray
WORKDIR /home/ray/diffusion-serve
COPY --chown=ray:ray pyproject.toml README.md ./
COPY --chown=ray:ray serve_app ./serve_app
COPY --chown=ray:ray configs ./configs
COPY --chown=ray:ray serve_config.yaml ./

# The README's install (its first command, before it starts the service). On PyPI's Linux index
# the pinned torch is a CUDA build.
RUN python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e .
RUN if [ -n "$EXTRA_PIP" ]; then .venv/bin/pip install $EXTRA_PIP; fi

# Ray reads the proxy callback when it starts on a node, as in the README's commands.
ENV PATH=/home/ray/diffusion-serve/.venv/bin:$PATH \
    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=serve_app.proxy:middlewares \
    RAY_USAGE_STATS_ENABLED=0
EXPOSE 8000 8265 6379 10001 8080
CMD ["serve", "run", "serve_config.yaml"]
