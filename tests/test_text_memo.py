"""A joined run's seats see their text encoders through `text_memo`: a seat after the first
gets the empty negative prompt's encoding kept from an earlier seat instead of running the
encoder, its image the one it makes alone; once an adapter comes or goes, nothing kept is used.
A joiner's call run ahead on another thread (`JoinedRun.foresee`) leaves its seat no encoding
to do, tokenizes with tokenizers of its own, and makes the same image."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from PIL import Image

from serve_app.engine import CallParams, Row
from serve_app.tools.lora import make_adapter
from tests.conftest import engine_cache


@pytest.fixture(scope="module")
def engine():
    with engine_cache() as get:
        yield get("tiny-sd")


def test_seats_reuse_the_encodings_kept_until_an_adapter_comes(engine, tmp_path):
    e = engine
    p = CallParams(height=e.default_height, width=e.default_width, steps=3, guidance_scale=7.5)
    rows = [Row("a red cat", None, 1), Row("a green dog", None, 2), Row("a blue bird", None, 3)]
    alone = [np.asarray(e.run([r], p).images[0]).astype(int) for r in rows]
    runs = []
    hook = e.pipe.text_encoder.register_forward_pre_hook(lambda *a: runs.append(1))
    try:
        run = e.open_joined(p)
        first = run.add(rows[0])
        assert len(runs) == 2  # its prompt and the empty negative prompt
        second = run.add(rows[1])
        assert len(runs) == 3  # its prompt only: the negative prompt's encoding was kept
        run.step()
        e.load_lora("te", str(make_adapter(str(tmp_path / "te.safetensors"), seed=5, text_encoder=True)))
        third = run.add(rows[2])
        assert len(runs) == 5  # an adapter came: both encoded again
        while run.active:
            run.step()
        run.close()
    finally:
        hook.remove()
        e.unload_lora("te")
    for seat, want in zip((first, second, third), alone, strict=True):
        assert seat.error is None
        assert np.abs(np.asarray(seat.output.images[0]).astype(int) - want).max() <= 2


def test_a_caller_writing_into_its_encoding_changes_no_one_elses():
    # Cosmos's pipelines zero the padding of their encodings in place.
    import torch

    from serve_app.engine.text_memo import Memoized, TextMemo

    calls = []

    def encoder(ids):
        calls.append(ids)
        return (ids.float() * 2,)

    enc = Memoized(encoder, "text_encoder", TextMemo(lambda: 0))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        enc(ids)[0].zero_()
        again = enc(ids)[0]
        again[0, 0] = 99
        assert torch.equal(enc(ids)[0], torch.tensor([[2.0, 4.0, 6.0]])) and len(calls) == 1
        assert enc(torch.tensor([[1, 2, 4]]))[0][0, 2] == 8 and len(calls) == 2


def test_an_output_made_while_the_epoch_moved_is_not_kept():
    # The thread encoding ahead may run while the engine thread loads an adapter and encodes
    # with it: what the first made with the weights of before is not kept for later seats.
    import torch

    from serve_app.engine.text_memo import Memoized, TextMemo

    epoch, calls = [0], []

    def encoder(ids):
        calls.append(ids)
        if len(calls) == 1:
            epoch[0] += 1  # an adapter came while the first call ran
            enc(torch.tensor([[7]]))  # and the engine thread encoded with it since
        return ids.float()

    enc = Memoized(encoder, "text_encoder", TextMemo(lambda: epoch[0]))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        enc(ids), enc(ids), enc(ids)
    assert len(calls) == 3  # ids encoded again once, then kept


def _encoded_on(engine, where: list[str], monkeypatch, tokenizers: dict[str, set[int]]):
    """Record the thread of every call of `engine`'s tokenizer and text encoder in `where`,
    and the tokenizers each thread used in `tokenizers`; returns the undo of the encoder's
    record."""
    tokenize = type(engine.pipe.tokenizer).__call__

    def counted(self, *args, **kwargs):
        where.append(threading.current_thread().name)
        tokenizers.setdefault(threading.current_thread().name, set()).add(id(self))
        return tokenize(self, *args, **kwargs)

    monkeypatch.setattr(type(engine.pipe.tokenizer), "__call__", counted)
    hook = lambda *a: where.append(threading.current_thread().name)  # noqa: E731
    return engine.pipe.text_encoder.register_forward_pre_hook(hook).remove


@pytest.mark.parametrize("task", ["generate", "img2img"])
def test_a_call_run_ahead_leaves_its_seat_no_encoding_to_do(engine, task, monkeypatch):
    # Run ahead on another thread while the run steps, a joiner's call stops at its first
    # denoiser call (an edit's: at its image encoding, before the VAE runs); its seat then
    # sets up without tokenizing or encoding, and its image is the one it makes alone.
    e = engine
    p = CallParams(height=e.default_height, width=e.default_width, steps=4, guidance_scale=7.5, task=task,
                   strength=0.75 if task == "img2img" else None)  # fmt: skip
    image = Image.new("RGB", (e.default_width, e.default_height), (30, 160, 90))
    image = image if task == "img2img" else None
    rows = (Row("a red cat", None, 1), Row("a pier", None, 2))
    first, joiner = (dataclasses.replace(r, image=image) for r in rows)
    alone = np.asarray(e.run([joiner], p).images[0]).astype(int)
    where: list[str] = []
    vae_calls: list[int] = []
    tokenizers: dict[str, set[int]] = {}
    undo = _encoded_on(e, where, monkeypatch, tokenizers)
    vae_hook = e.pipe.vae.register_forward_pre_hook(lambda *a: vae_calls.append(1))
    vae_encoder_hook = e.pipe.vae.encoder.register_forward_pre_hook(lambda *a: vae_calls.append(1))
    try:
        run = e.open_joined(p)
        run.add(first)
        run.step()
        vae_calls.clear()  # the first seat's image encoding
        seen: list[bool] = []
        ahead = threading.Thread(target=lambda: seen.append(run.foresee([joiner])), name="ahead")
        ahead.start()
        ahead.join()
        # Its prompts tokenized (its prompt padded and whole, to tell what the padding cut;
        # the empty negative prompt) and encoded (ahead, encoder calls are not looked up: on a
        # GPU their keys would wait for the step in flight); its image not encoded.
        assert seen == [True] and where.count("ahead") == 5 and not vae_calls, where
        before = len(where)
        seat = run.add(joiner)
        assert len(where) == before  # its seat tokenized and encoded nothing
        # A fast tokenizer keeps its padding on itself: no tokenizer is used on both threads.
        assert not tokenizers["ahead"] & tokenizers["MainThread"]
        while run.active:
            run.step()
        run.close()
    finally:
        undo(), vae_hook.remove(), vae_encoder_hook.remove()
    assert seat.error is None
    assert np.abs(np.asarray(seat.output.images[0]).astype(int) - alone).max() <= 2


def test_a_call_run_ahead_ends_where_it_would_change_what_the_engine_thread_uses(engine):
    # SDXL's image-to-image casts its VAE to float32 before encoding; FLUX enters its
    # transformer's cache context. Ahead, reading their attributes is all a call may do.
    from serve_app.engine.joined import _Foreseen, _Foresight, _NoUse

    vae, denoiser = _NoUse(engine.pipe.vae), _Foresight(engine.pipe.unet, {})
    assert vae.config.latent_channels == 4 and vae.dtype == denoiser.dtype
    uses = (lambda: vae.to(dtype=None), lambda: vae.encode(None), lambda: vae(None),
            lambda: denoiser.to(dtype=None), lambda: denoiser(None))  # fmt: skip
    for use in uses:
        with pytest.raises(_Foreseen):
            use()


def test_arguments_equal_in_python_but_of_other_types_are_other_calls():
    import torch

    from serve_app.engine.text_memo import Memoized, TextMemo

    calls: list = []
    encode = Memoized(lambda x: calls.append(x) or torch.zeros(1), "encode_prompt", TextMemo(lambda: 0))
    with torch.no_grad():
        for x in (1, True, 1.0, 1, [1, 2], (1, 2), [1, 2]):
            encode(x)
    assert calls == [1, True, 1.0, [1, 2], (1, 2)]
