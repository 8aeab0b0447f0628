"""The Triton W4A16 kernel (minfer/kernels/w4a16.py) against the plain-torch reference, and the int4 method's
GPU route (article §5).

On a CPU the kernel runs under Triton's interpreter: small odd shapes (M = 1, 3, 17; K of 2-3 groups; N that
is and is not a multiple of 64, so both byte layouts are read), which cross the interpreter's 16 x 32 tiles.
The reference (`w4a16_reference`) rounds x and the dequantized W to bfloat16 and sums in float32, as the
kernel does; the two differ only in the order of the sums.
"""

import pytest
import torch

from minfer.kernels import interpreter_active
from minfer.kernels.reference import w4a16_reference
from minfer.kernels.w4a16 import w4a16_matmul
from minfer.quantization.int4 import (
    Int4LinearMethod,
    int4pack_block,
    pack_int4,
    pack_int4_blocked,
    quantize_int4,
    unpack_int4,
)

DEVICES = (["cpu"] if interpreter_active() else []) + (["cuda"] if torch.cuda.is_available() else [])


def _weights(n, k, g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    return w, quantize_int4(w, g)


def _packed(codes, blocked):
    """The bytes the kernel reads (what `Int4LinearMethod.store` keeps on a GPU): 64-row blocks, or the plain
    nibble pairs."""
    if blocked:
        return pack_int4_blocked(codes)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _close(out, ref):
    # Same products, same roundings; only the order of the fp32 sums differs. Scale-relative bound.
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 1e-4 * ref.float().abs().max().item() + 1e-6, err


# (M, G, K, N): every M of 1, 3, 17 with 2-3 groups per row, each group size, both layouts (N = 48 is plain).
SHAPES = [(1, 32, 96, 64), (3, 64, 192, 48), (17, 128, 256, 128), (3, 32, 64, 128), (17, 32, 96, 48),
          (1, 64, 128, 48)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,g,k,n", SHAPES, ids=[f"M{m}-G{g}-K{k}-N{n}" for m, g, k, n in SHAPES])
def test_kernel_matches_reference(device, m, g, k, n):
    _, (codes, scale, zero) = _weights(n, k, g)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    blocked = n % 64 == 0
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    y = w4a16_matmul(x.to(device), _packed(codes, blocked).to(device), sz.to(device), g, blocked)
    assert y.shape == (m, n) and y.dtype == x.dtype
    _close(y.cpu(), w4a16_reference(x, codes, scale, zero))


@pytest.mark.parametrize("device", DEVICES)
def test_plain_layout_on_a_multiple_of_64_and_bf16_in_out(device):
    """The plain layout is read right for any N (it is what a layer of N % 64 != 0 keeps), and bf16 in/out."""
    _, (codes, scale, zero) = _weights(64, 96, 32, seed=3)
    x = torch.randn(5, 96).to(torch.bfloat16)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    y = w4a16_matmul(x.to(device), _packed(codes, False).to(device), sz.to(device), 32, blocked=False)
    assert y.dtype == torch.bfloat16
    ref = w4a16_reference(x, codes, scale, zero, out_dtype=torch.float32)
    torch.testing.assert_close(y.float().cpu(), ref, atol=0, rtol=1e-2)  # one bf16 rounding of the output


def test_torch_packer_is_the_cpu_ops_layout():
    """The device-agnostic packer (used where the CPU op cannot run) writes exactly the op's bytes, in the op's
    blocks on this CPU (64 rows with AVX-512, 32 with AVX2), and `pack_int4` is the op."""
    codes = torch.randint(0, 16, (128, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    block = int4pack_block("cpu")
    packed = pack_int4_blocked(codes, block)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
    assert torch.equal(packed, pack_int4(codes))
    assert torch.equal(unpack_int4(packed, block), codes)
    assert torch.equal(unpack_int4(pack_int4_blocked(codes)), codes)  # the GPU kernel's 64-row blocks


@pytest.mark.parametrize("device", DEVICES)
def test_int4_method_device_route_is_the_kernel(device):
    """`Int4LinearMethod.device_kernel` (what `apply` runs on a GPU) computes the CPU routes' W4A16 product."""
    from minfer.model.layers import Linear

    torch.manual_seed(0)
    for out in (128, 48):  # the blocked and the plain layout
        method = Int4LinearMethod(group_size=32)
        layer = Linear(96, out, method=method)
        layer.weight.data.copy_(torch.randn(out, 96) * 0.05)
        layer.process_weights_after_loading()
        x = torch.randn(3, 96)
        codes = method.codes(layer)
        sz = method.scales_and_zeros(layer).transpose(0, 1)
        ref = w4a16_reference(x, codes, sz[..., 0], sz[..., 1])
        _close(method.device_kernel(layer, x.to(device)).cpu(), ref)
        # the CPU's own route (the integer GEMM: activations rounded to int8 blocks) computes the same product
        cpu = method.apply(layer, x)
        assert (cpu - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("bad", ["group", "divide", "blocked", "dtype"])
def test_bad_input_is_a_clear_error(bad):
    _, (codes, scale, zero) = _weights(48, 64, 32)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    x, qw, g, blocked = torch.randn(2, 64), _packed(codes, False), 32, False
    if bad == "group":
        g = 48
    elif bad == "divide":
        x = torch.randn(2, 60)
    elif bad == "blocked":
        blocked = True
    else:
        qw = qw.to(torch.int32)
    with pytest.raises(ValueError):
        w4a16_matmul(x, qw, sz, g, blocked)
