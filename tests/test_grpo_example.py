"""examples/grpo_shapes.py as a trainer beside the served `builtin:shapes` (issue 57): its GRPO
steps run against a real app by handle, each rollout comes from the version just pushed, the
trainer's log-probabilities of the returned trajectories equal the server's, and a trainer that
computes them otherwise is caught."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import deployed

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo_shapes.py"


@pytest.fixture(scope="module")
def grpo():
    spec = importlib.util.spec_from_file_location("grpo_shapes", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_the_grpo_example_trains_a_lora_against_the_served_shapes_model(ray_cluster, grpo):
    from ray import serve

    model = {"source": "builtin:shapes", "default_height": 64, "default_width": 64}
    s = grpo.Settings(steps=2, prompts=2, group=4, denoise_steps=4, eval_prompts=2, eval_seeds=2, lr=1e-2)
    with deployed("grpo", model=model, limits={"max_images": 8}):
        handle = serve.get_app_handle("grpo")
        try:
            report = grpo.train(handle, s, log=lambda *_: None)
            # The same check with a trainer that guides otherwise than the server: it is caught.
            wrong = grpo.Trainer(grpo.Settings(**{**vars(s), "guidance": s.guidance - 1.0}))
            scene = grpo._scenes(np.random.default_rng(3), 1)[0]
            result = grpo._ask(handle, s, scene, 5, 2, True).result()
            gap = wrong.update([(scene.prompt(), result, [1.0, -1.0])])["log_prob_gap"]
        finally:
            handle.remove_lora.remote(grpo.ADAPTER).result()
    first = report["steps"][0]["policy_version"]
    assert [r["policy_version"] for r in report["steps"]] == [first, first + 1], report["steps"]
    assert all(r["log_prob_gap"] < 1e-4 for r in report["steps"]), report["steps"]  # trainer == server
    assert gap > 1e-3, gap
    assert any(r["grad_norm"] > 0 for r in report["steps"]), report["steps"]  # some group had a signal
    for key in ("before", "after"):
        assert set(report[key]) == {"rollout", "plain"} and all(0 <= v <= 1 for v in report[key].values())
    assert report["step_s"] > 0
