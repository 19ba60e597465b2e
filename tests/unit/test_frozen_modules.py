"""freeze_attributes: a loaded model's parameters, buffers and children become instance attributes (direct
lookup) without changing what the model computes, and thaw_attributes restores nn.Module's own lookup."""

import torch
from torch import nn

from runtime.models.frozen_modules import freeze_attributes, is_frozen, thaw_attributes


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        return self.proj(x) * self.scale


def test_frozen_model_computes_the_same_through_instance_attributes():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(3, 8)
    want = model(x)
    count = freeze_attributes(model)
    assert count == 2 * (1 + 1 + 2) + 2  # per block: proj, scale, proj.weight, proj.bias; the 2 blocks
    block = model[0]
    assert is_frozen(block)
    # found by the ordinary lookup now, the same objects nn.Module holds
    assert block.__dict__["proj"] is block._modules["proj"]
    assert block.__dict__["scale"] is block._buffers["scale"]
    assert block.proj.__dict__["weight"] is block.proj._parameters["weight"]
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


def test_thaw_lets_changes_to_the_tree_take_effect():
    model = Block()
    freeze_attributes(model)
    thaw_attributes(model)
    assert not is_frozen(model) and "proj" not in model.__dict__
    model.scale = torch.zeros(8)  # a buffer replaced after thawing is the one used
    assert model(torch.randn(2, 8)).abs().sum() == 0
