"""Per-row LoRA deltas on real PEFT layers, one of each kind the engine meets and one it does not
(linear, 2-D convolution, and a 1-D convolution that takes the slot-by-slot path), against PEFT
itself running each row alone with the same adapters at the same scales."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

from serve_app.engine.row_lora import apply_row_adapters


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)
        self.conv = torch.nn.Conv2d(6, 6, 3, padding=1)
        self.line = torch.nn.Conv1d(6, 6, 3, padding=1)

    def forward(self, x):  # (batch, tokens=16, 6)
        y = self.proj(x)
        y = self.conv(y.transpose(1, 2).reshape(-1, 6, 4, 4)).flatten(2)
        return self.line(y).transpose(1, 2)


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    model = Net().eval()
    for i, name in enumerate(("a", "b")):
        cfg = LoraConfig(
            r=2 + i,
            lora_alpha=4,
            target_modules=["proj", "conv", "line"],
            init_lora_weights=False,
            lora_bias=i == 1,
        )
        inject_adapter_in_model(cfg, model, adapter_name=name)
    return model


def lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def alone(model, x, adapters):
    """PEFT's own forward with exactly `adapters` active at their scales."""
    for m in lora_layers(model):
        for n in ("a", "b"):
            m.set_scale(n, dict(adapters).get(n, 0.0))
        m.set_adapter([n for n, _ in adapters] or ["a"])
        m._disable_adapters = not adapters
    try:
        return model(x)
    finally:
        for m in lora_layers(model):
            m._disable_adapters = False
            for n in ("a", "b"):
                m.set_scale(n, 1.0)


@torch.no_grad()
def test_each_row_gets_its_own_sets_and_empty_rows_the_base_output(net):
    sets = [(("a", 1.0),), (("b", 0.5),), (("a", 0.3), ("b", 1.0)), (), (("a", 2.0),)]
    x = torch.randn(len(sets), 16, 6)
    before = [(m._active_adapter, dict(m._forward_hooks)) for m in lora_layers(net)]
    undo = apply_row_adapters(net, sets)
    try:
        once = net(x)
        twice = net(torch.cat([x, x]))  # the rows repeated, as classifier-free guidance does
    finally:
        undo()
    assert [(m._active_adapter, dict(m._forward_hooks)) for m in lora_layers(net)] == before
    for i, s in enumerate(sets):
        ref = alone(net, x[i : i + 1], s)[0]
        torch.testing.assert_close(once[i], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(twice[i + len(sets)], ref, rtol=1e-5, atol=1e-5)
    base = alone(net, x, ())  # the same batch with no adapter anywhere
    assert torch.equal(once[3], base[3])  # a row without adapters: the base output, bit for bit
    assert (once[0] - base[0]).abs().max() > 1e-2  # and the adapters do act


@torch.no_grad()
def test_the_undo_runs_when_set_up_fails(net, monkeypatch):
    from serve_app.engine import row_lora

    before = [m._active_adapter for m in lora_layers(net)]

    def boom(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(row_lora, "_stack", boom)
    with pytest.raises(RuntimeError):
        apply_row_adapters(net, [(("a", 1.0),), ()])
    assert [m._active_adapter for m in lora_layers(net)] == before
    assert not any(m._forward_hooks for m in lora_layers(net))
