"""A joined run's seats see their text encoders through `text_memo`: a seat after the first
gets the empty negative prompt's encoding kept from an earlier seat instead of running the
encoder, its image the one it makes alone; once an adapter comes or goes, nothing kept is used."""

from __future__ import annotations

import numpy as np
import pytest

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
