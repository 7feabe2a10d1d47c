"""The fast path's fused RMSNorm: used only where it is bit-identical to the model's module."""

from __future__ import annotations

import pytest
import torch

import helpers
from verispec.runtime.fastpath import FusedNorm


@pytest.mark.parametrize("arch", helpers.FAST_ARCHITECTURES)
def test_every_norm_of_the_fast_path_is_fused_and_bit_identical(tiny_targets, arch):
    target = tiny_targets[arch]
    fast = target.decoder
    layer = target.model.get_decoder().layers[0]
    wrapped = fast.layers[0]
    assert isinstance(fast.norm, FusedNorm) and isinstance(wrapped.input_norm, FusedNorm)
    x = torch.randn(4, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(wrapped.input_norm(x), layer.input_layernorm(x))
        assert torch.equal(fast.norm(x), target.model.get_decoder().norm(x))


class DoubledNorm(torch.nn.Module):
    """An RMSNorm-like module with a different scale rule (2w): must not be fused."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (2 * self.weight)


def test_a_norm_with_other_math_is_left_as_the_module():
    module = DoubledNorm(16)
    assert FusedNorm.of(module) is module
    layer_norm = torch.nn.LayerNorm(16)
    assert FusedNorm.of(layer_norm) is layer_norm  # eps attribute, but not an RMSNorm
    identity = torch.nn.Identity()
    assert FusedNorm.of(identity) is identity  # no weight
