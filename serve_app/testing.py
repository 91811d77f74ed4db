"""Helpers for tests and demos that ship with the package (replicas must be able to import them)."""

from __future__ import annotations

import functools
import os
import re
import tempfile
import threading
import time
from types import SimpleNamespace

import torch

from serve_app.engine import exported, rpc_methods
from serve_app.engine.loading import find_denoiser

OOM_MARKER = "[[inject-oom]]"
FAIL_MARKER = "[[inject-failure]]"
FATAL_MARKER = "[[inject-fatal-device-error]]"
SLOW_MARKER = "[[slow]]"  # each step of a call holding it takes 0.1 s more
FATAL_ERROR = "CUDA error: an illegal memory access was encountered (injected)"


class FaultInjection:
    """Engine extension: a prompt that carries a marker makes the engine raise that fault.

    Use with `model.engine_extension: serve_app.testing:FaultInjection`. Only the fault is fake;
    every other request runs the real pipeline. Faults of the engine itself (not of a request)
    are armed through collective RPC.
    """

    _broken: bool = False
    _fatal_token: str | None = None
    _fault_left: bool = False  # the self-test after an injected failure fails too

    @exported
    def ping(self, value=None):
        """A worker-extension method for collective RPC tests: answers from this engine."""
        return {"pong": value, "model": self.model_name}

    @exported
    def set_broken(self, broken: bool = True) -> bool:
        """Every call fails from now on (a broken engine, unlike a bad request), or works again."""
        self._broken = bool(broken)
        return self._broken

    @exported
    def arm_fatal_once(self, token: str) -> None:
        """The first engine that claims the token file `fault_token_path(token)` (by deleting it)
        raises a fatal device error on its next call: broadcast to every replica, one breaks."""
        self._fatal_token = fault_token_path(token)

    def run(self, rows, params, step_hook=None):
        self._inject(rows)
        return super().run(rows, params, _slowed(rows, step_hook))

    def run_paused(self, rows, params, step_hook=None):  # a call that preempts another
        self._inject(rows)
        return super().run_paused(rows, params, _slowed(rows, step_hook))

    def _row_call(self, rows, params, step_hook, stand_in):  # a seat's part of a joined call
        self._inject(rows)
        return super()._row_call(rows, params, _slowed(rows, step_hook), stand_in)

    def _inject(self, rows) -> None:
        """Raise the fault the engine is armed with or a row's prompt asks for, if any."""
        if self._broken:
            raise RuntimeError("injected broken engine")
        if self._fatal_token is not None:
            token, self._fatal_token = self._fatal_token, None
            try:
                os.remove(token)
            except OSError:
                pass  # another replica claimed it
            else:
                raise RuntimeError(FATAL_ERROR)
        for row in rows:
            if OOM_MARKER in row.prompt:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
            if FAIL_MARKER in row.prompt:
                # An engine fault, not the request's: the self-test that judges it fails too
                # (replica/health.py), so it is a counted engine failure.
                self._fault_left = True
                raise RuntimeError("injected engine failure")
            if FATAL_MARKER in row.prompt:
                raise RuntimeError(FATAL_ERROR)

    def self_test(self):
        if self._broken or self._fault_left:
            self._fault_left = False
            raise RuntimeError("injected engine failure (the self-test)")
        return super().self_test()


class GpuShaped:
    """Engine extension: the denoiser costs what a GPU's does, asleep. Each denoiser call sleeps
    `step_ms + row_ms * rows` (rows of its batch: an image with classifier-free guidance is two)
    and returns zeros, so a fuller call is nearly free, as on a GPU, and takes no CPU; the image
    decoder costs nothing (grey images). The rest of the pipeline (text encoder, scheduler,
    joining, adapters, the serving path) is the real one.

    Use with `model.engine_extension: serve_app.testing:GpuShaped`; the shape comes from
    `DIFFUSION_SERVE_GPU_SHAPE="step_ms,row_ms"` (default 20,0.75: the H200's sd15 batch-8 gain
    of about 5.5x at 20 steps) or the `set_gpu_shape` RPC. It is what the batching policy is
    measured on (benchmarks/bench_batching.py); serving code does not know it is a fake.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        torch.set_num_threads(1)  # what is left is small: idle OpenMP threads would spin on a CPU
        step_ms, _, row_ms = os.environ.get("DIFFUSION_SERVE_GPU_SHAPE", "20,0.75").partition(",")
        self.set_gpu_shape(float(step_ms), float(row_ms or 0))
        self.denoiser_rows: list[int] = []  # rows of every denoiser call, in order
        self.denoiser_spans: list[tuple[float, float]] = []  # (start, end) of each, perf_counter
        denoiser = find_denoiser(self.pipe)
        denoiser.forward = functools.partial(_asleep, self, denoiser)
        vae = getattr(self.pipe, "vae", None)
        if vae is not None and getattr(self.pipe, "vae_scale_factor", None):
            vae.decode = functools.partial(_decoded, vae.decode, self.pipe.vae_scale_factor)

    @exported
    def set_gpu_shape(self, step_ms: float, row_ms: float) -> dict:
        """Each denoiser call sleeps `step_ms + row_ms * rows` from now on."""
        if not (0 <= step_ms <= 10_000 and 0 <= row_ms <= 10_000):
            raise ValueError("step_ms, row_ms: 0 to 10000")
        self._gpu_shape = (step_ms / 1e3, row_ms / 1e3)
        return {"step_ms": step_ms, "row_ms": row_ms}

    @exported
    def denoiser_calls(self, clear: bool = False) -> list[int]:
        """The rows of every denoiser call since the last clear (tests count calls and rows)."""
        out = list(self.denoiser_rows)
        if clear:
            self.denoiser_rows.clear()
            self.denoiser_spans.clear()
        return out

    @exported
    def device_busy(self) -> dict:
        """Since the last clear: denoiser calls, their mean rows, the fraction of the time from
        the first call's start to the last one's end that the "device" was busy, the mean host
        gap between calls, and how late on average a call came back past its sleep (the engine
        thread waiting for the GIL or a core after its "device" finished; by the shape now in
        force)."""
        spans = self.denoiser_spans
        if not spans:
            return {"calls": 0, "mean_rows": 0.0, "busy": 0.0, "mean_gap_ms": 0.0, "mean_late_ms": 0.0}
        busy = sum(b - a for a, b in spans)
        whole = spans[-1][1] - spans[0][0]
        gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
        step_s, row_s = self._gpu_shape
        rows = self.denoiser_rows[: len(spans)]  # a call in flight has its rows but no span yet
        late = [b - a - step_s - row_s * n for (a, b), n in zip(spans, rows, strict=True)]
        return {"calls": len(spans), "mean_rows": sum(self.denoiser_rows) / len(spans),
                "busy": busy / whole if whole > 0 else 1.0,
                "mean_gap_ms": 1e3 * sum(gaps) / len(gaps) if gaps else 0.0,
                "mean_late_ms": 1e3 * sum(late) / len(late)}  # fmt: skip


def _asleep(engine, denoiser, sample, *args, return_dict: bool = True, **kwargs):
    """A denoiser call that costs the GPU shape's time asleep and predicts zeros."""
    rows = sample.shape[0]
    engine.denoiser_rows.append(rows)
    step_s, row_s = engine._gpu_shape
    start = time.perf_counter()
    time.sleep(step_s + row_s * rows)
    engine.denoiser_spans.append((start, time.perf_counter()))
    channels = getattr(denoiser.config, "out_channels", None) or sample.shape[1]
    out = torch.zeros((rows, channels, *sample.shape[2:]), dtype=sample.dtype, device=sample.device)
    return SimpleNamespace(sample=out) if return_dict else (out,)


def _decoded(decode, factor: int, z, *args, return_dict: bool = True, **kwargs):
    """The image decoder at no cost (grey images) for image latents; video latents are decoded."""
    if z.dim() != 4:
        return decode(z, *args, return_dict=return_dict, **kwargs)
    out = torch.zeros(
        (z.shape[0], 3, z.shape[2] * factor, z.shape[3] * factor), dtype=z.dtype, device=z.device
    )
    return SimpleNamespace(sample=out) if return_dict else (out,)


class NeverReady:
    """Engine extension: the model's load never ends (it waits an hour, using no CPU), for tests
    of a model whose replicas are not ready while the application's other models serve."""

    def __init__(self, *args, **kwargs):
        time.sleep(3600)
        super().__init__(*args, **kwargs)


def _slowed(rows, step_hook):
    """`step_hook`, 0.1 s slower a step if a row holds SLOW_MARKER (a slow model)."""
    if step_hook is None or not any(SLOW_MARKER in row.prompt for row in rows):
        return step_hook

    def slow(i, total, latents):
        time.sleep(0.1)
        return step_hook(i, total, latents)

    return slow


def fault_token_path(token: str) -> str:
    """Where the token file of `arm_fatal_once` lives (only there: RPC arguments name no paths)."""
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", token):
        raise ValueError("token: 1-64 letters, digits or '-'")
    return os.path.join(tempfile.gettempdir(), f"diffusion-serve-fault-{token}")


class FakeEngine:
    """An engine without a model, for fast tests of everything around it (the scheduler,
    abort, health, batching): every image is a flat colour drawn from its row's seed, every
    step takes `step_s`, and faults come on demand. The real-engine tests prove the rest.

        DiffusionReplica(model_cfg, engine_factory=lambda cfg: FakeEngine(cfg, step_s=0.01))
    """

    def __init__(self, cfg, step_s: float = 0.005):
        self.cfg = cfg
        self.step_s = step_s
        self.model_name = cfg.served_name
        self.default_height = cfg.default_height or 16
        self.default_width = cfg.default_width or 16
        self.calls: list[int] = []  # rows of every pipeline call, in order
        self.broken = False  # every call and the self-test fail
        self.fail_next = 0  # the next n calls fail (a self-test after them works: their requests' fault)
        self.self_test_fails_next = 0  # the next n self-tests fail too (the engine's fault)
        self.self_tests = 0
        self.fatal_next = False  # the next call fails as a poisoned device does
        self.loras: set[str] = set()
        self.read_delay_s = 0.0  # each adapter read takes this long
        self.reads: list[tuple[str, str]] = []  # (thread name, path) of every adapter read

    def describe(self) -> dict:
        return {"model": self.model_name, "source": self.cfg.source, "pipeline": "FakePipeline",
                "default_height": self.default_height, "default_width": self.default_width,
                "default_steps": self.cfg.default_steps, "rpc_methods": rpc_methods(self)}  # fmt: skip

    def check_extra(self, extra: dict, task: str = "generate") -> dict:
        if "bogus" in extra:
            raise ValueError("extra: FakePipeline takes no argument 'bogus'")
        return dict(extra)

    def check_embeds(self, embeds, pooled=None, which: str = "") -> None:
        pass

    def takes(self, argument: str, task: str = "generate") -> bool:
        return False

    def check_options(
        self, generator_device, vae_slicing: bool, vae_tiling: bool, acceleration="none"
    ) -> None:
        pass

    def check_sampler(self, sampler, sigma_schedule):
        return sampler, sigma_schedule  # every image is a flat colour whatever samples it

    def check_rollout(self, sampler, noise_level, window, steps):
        raise ValueError("rollout: a fake engine has no rollouts (they are proven on the real engine)")

    def can_join(self, params) -> bool:
        return False  # whole calls only: joining is proven on the real engine

    def one_request_calls(self, params) -> bool:
        return False

    def can_pause(self, params) -> bool:
        return True  # its calls keep no state between steps but their own

    def run_paused(self, rows, params, step_hook=None):
        return self.run(rows, params, step_hook)

    def restore_adapters(self, rows, params) -> None:
        pass  # it puts no adapters in force

    def open_joined(self, params, adapters=()):
        raise NotImplementedError("FakeEngine runs whole calls only")

    def read_lora(self, path: str) -> dict:
        """A stand-in state whose size is the file's (so residency by bytes can be tested)."""
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        self.reads.append((threading.current_thread().name, path))
        return {"w": torch.zeros(os.path.getsize(path), dtype=torch.uint8)}

    def load_lora(self, name: str, path: str, state: dict | None = None) -> None:
        if state is None:
            self.read_lora(path)
        self.loras.add(name)

    def unload_lora(self, name: str) -> None:
        self.loras.discard(name)

    def self_test(self) -> None:
        self.self_tests += 1
        if self.broken or self.self_test_fails_next:
            self.self_test_fails_next = max(0, self.self_test_fails_next - 1)
            raise RuntimeError("injected broken engine")

    def run(self, rows, params, step_hook=None):
        from PIL import Image

        from serve_app.engine import EngineOutput

        self.calls.append(len(rows))
        if self.fatal_next:
            self.fatal_next = False
            raise RuntimeError(FATAL_ERROR)
        if self.broken or self.fail_next:
            self.fail_next = max(0, self.fail_next - 1)
            raise RuntimeError("injected engine failure")
        latents = torch.zeros(len(rows), 4, max(1, params.height // 8), max(1, params.width // 8))
        for i in range(params.steps):
            time.sleep(self.step_s)
            if step_hook is not None and step_hook(i, params.steps, latents):
                return EngineOutput(images=[], timings_ms=_FAKE_TIMINGS, peak_memory_mb=0.0,
                                    memory_kind="cpu_rss", steps_run=i + 1, interrupted=True)  # fmt: skip
        colour = lambda seed: (seed % 251, seed * 7 % 253, seed * 13 % 255)  # noqa: E731
        images = [Image.new("RGB", (params.width, params.height), colour(r.seed)) for r in rows]
        return EngineOutput(images=images, timings_ms=_FAKE_TIMINGS, peak_memory_mb=0.0,
                            memory_kind="cpu_rss", steps_run=params.steps)  # fmt: skip


_FAKE_TIMINGS = {"text_encode_ms": 0.0, "denoise_ms": 0.0, "vae_decode_ms": 0.0, "pipeline_ms": 0.0}
