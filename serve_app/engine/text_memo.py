"""Text encoders' outputs kept for the seats of one joined run, by their exact inputs.

Every seat that joins a run encodes its prompts with its own pipeline call, and with
classifier-free guidance most of them also encode the same empty negative prompt: on a CPU host
a third of what setting a seat up costs, paid between two steps while the device waits. So the
seats' pipelines see their text encoders through `Memoized`: a call with exactly the inputs of
an earlier one (the same token ids, masks and options) gets that call's output again instead of
running the encoder. The pipeline's own `encode_prompt` (tokenizing, the textual-inversion
check and every encoder) is seen the same way, by its arguments (the prompt strings, the
device, the options), so that a seat whose prompts were encoded ahead (`joined.foresee`, on
another thread while the device works) skips all of it.

An output is only reused while the encoders' weights are those it was made with: a joined run
keeps one set of adapters in force for all its seats, and the engine's `epoch` moves whenever it
loads or removes an adapter, which empties the memo (new weights a trainer pushes go to the
denoiser only); an output whose call began before the epoch moved is not kept. Calls with grad
enabled, or with an input that is neither a tensor nor a plain value, always run. The memo may
be used from two threads at once (the engine's and the one encoding ahead).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Callable
from typing import Any

import torch

_PLAIN = (bool, int, float, str, type(None), torch.device, torch.dtype)
_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


class TextMemo:
    """The outputs of one joined run's text encoder (and `encode_prompt`) calls, the `size`
    latest used (the empty negative prompt's encoding is used by every seat whose
    `encode_prompt` is not kept)."""

    def __init__(self, epoch: Callable[[], int], size: int = 16):
        self._epoch = epoch
        self._at = epoch()
        self._size = size
        self._outputs: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def wrap_encoders(self, pipe) -> None:
        """Have `pipe` (a seat's shallow copy of a pipeline) see its text encoders and its
        `encode_prompt` through this."""
        for name in _ENCODERS:
            if isinstance(encoder := getattr(pipe, name, None), torch.nn.Module):
                pipe.__dict__[name] = Memoized(encoder, name, self)
        if callable(encode := getattr(pipe, "encode_prompt", None)):  # bound to `pipe`
            pipe.__dict__["encode_prompt"] = Memoized(encode, "encode_prompt", self)

    def output(self, key: tuple, run: Callable[[], Any]) -> Any:
        with self._lock:
            at = self._epoch()
            if at != self._at:  # weights or adapters changed: nothing kept holds
                self._outputs.clear()
                self._at = at
            if key in self._outputs:
                self._outputs.move_to_end(key)
                return _fresh(self._outputs[key])
        out = run()
        with self._lock:
            if self._epoch() == at == self._at and not self._closed:  # the weights in force now
                self._outputs[key] = _fresh(out)  # copies both ways: a pipeline may write into its own
                if len(self._outputs) > self._size:
                    self._outputs.popitem(last=False)
        return out

    def close(self) -> None:
        """The run is over: keep nothing more (a call run ahead may still end after it)."""
        with self._lock:
            self._closed = True
            self._outputs.clear()


def bare_encoders(pipe) -> None:
    """Have `pipe` call its text encoders themselves again, its `encode_prompt` still seen
    through the memo: a call run ahead on another thread keys no encoder call by its token
    ids (on a GPU, copying them to the host would wait for the step in flight)."""
    for name in _ENCODERS:
        if isinstance(encoder := pipe.__dict__.get(name), Memoized):
            pipe.__dict__[name] = encoder._module


class Memoized:
    """What a seat's pipeline sees as a text encoder (or its `encode_prompt`): the module's
    attributes, and a call that returns a kept output for inputs seen before."""

    def __init__(self, module: Callable[..., Any], name: str, memo: TextMemo):
        self._module = module
        self._name = name
        self._memo = memo

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = None if torch.is_grad_enabled() else _key(self._name, args, kwargs)
        if key is None:
            return self._module(*args, **kwargs)
        return self._memo.output(key, lambda: self._module(*args, **kwargs))


def _fresh(out: Any) -> Any:
    """`out` with copies of its tensors (a text encoder's output: a tensor, a tuple or a
    transformers `ModelOutput`)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, dict):  # ModelOutput is a dict of its fields that are not None
        return type(out)(**{k: _fresh(v) for k, v in out.items()})
    if isinstance(out, tuple | list):
        return type(out)(_fresh(v) for v in out)
    return out


def _key(name: str, args: tuple, kwargs: dict) -> tuple | None:
    """What identifies a call: its name and arguments (tensors by their bytes); None when an
    argument is neither a tensor, a plain value nor a list of them."""
    parts = _part([*enumerate(args), *sorted(kwargs.items())])
    return None if parts is _UNKNOWN else (name, parts)


_UNKNOWN = object()  # a value `_part` cannot tell apart from others


def _part(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        data = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return ("tensor", tuple(v.shape), v.dtype, v.device, hashlib.blake2b(data, digest_size=16).digest())
    if isinstance(v, _PLAIN):
        return (type(v).__name__, v)  # 1, 1.0 and True are equal keys, not equal arguments
    if isinstance(v, list | tuple):
        parts = tuple(_part(x) for x in v)
        return _UNKNOWN if any(p is _UNKNOWN for p in parts) else (type(v).__name__, parts)
    return _UNKNOWN
