"""Call the running app from Python through a Serve handle (start it with `serve run serve_config.yaml`).

python examples/client.py
"""

import ray
from ray import serve

from serve_app.errors import InvalidRequest
from serve_app.schemas import BatchGenerationRequest, GenerationRequest


def main() -> None:
    ray.init(address="auto", log_to_driver=False)
    handle = serve.get_app_handle("diffusion")

    result = handle.generate.remote(
        GenerationRequest(prompt="a red fox in the snow", seed=3, num_images=2)
    ).result()
    for i, image in enumerate(result.pil_images()):
        image.save(f"fox-{i}.png")
    print(f"{result.request_id}: seeds {result.seeds}, denoise {result.metrics.denoise_ms:.0f} ms")

    batch = handle.generate_batch.remote(BatchGenerationRequest(prompts=["a cat", "a dog"], seed=1)).result()
    print(f"batch: {len(batch.images)} images, prompt_index {batch.prompt_index}")

    try:
        handle.generate.remote(GenerationRequest(prompt="too big", width=4096)).result()
    except InvalidRequest as e:
        print(f"refused as expected ({e.status_code}, {e.param}): {e.message}")


if __name__ == "__main__":
    main()
