"""`model.optimizations.speed: max`: the fast path. No Ray in here.

The denoiser is compiled (a UNet whole, in channels-last; a transformer's repeated blocks, with
diffusers' regional compilation) and so is an image model's VAE decoder; on CUDA with CUDA graphs
and the inductor settings of the fast recipes, and for a transformer on a GPU of compute
capability 8.9+ with float8 linear layers (torchao). The warm-up compiles the shapes the
deployment serves (sizes times batch sizes) before the replica takes traffic.

Each compiled module's `forward` is a `Padded`: a call whose rows fit a warmed shape is padded
up to it (the last row repeated; the padding rows' outputs dropped) and runs compiled; any other
call (a size never warmed, more rows than warmed, a step cache's or per-row adapters' hooks in
the graph) runs eagerly, never compiling beside traffic. A call that misses the compiled graphs
anyway runs eagerly too (`miss_stance`; the tests make it raise instead).

Adapters: every adapter loaded stays active in the denoiser's LoRA layers, and the set in force
is chosen by the values of their scaling tensors (`hold_adapters`), so swapping adapters changes
no graph. Loading or removing one changes the layers: the warmed shapes are compiled again then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from serve_app.engine.joining import _has_rows, _layout, _rows, _split
from serve_app.engine.types import ModelLoadError

logger = logging.getLogger(__name__)

_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that capture CUDA graphs


class Padded:
    """A module's forward behind the fast path: padded to a warmed shape and run compiled, or
    run eagerly. Set as the module's `forward`; the module's own stays in `eager`."""

    def __init__(self, fast: FastPath, module: torch.nn.Module, compiled: Callable, name: str, graphs: bool):
        self.fast = fast
        self.name = name
        self.eager = module.forward
        self.compiled = compiled
        self.graphs = graphs  # CUDA graphs inside: each call a new step of theirs, outputs copied out
        self.warmed: dict[Any, set[int]] = {}  # layout past the rows -> the row counts compiled
        module.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fast = self.fast
        n = _rows(args, kwargs)
        args, kwargs = _per_row_timestep(args, kwargs, n)
        key = (tuple(_layout(a, n) for a in args), _layout(kwargs, n))
        if fast.warming:
            self.warmed.setdefault(key, set()).add(n)
            return self._run(args, kwargs, "default")
        bucket = min((m for m in self.warmed.get(key, ()) if m >= n), default=None)
        if fast.eager_depth or fast.stale or bucket is None:
            fast.eager_calls += 1
            with torch.compiler.set_stance("force_eager"):
                return self.eager(*args, **kwargs)
        fast.compiled_calls += 1
        if bucket == n:
            return self._run(args, kwargs, fast.miss_stance)
        args = tuple(_pad(a, n, bucket - n) for a in args)
        kwargs = {k: _pad(v, n, bucket - n, k) for k, v in kwargs.items()}
        return _split(self._run(args, kwargs, fast.miss_stance), [n, bucket - n])[0]

    def _run(self, args: tuple, kwargs: dict, stance: str) -> Any:
        with torch.compiler.set_stance(stance):
            if self.graphs:
                torch.compiler.cudagraph_mark_step_begin()
                return _copied(self.compiled(*args, **kwargs))
            return self.compiled(*args, **kwargs)

    def shapes(self) -> list[int]:
        return sorted({n for ns in self.warmed.values() for n in ns})


class FastPath:
    """The compiled modules of one pipeline, their warmed shapes, and how calls went."""

    def __init__(self, pipe, denoiser: torch.nn.Module, device: torch.device, dtype: torch.dtype, cfg):
        opt = cfg.optimizations
        self.device = device
        self.mode = opt.compile_mode or ("reduce-overhead" if device.type == "cuda" else "default")
        self.warming = False
        self.eager_depth = 0
        self.stale = False  # the layers changed (an adapter came or went): warm again first
        self.miss_stance = "eager_on_recompile"  # the tests set "fail_on_recompile"
        self.compiled_calls = 0
        self.eager_calls = 0
        self.warm_s = 0.0
        self.warmed_shapes: list[dict[str, int]] = []
        self.cache: str | None = None  # a URL's "hit", "miss", "saved"; "directory", "empty directory"
        self.cache_url = self._open_cache(opt.compile_cache, cfg, dtype)
        self.quantized = "none"
        self.attention = None
        self._scalings: dict[tuple[int, str], torch.Tensor] = {}
        self.denoiser = denoiser
        if device.type == "cuda":
            _fast_recipe_flags()
            self.attention = _fastest_attention(denoiser, opt.attention_backend)
            if "quantize" not in opt.model_fields_set and _float8_pays(denoiser, device):  # unless named
                from serve_app.engine.loading import quantize_denoiser

                try:
                    quantize_denoiser(denoiser, "float8_dynamic", device)
                    self.quantized = "float8_dynamic"
                except ModelLoadError as e:  # not asked for by name: run in the model's dtype
                    logger.warning("fast path without float8: %s", e)
        denoiser.requires_grad_(False)
        graphs = device.type == "cuda" and self.mode in _GRAPH_MODES
        blocks = getattr(denoiser, "_repeated_blocks", None)
        if getattr(pipe, "unet", None) is denoiser or not blocks:  # a UNet (or SD3's) whole, channels-last
            denoiser.to(memory_format=torch.channels_last)
            whole = torch.compile(denoiser.forward, dynamic=False, mode=self.mode)
            self.modules = {"denoiser": Padded(self, denoiser, whole, "denoiser", graphs)}
        else:  # a transformer's repeated blocks (regional compilation): far less to compile
            try:
                denoiser.compile_repeated_blocks(dynamic=False, mode=self.mode, fullgraph=True)
            except ValueError as e:
                raise ModelLoadError(f"model.optimizations.speed: {e}") from None
            self.modules = {"denoiser": Padded(self, denoiser, denoiser.forward, "denoiser", graphs)}
        decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
        if isinstance(decoder, torch.nn.Module) and decoder.__class__.__name__ == "Decoder":  # an image VAE's
            # No CUDA graphs in the decoder: joined runs decode on their seats' threads.
            mode = {"max-autotune": "max-autotune-no-cudagraphs", "reduce-overhead": "default"}.get(
                self.mode, self.mode
            )
            decode = torch.compile(decoder.forward, dynamic=False, mode=mode)
            self.modules["vae_decoder"] = Padded(self, decoder, decode, "vae_decoder", False)

    # ------------------------------------------------------------------ calls

    @contextlib.contextmanager
    def eager(self, when: bool = True) -> Iterator[None]:
        """Calls inside run eagerly (hooks in the graph: a step cache, per-row adapters)."""
        self.eager_depth += bool(when)
        try:
            yield
        finally:
            self.eager_depth -= bool(when)

    def eager_until(self, undo: Callable[[], None]) -> Callable[[], None]:
        """Calls run eagerly until the returned `undo` (which runs `undo` too)."""
        self.eager_depth += 1

        def done() -> None:
            self.eager_depth -= 1
            undo()

        return done

    def warm(self, run: Callable[[int, int, int], None], cfg, native: tuple[int, int]) -> None:
        """Compile every size of `cfg.warmup_sizes` (default: `native`, as (width, height)) at
        every batch size of `cfg.warmup_batches` by running it (`run(width, height, batch)`),
        before traffic; calls with these shapes (or padded up to them) run compiled from then on.
        With a compile cache at a URL, the kernels compiled before are read from it first, and
        all of them written to it after."""
        sizes = [tuple(map(int, s.split("x"))) for s in cfg.warmup_sizes] or [native]
        batches = cfg.warmup_batches or [1]
        if self.cache_url and self.cache is None:
            self.load_cache(self.cache_url)
        # Only warm-ups compile (calls never do), and each adds entries for its shapes, a
        # transformer's kinds of block sharing one code object, again after each adapter's load:
        # dynamo's limits, meant to stop runaway recompiling, would make later shapes run eagerly.
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 4096)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 65536)
        t = time.perf_counter()
        self.warming, self.stale = True, False
        try:
            for width, height in sizes:
                for batch in batches:
                    run(width, height, batch)
        finally:
            self.warming = False
        self.warm_s = round(time.perf_counter() - t, 2)
        self.warmed_shapes = [{"width": w, "height": h, "batch": b} for w, h in sizes for b in batches]
        logger.info("fast path: %d shapes compiled in %.1fs", len(self.warmed_shapes), self.warm_s)
        if self.cache_url:
            self.save_cache(self.cache_url)

    def warm_again(self, warmup: Callable[[], None]) -> None:
        """After the layers changed (`stale`): `warmup` again; a failure leaves every call eager
        instead of failing them."""
        if self.stale:
            try:
                warmup()
            except Exception:
                logger.exception("fast path: the warm-up after an adapter's change failed; calls run eagerly")
                self.give_up()

    def give_up(self) -> None:
        """After a warm-up that failed: every call runs eagerly from now on."""
        for module in self.modules.values():
            module.warmed.clear()
        self.warmed_shapes, self.stale = [], False

    def hold_adapters(self, want: tuple[tuple[str, float], ...] | None) -> None:
        """Put `want` in force in the denoiser by the values of its LoRA layers' scaling tensors,
        every loaded adapter active (0 for those not in `want`): the graph stays the same."""
        from peft.tuners.lora import LoraLayer

        from serve_app.engine.row_lora import unit_scaling

        scales = dict(want or ())
        for layer in self.denoiser.modules():
            if not isinstance(layer, LoraLayer):
                continue
            names = sorted(layer.lora_A.keys())
            layer._active_adapter = names
            layer._disable_adapters = False
            for name in names:
                value = self._scalings.get((id(layer), name))
                if value is None:
                    value = self._scalings[(id(layer), name)] = torch.zeros((), device=self.device)
                value.fill_(scales.get(name, 0.0) * unit_scaling(layer, name))
                layer.scaling[name] = value
        self.denoiser.requires_grad_(False)  # PEFT's set_adapters marks the active ones trainable

    def forget_adapter(self, name: str) -> None:
        self._scalings = {k: v for k, v in self._scalings.items() if k[1] != name}

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "warmed_shapes": self.warmed_shapes,
            "warm_s": self.warm_s,
            "rows": {name: m.shapes() for name, m in self.modules.items()},
            "compiled_calls": self.compiled_calls,
            "eager_calls": self.eager_calls,
            "compile_cache": self.cache,
            "quantize": self.quantized,
            "attention_backend": self.attention,
        }

    # ------------------------------------------------------------------ the compile cache

    def _open_cache(self, place: str | None, cfg, dtype: torch.dtype) -> str | None:
        """Use the compile cache at `place`; the URL of this model's file in it, None for none or
        a directory. A directory holds inductor's own cache (kernels built, not only their code:
        on a CPU a process that finds them there compiles nothing); a URL holds one file of torch's
        cache artifacts per model, torch, device kind, dtype and mode."""
        if place is None:
            return None
        if place.startswith(("/", "~", "file://")):
            folder = os.path.join(os.path.expanduser(place.removeprefix("file://")), "inductor")
            self.cache = "directory" if os.path.isdir(folder) and os.listdir(folder) else "empty directory"
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder  # read by inductor at each use
            return None
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        key = json.dumps(
            [cfg.source, cfg.revision, cfg.variant, str(dtype), torch.__version__, device, self.mode],
            sort_keys=True,
        )
        return f"{place.rstrip('/')}/compiled-{hashlib.sha256(key.encode()).hexdigest()[:20]}.bin"

    def load_cache(self, path: str) -> None:
        import fsspec

        try:
            with fsspec.open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            self.cache = "miss"
            return
        except Exception as e:  # unreadable: compile as if there were none
            logger.warning("compile cache %s not read: %s", path, e)
            self.cache = "miss"
            return
        try:
            torch.compiler.load_cache_artifacts(blob)
        except Exception as e:  # another torch's, or damaged: compile as if there were none
            logger.warning("compile cache %s not used: %s", path, e)
            self.cache = "miss"
            return
        self.cache = "hit"

    def save_cache(self, path: str) -> None:
        import fsspec

        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        try:
            with fsspec.open(path, "wb", auto_mkdir=True) as f:
                f.write(saved[0])
        except Exception as e:  # a cache that cannot be written costs the next start, no more
            logger.warning("compile cache %s not written: %s", path, e)
            return
        self.cache = "hit" if self.cache == "hit" else "saved"


def _per_row_timestep(args: tuple, kwargs: dict, n: int) -> tuple[tuple, dict]:
    """A single timestep (a 0-d tensor) as one per row, in memory of its own as joined calls and
    padding make it: whole, padded and joined calls then share their compiled graphs."""
    t = kwargs.get("timestep")
    if isinstance(t, torch.Tensor) and t.dim() == 0:
        kwargs = {**kwargs, "timestep": t.reshape(1).repeat(n)}
    elif len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].dim() == 0:  # a UNet's
        args = (args[0], args[1].reshape(1).repeat(n), *args[2:])
    return args, kwargs


def _pad(value: Any, n: int, extra: int, name: str = "") -> Any:
    """`value` of a call of `n` rows with its last row repeated `extra` times."""
    if isinstance(value, torch.Tensor):
        if _has_rows(value, n, name):
            return torch.cat([value, value[-1:].expand(extra, *value.shape[1:])])
        return value
    if isinstance(value, dict):
        return {k: _pad(v, n, extra, k) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)([_pad(v, n, extra, name) for v in value])
    return value


def _copied(out: Any) -> Any:
    """A CUDA graph's outputs copied out of its buffers, which its next replay overwrites."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if dataclasses.is_dataclass(out):
        return type(out)(**{f.name: _copied(getattr(out, f.name)) for f in dataclasses.fields(out)})
    if isinstance(out, tuple | list):
        return type(out)([_copied(o) for o in out])
    return out


def _fast_recipe_flags() -> None:
    """The inductor settings of diffusers' and PyTorch's fast diffusion recipes (CUDA)."""
    cfg = torch._inductor.config
    cfg.conv_1x1_as_mm = True
    cfg.coordinate_descent_tuning = True
    cfg.coordinate_descent_check_all_directions = True
    cfg.epilogue_fusion = False


# Attention backends of diffusers' dispatcher, fastest first (each needs its kernels installed).
_ATTENTION = ("_flash_3", "flash", "_native_cudnn")
# The transformers whose attention takes no mask (FlashAttention's backends refuse one): the only
# ones a backend is picked for unasked.
_MASKLESS = ("FluxTransformer2DModel", "Flux2Transformer2DModel", "WanTransformer3DModel")


def _fastest_attention(denoiser: torch.nn.Module, named: str | None) -> str | None:
    """The attention backend a transformer runs under `speed: max` on CUDA: the one named in
    `attention_backend` (set at load already), else the fastest one that is installed."""
    blocks = getattr(denoiser, "_repeated_blocks", None)
    if named or not blocks or type(denoiser).__name__ not in _MASKLESS:
        return named
    for backend in _ATTENTION:
        try:
            denoiser.set_attention_backend(backend)
        except Exception:  # not installed, or not for this device
            continue
        return backend
    return None


def _float8_pays(denoiser: torch.nn.Module, device: torch.device) -> bool:
    """float8 linear layers where the chip has them (compute capability 8.9+) and they carry the
    work (a transformer, not a UNet's convolutions), with torchao installed."""
    if not getattr(denoiser, "_repeated_blocks", None) or type(denoiser).__name__.startswith("UNet"):
        return False
    if torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True
