"""The decoder's fused Triton kernels (fovea/layers/fused.py) against the PyTorch ops they replace, and a whole model
built with them against the same checkpoint built without.

Without a GPU the kernels run under Triton's interpreter (conftest sets it before triton is imported); on a GPU
the same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from fovea.attention.layer import AttentionMetadata
from fovea.layers.basic import GatedActivation, RMSNorm
from fovea.layers.rotary import mrope, rotate_qkv
from fovea.models.base import ModelOptions
from fovea.models.loader import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: the same operations in another order (the norm's sum); bf16: a rounding or two apart (one ulp of the
# normalized value, scaled by a weight of up to ~10; Triton's interpreter truncates where a GPU rounds to nearest)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def close(ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    assert not ours.isnan().any()
    torch.testing.assert_close(ours.float(), reference.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul(3).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 200])  # a power of two, and one the kernel's block must mask
def test_rms_norm_with_and_without_residual(dtype, hidden):
    reference, fused = RMSNorm(hidden, eps=1e-6), RMSNorm(hidden, eps=1e-6, fused=True)
    weight = randn(hidden, dtype=dtype, seed=1)
    for norm in (reference, fused):
        norm.weight.data = weight.clone()
    x, residual = randn(7, hidden, dtype=dtype, seed=2), randn(7, hidden, dtype=dtype, seed=3)
    close(fused(x), reference(x), dtype)
    (out, total), (ref_out, ref_total) = fused(x, residual), reference(x, residual)
    close(total, ref_total, dtype)
    if dtype == torch.float32 or torch.cuda.is_available():  # the interpreter truncates to bf16 (triton 3.9)
        torch.testing.assert_close(total, x + residual, rtol=0, atol=0)  # the sum rounds as the plain add does
    close(out, ref_out, dtype)
    assert fused(x[:0], residual[:0])[0].shape == (0, hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = randn(5, 2 * 1100, dtype=dtype, seed=4)  # wider than one program's block: two column blocks
    close(GatedActivation(fused=True)(x), GatedActivation()(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_a_fused_projection(dtype):
    heads, kv_heads, head_dim, n = 6, 2, 32, 9
    rotary = mrope(head_dim, 1e6, (4, 6, 6))
    positions = torch.randint(0, 5000, (3, n), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    cos, sin = rotary.to(DEVICE).cos_sin(positions)
    qkv = randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=6)
    expected = rotate_qkv(qkv.clone(), cos, sin, heads, kv_heads, head_dim)
    fused_qkv = qkv.clone()
    got = rotate_qkv(fused_qkv, cos, sin, heads, kv_heads, head_dim, fused=True)
    for ours, reference in zip(got, expected):
        close(ours, reference, dtype)
    assert got[0].data_ptr() == fused_qkv.data_ptr()  # rotated in place, no copy
    torch.testing.assert_close(got[2], qkv[:, -kv_heads * head_dim :].view(n, kv_heads, head_dim), rtol=0, atol=0)


def test_model_with_fused_kernels_gives_the_unfused_logits(tiny_dirs):
    """The decoder's wiring (residual handed between layers, final norm) with the kernels, on a real checkpoint."""
    models = [
        load_model(tiny_dirs["tiny-3b"], dtype="float32", device=DEVICE, options=ModelOptions(fused_kernels=fused))[0]
        for fused in (False, True)
    ]
    lengths = [11, 4]
    ids = torch.randint(0, 1000, (sum(lengths),), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(3, -1).to(DEVICE)
    meta = AttentionMetadata.from_lengths(lengths, DEVICE)
    with torch.inference_mode():
        reference, fused = (model.compute_logits(model(ids, positions, meta)) for model in models)
    assert models[1].model.layers[0].input_layernorm.fused and not models[0].model.layers[0].input_layernorm.fused
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
