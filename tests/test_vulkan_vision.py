"""The vision encoder on the Vulkan backend (backends/vulkan/vision.py) against the numpy VisionOps.

Kernel tests: each op on fresh random inputs (the GEMMs on each route of vision_policy.gemm_kernel that the
device offers: the text model's cooperative-matrix GEMM where it has one, its tiled mat-mat in both layouts,
vision_linear.comp for K not a multiple of 64; the kernel that ran read from the command buffer's labels),
its output range poisoned with NaN first (every scratch buffer the op's outputs can land in is filled with
NaN at the head of the same command buffer, and the pool must not grow, so no output comes from an
unpoisoned buffer). Then the whole tower: the tiny VLM checkpoint
of tests/hf_tiny.py, and a medium random tower (2 images of 256 patches, width 64, FFN 172: partial GEMM
tiles along rows, columns and K, several attention workgroups per head), against model/siglip.py's
VisionTower on the numpy ops, through ``vision.encode`` (recorded once per image count, replayed with new
pixels) and through the tower's own ``encode`` (one command buffer a call). The kernel-choice functions
(vision_policy.py) are tested without a device, over device profiles (lavapipe, GPUs with and without
cooperative matrices), so the routing lavapipe cannot run is checked too.

Tolerances (float32 sums on the device, in another order than numpy's):
- GEMM (linear, matmul, patch embedding): |err| <= 2e-6 * (|x| @ |w| + |b|), about K^0.5 float32 roundings
  of the magnitudes summed; with float16 weights the reference is numpy on the same float16-rounded weights
  (the kernels widen them exactly), so the bound is the same; against the float32 weights the float16
  storage costs up to 2^-11 relative per weight (not asserted: that is the format's, not the kernel's).
  On the cooperative-matrix GEMM x is rounded to float16 too (row_scale.comp: x / a power of two): up to
  2^-11 relative per product, plus 2^-24 of the row's largest |x| (float16's subnormals), so there
  |err| <= (2^-11 + 2e-6) * (|x| @ |w|) + 2^-24 * max_row |x| * sum |w| + 2e-6 |b|;
- layer norm, RMS norm: rtol 1e-5, atol 1e-5 (one-pass sums in a tree, inversesqrt instead of / sqrt);
- GELU: |err| <= 1e-6 |x| + 1e-6 (the 1 / (1 + exp(-2u)) form against 0.5 (1 + tanh u));
- add, average pool: 1e-6 relative (the pool sums row by row, then divides; numpy's mean sums pairwise);
- attention: rtol 1e-5, atol 2e-6 (online softmax in exp2, chunk by chunk);
- the whole tower: rtol 2e-4, atol 2e-4 * max |reference| (the per-op errors through LayerNorms and GEMMs),
  the reference on the float16-rounded matrices; where a GEMM (the attention) runs on cooperative matrices
  the reference rounds its x (q * scale, k, v) to float16 as well, and the tolerance is 2e-3 (a value on
  either side of a float16 rounding boundary rounds apart: one float16 step, 2^-11, in a few operands; the
  attention's P in float16; a wrong tile, layout or bias is O(1));
- attention on cooperative matrices: against the reference on float16-rounded q * scale, k, v, within
  2e-3 * max |v|.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hmad.backends.vision_ops import VisionOps
from hmad.backends.vulkan import policy
from hmad.backends.vulkan import vision_policy as vp
from hmad.backends.vulkan.options import VulkanOptions
from hmad.backends.vulkan.policy import DeviceCaps

REF = VisionOps()
NAN_BITS = 0x7FC00000


# -- kernel choice (no device) -------------------------------------------------------------------------------
def test_weight_formats():
    assert vp.weight_format("auto", "v.blk.0.attn_q.weight", 2, "float32") == "f32"
    assert vp.weight_format("auto", "v.blk.0.attn_q.weight", 2, "float32", coopmat=True) == "f16"
    assert vp.weight_format("auto", "v.blk.0.attn_q.weight", 2, "float16") == "f16"
    assert vp.weight_format("f16", "v.blk.0.ffn_up.weight", 2, "float32") == "f16"
    assert vp.weight_format("f32", "mm.input_projection.weight", 2, "float16") == "f32"
    assert vp.weight_format("f16", "v.patch_embd.weight", 4, "float32") == "f16"
    # vectors and the position embedding are read by the norms and the add: always float32
    assert vp.weight_format("f16", "v.blk.0.ln1.weight", 1, "float16") == "f32"
    assert vp.weight_format("f16", "v.position_embd.weight", 2, "float16") == "f32"
    with pytest.raises(ValueError, match="bf16"):
        vp.weight_format("bf16", "x", 2, "float32")


LAVAPIPE = DeviceCaps(type="cpu", max_range=1 << 27, host_threads=2)
NVIDIA = DeviceCaps(type="discrete", coopmat=True, subgroup_size=32, max_range=(1 << 32) - 1)
RDNA3 = DeviceCaps(type="integrated", coopmat=True, subgroup_size=64, max_range=(1 << 32) - 1)
OLD_GPU = DeviceCaps(type="discrete", subgroup_size=32)


def gemm_choice(caps: DeviceCaps, fmt: str, t: int, k: int, **opts) -> str:
    return vp.gemm_kernel(policy.resolve(VulkanOptions(**opts), caps), caps, fmt, t, k)


def test_attention_routing():
    def cm(caps, **opts):
        return vp.attention_cm(policy.resolve(VulkanOptions(**opts), caps), caps)

    nvidia = dataclasses.replace(NVIDIA, subgroup_shuffle=True)
    assert cm(nvidia) and not cm(nvidia, attention_cm=False) and not cm(nvidia, coopmat="off")
    assert not cm(NVIDIA)  # no shuffles
    assert not cm(dataclasses.replace(LAVAPIPE, subgroup_shuffle=True)) and not cm(OLD_GPU)


def test_gemm_routing():
    # Gemma 3's GEMMs (one image: 4096 rows; K 1152, the padded FFN 4352 and patch 640; the projector 256)
    assert vp.padded_k(4304) == 4352 and vp.padded_k(3 * 14 * 14) == 640
    assert gemm_choice(NVIDIA, "f16", 4096, 4304) == "vision_linear_f16"  # hence the padding
    for k in (1152, 4352, 640):
        assert gemm_choice(NVIDIA, "f16", 4096, k) == "mul_mm_coopmat_f16_64x64"
        assert gemm_choice(RDNA3, "f16", 4096, k) == "mul_mm_coopmat_f16_64x64"
        assert gemm_choice(LAVAPIPE, "f16", 4096, k) == "mul_mat_reg_f16"  # registers on CPU drivers
        assert gemm_choice(OLD_GPU, "f16", 4096, k) == "mul_mat_f16"
    assert gemm_choice(NVIDIA, "f16", 256, 1152) == "mul_mm_coopmat_f16_64x64"
    assert gemm_choice(NVIDIA, "f16", 16, 1152) == "mul_mm_coopmat_f16_32x64"
    # float32 weights: the tiled mat-mat (cooperative matrices take float16); the options apply
    assert gemm_choice(NVIDIA, "f32", 4096, 1152) == "mul_mat_f32"
    assert gemm_choice(LAVAPIPE, "f32", 4096, 1152) == "mul_mat_reg_f32"
    assert gemm_choice(NVIDIA, "f16", 4096, 1152, coopmat="off") == "mul_mat_f16"
    assert gemm_choice(LAVAPIPE, "f16", 64, 64, matmul_registers="off") == "mul_mat_f16"
    # K not whole steps of 64: vision_linear.comp on every device
    for caps in (NVIDIA, RDNA3, LAVAPIPE, OLD_GPU):
        assert gemm_choice(caps, "f16", 4096, 172) == "vision_linear_f16"
        assert gemm_choice(caps, "f32", 64, 45) == "vision_linear_f32"
        assert gemm_choice(caps, "f16", 64, 96) == "vision_linear_f16"
    assert vp.padded_k(64) == 64 and vp.padded_k(27) == 64 and vp.padded_k(172) == 192
    assert vp.fallback_kernel("f32", transposed=True) == "vision_matmul_f32"


def test_stored_matrices():
    from hmad.backends.vulkan.vision import stored_matrix, stored_tensor

    conv = np.arange(2 * 3 * 3 * 3, dtype=np.float32).reshape(2, 3, 3, 3)
    m = stored_matrix(conv, False)
    assert m.shape == (2, 64) and (m[:, :27] == conv.reshape(2, 27)).all() and (m[:, 27:] == 0).all()
    proj = np.arange(12, dtype=np.float32).reshape(3, 4)  # (in, out)
    assert (stored_matrix(proj, True) == proj.T).all() and stored_matrix(proj, False) is proj
    assert (stored_tensor("mm.input_projection.weight", proj) == proj.T).all()
    up, up_b, down = np.ones((172, 8)), np.ones(172), np.ones((8, 172))
    assert stored_tensor("v.blk.3.ffn_up.weight", up).shape == (192, 8)
    assert (stored_tensor("v.blk.3.ffn_up.weight", up)[172:] == 0).all()
    assert (stored_tensor("v.blk.3.ffn_up.bias", up_b) == np.r_[up_b, np.zeros(20)]).all()
    assert (stored_tensor("v.blk.3.ffn_down.weight", down) == np.c_[down, np.zeros((8, 20))]).all()
    assert stored_tensor("v.blk.3.attn_q.weight", down) is down
    assert stored_tensor("v.post_ln.weight", up_b) is up_b


def test_kernel_choices():
    assert vp.attention_kernel(72) == "vision_attention_dh72"  # Gemma 3's SigLIP: 1152 / 16
    assert vp.attention_kernel(16) == "vision_attention_dh16"
    assert vp.attention_kernel(24) == "vision_attention_any"
    assert vp.attention_kernel(256) == "vision_attention_any"
    assert vp.attention_kernel(260) is None and vp.attention_kernel(18) is None
    assert vp.attention_kernel(72, cm=True) == "vision_attention_cm_d80"
    assert vp.attention_kernel(64, cm=True) == "vision_attention_cm_d64"
    assert vp.attention_kernel(16, cm=True) == "vision_attention_cm_d32"
    assert vp.attention_kernel(24, cm=True) == "vision_attention_cm_d32"
    assert vp.attention_kernel(20, cm=True) == "vision_attention_any"  # not whole 8-value groups
    assert vp.attention_kernel(136, cm=True) == "vision_attention_any"  # over the largest padded head
    assert vp.unsupported(1152, 16) is None
    assert "head size 18" in vp.unsupported(36, 2)


def test_images_per_pass_follows_the_bind_range():
    per = vp.activation_bytes(4096, 1152, 4304, 3 * 14 * 14)  # Gemma 3: the MLP's hidden layer
    assert per == 4 * 4096 * 4304
    lavapipe, h200 = DeviceCaps(type="cpu", max_range=1 << 27), DeviceCaps(max_range=(1 << 32) - 1)
    radv = DeviceCaps(type="integrated", subgroup_size=64, max_range=(1 << 32) - 1)
    assert vp.images_per_pass(8, per, lavapipe) == 1
    assert vp.images_per_pass(8, per, h200) == 8 and vp.images_per_pass(100, per, h200) == 60
    assert vp.images_per_pass(100, per, radv) == 60
    assert vp.images_per_pass(3, 1 << 40, h200) == 1  # one image always (the pool refuses it, with its size)


# -- the device ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend():
    from hmad.backends.vulkan import vkerrors
    from hmad.backends.vulkan.backend import VulkanBackend

    try:
        be = VulkanBackend()
    except (vkerrors.NoVulkanDeviceError, vkerrors.DeviceUnsuitableError, OSError) as e:
        pytest.skip(f"no usable Vulkan device ({e}); apt-get install mesa-vulkan-drivers provides lavapipe")
    yield be
    be.vision_ops().close()
    be.close()


@pytest.fixture(scope="module")
def ops(backend):
    return backend.vision_ops()


@pytest.fixture(scope="module")
def ops32(backend):
    from hmad.backends.vulkan.vision import VulkanVisionOps

    o = VulkanVisionOps(backend.ctx, weight_format="f32")
    yield o
    o.close()


@pytest.fixture(scope="module")
def ops16(backend):
    from hmad.backends.vulkan.vision import VulkanVisionOps

    o = VulkanVisionOps(backend.ctx, weight_format="f16")
    yield o
    o.close()


@pytest.fixture(params=["auto", "tiles"])
def layout(request, backend):
    """The device's own choices ("auto"), or with the text options' register tiles off ("tiles": mul_mat
    rather than mul_mat_reg on a CPU driver; the same as "auto" on a GPU)."""
    opts = backend.ctx.options
    if request.param == "tiles":
        backend.ctx.options = dataclasses.replace(opts, matmul_registers="off")
    yield request.param
    backend.ctx.options = opts


def ran(o, op) -> tuple[np.ndarray, list[str]]:
    """``op()`` on the host, and the labels of the commands its command buffer recorded."""
    y = op()
    labels = list(o.rec.labels)
    return np.asarray(y), labels


def poisoned(ops, op):
    """``op()`` once to size the scratch pool, then again with every scratch buffer filled with NaN at the
    head of its command buffer; the pool must not grow on the second run. Returns the second result."""
    np.asarray(op())
    before = list(ops.scratch.buffers)
    rec = ops._recorder()
    for b in before:
        rec.fill(b, NAN_BITS)
    out = np.asarray(op())
    assert ops.scratch.buffers == before, "an output landed in a buffer that was not poisoned"
    assert np.isfinite(out).all()
    return out


def gemm_bound(x, w, b=None, x16: bool = False):
    """The GEMM tolerance of the module docstring; ``x16``: x rounded to float16 (cooperative matrices)."""
    x64, w64 = np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64))
    mag = x64 @ w64.T
    bias = 0 if b is None else 2e-6 * np.abs(b)
    if not x16:
        return 2e-6 * mag + bias
    sub = 2.0**-24 * x64.max(axis=-1, keepdims=True) * w64.sum(axis=1)
    return (2.0**-11 + 2e-6) * mag + sub + bias


def gemm_route(o, fmt: str, t: int, k: int) -> str:
    return vp.gemm_kernel(o.ctx.options, o.ctx.caps, fmt, t, k)


@pytest.mark.gpu
def test_vision_ops_come_from_the_backend(backend, ops):
    from hmad.backends.vulkan.vision import VulkanVisionOps

    assert isinstance(ops, VulkanVisionOps) and backend.vision_ops() is ops


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f32", "f16"])
@pytest.mark.parametrize("k", [45, 128])  # vision_linear.comp; the text kernels (whole steps of 64)
def test_linear_matches_reference(ops16, ops32, layout, fmt, k):
    rng = np.random.default_rng(1)
    o = ops16 if fmt == "f16" else ops32
    x = rng.standard_normal((2, 37, k)).astype(np.float32)  # 74 rows: partial tiles everywhere
    w = rng.standard_normal((70, k)).astype(np.float32)
    b = rng.standard_normal(70).astype(np.float32)
    wr = w.astype(np.float16).astype(np.float32) if fmt == "f16" else w
    route = gemm_route(o, fmt, 74, k)
    assert (route == f"vision_linear_{fmt}") == (k == 45)
    x16 = route.startswith("mul_mm_coopmat_")
    got = poisoned(o, lambda: o.linear(x, w, b))
    assert got.shape == (2, 37, 70)
    err = np.abs(got - REF.linear(x, wr, b))
    assert (err <= gemm_bound(x, wr, b, x16).reshape(err.shape)).all(), err.max()
    got = poisoned(o, lambda: o.linear(x, w, None))
    assert (np.abs(got - REF.linear(x, wr, None)) <= gemm_bound(x, wr, None, x16).reshape(got.shape)).all()
    _, labels = ran(o, lambda: o.linear(x, w, b))
    assert route in labels  # the bias: vision_linear's epilogue, or pending (added by the reader: to_host)


@pytest.mark.gpu
def test_a_gemm_bias_is_added_by_its_reader(ops16):
    """A text-kernel GEMM's bias is left pending: GELU adds it in its pass (vision_bias_gelu), an add in
    its (vision_add3: a residual, the position embedding), the attention as it reads q, k and v, anything
    else first (vision_add); against the
    numpy ops on the device's own linear output (the sums in another order: 1e-6 relative)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 9, 64)).astype(np.float32)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    res = rng.standard_normal((2, 9, 32)).astype(np.float32)
    pos = rng.standard_normal((9, 32)).astype(np.float32)
    lin = np.asarray(ops16.linear(x, w, b))  # deterministic: the same kernel and order each time
    cases = {
        "vision_bias_gelu": (lambda: ops16.gelu_tanh(ops16.linear(x, w, b)), REF.gelu_tanh(lin)),
        "vision_add3": (lambda: ops16.add(res, ops16.linear(x, w, b)), res + lin),
    }
    for kernel, (op, want) in cases.items():
        got, labels = ran(ops16, op)
        assert kernel in labels and "vision_add" not in labels, labels
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        np.testing.assert_allclose(poisoned(ops16, op), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    got, labels = ran(ops16, lambda: ops16.add(ops16.linear(x, w, b), pos))
    assert "vision_add3" in labels and "vision_add" not in labels
    np.testing.assert_allclose(got, lin + pos, rtol=1e-6, atol=1e-6 * np.abs(lin).max())
    got, labels = ran(
        ops16, lambda: ops16.add(ops16.linear(x, w, b), ops16.linear(x, w, b))
    )  # one bias added first
    assert labels.count("vision_add") == 1 and "vision_add3" in labels
    np.testing.assert_allclose(got, 2 * lin, rtol=1e-6, atol=1e-6 * np.abs(lin).max())
    got, labels = ran(
        ops16, lambda: ops16.linear(ops16.linear(x, w, b), w.T.copy(), None)
    )  # added before a GEMM
    assert labels.count("vision_add") == 1
    x16 = gemm_route(ops16, "f16", 18, 32).startswith("mul_mm_coopmat_")
    assert (np.abs(got - REF.linear(lin, r16(w.T), None)) <= gemm_bound(lin, r16(w.T), None, x16)).all()
    # the attention adds q's, k's and v's biases as it reads them (2 heads of 16)
    ws = [rng.standard_normal((32, 64)).astype(np.float32) / 8 for _ in range(3)]
    bs = [rng.standard_normal(32).astype(np.float32) for _ in range(3)]
    lins = [np.asarray(ops16.linear(x, wi, bi)) for wi, bi in zip(ws, bs, strict=True)]

    def attn():
        return ops16.attention(*(ops16.linear(x, wi, bi) for wi, bi in zip(ws, bs, strict=True)), 2, 0.25)

    got, labels = ran(ops16, attn)
    assert "vision_add" not in labels
    if vp.attention_kernel(16, vp.attention_cm(ops16.ctx.options, ops16.ctx.caps)).startswith(
        "vision_attention_cm"
    ):
        want = REF.attention(r16(lins[0] * np.float32(0.25)), r16(lins[1]), r16(lins[2]), 2, 1.0)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(lins[2]).max())
    else:
        want = REF.attention(*lins, 2, 0.25)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(lins[2]).max())
    got = np.asarray(ops16.linear(x, w, b).reshape(2, 9 * 32))  # a reshape of the last axis adds it first
    np.testing.assert_allclose(got, lin.reshape(2, 288), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f32", "f16"])
def test_projector_matmul_matches_reference(ops16, ops32, layout, fmt):
    rng = np.random.default_rng(2)
    o = ops16 if fmt == "f16" else ops32
    x = rng.standard_normal((3, 9, 64)).astype(np.float32)
    w = rng.standard_normal((64, 66)).astype(np.float32)  # (D, E): read as (K, N), stored transposed
    wr = w.astype(np.float16).astype(np.float32) if fmt == "f16" else w
    route = gemm_route(o, fmt, 27, 64)
    assert not route.startswith("vision_")
    got = poisoned(o, lambda: o.matmul(x, w))
    err = np.abs(got - REF.matmul(x, wr))
    assert (err <= gemm_bound(x, wr.T, None, route.startswith("mul_mm_")).reshape(err.shape)).all(), err.max()
    assert route in ran(o, lambda: o.matmul(x, w))[1]


@pytest.mark.gpu
@pytest.mark.parametrize("patch", [4, 5])  # K 48, 75: padded to 64, 128
def test_patch_embed_matches_reference(ops16, layout, patch):
    rng = np.random.default_rng(3)
    g = 20 // patch
    px = rng.standard_normal((2, 3, 20, 20)).astype(np.float32)
    w = rng.standard_normal((24, 3, patch, patch)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    wr = w.astype(np.float16).astype(np.float32)
    route = gemm_route(ops16, "f16", 2 * g * g, vp.padded_k(3 * patch * patch))
    got = poisoned(ops16, lambda: ops16.patch_embed(px, w, b, patch))
    want = REF.patch_embed(px, wr, b, patch)
    k = 3 * patch * patch
    cols = px.reshape(2, 3, g, patch, g, patch).transpose(0, 2, 4, 1, 3, 5).reshape(2, g * g, k)
    assert got.shape == want.shape == (2, g * g, 24)
    bound = gemm_bound(cols, wr.reshape(24, k), b, route.startswith("mul_mm_"))
    assert (np.abs(got - want) <= bound).all()
    assert route in ran(ops16, lambda: ops16.patch_embed(px, w, b, patch))[1]


@pytest.mark.gpu
def test_norms_match_reference(ops):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 11, 300)) * 3 + 1.5).astype(np.float32)  # a row over the 256 threads
    w, b = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    got = poisoned(ops, lambda: ops.layer_norm(x, w, b, 1e-6))
    np.testing.assert_allclose(got, REF.layer_norm(x, w, b, 1e-6), rtol=1e-5, atol=1e-5)
    got = poisoned(ops, lambda: ops.rms_norm(x, w, 1e-6))
    np.testing.assert_allclose(got, REF.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gelu_add_pool_match_reference(ops):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((2, 36, 20)) * 6).astype(np.float32)
    x[0, 0, :4] = [-100.0, 100.0, -1e4, 0.0]  # far tails stay finite
    got = poisoned(ops, lambda: ops.gelu_tanh(x))
    want = REF.gelu_tanh(x)
    assert (np.abs(got - want) <= 1e-6 * np.abs(x) + 1e-6).all()
    y = rng.standard_normal(x.shape).astype(np.float32)
    pos = rng.standard_normal((36, 20)).astype(np.float32)
    np.testing.assert_allclose(poisoned(ops, lambda: ops.add(x, y)), REF.add(x, y), rtol=1e-6)
    np.testing.assert_allclose(poisoned(ops, lambda: ops.add(x, pos)), REF.add(x, pos), rtol=1e-6)
    got = poisoned(ops, lambda: ops.avg_pool(x, 6, 3))
    np.testing.assert_allclose(got, REF.avg_pool(x, 6, 3), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize(("p", "heads", "dh"), [(70, 2, 16), (33, 1, 72), (150, 3, 24), (100, 2, 64)])
def test_attention_matches_reference(ops, p, heads, dh):
    """Head sizes with their own variant (16, Gemma's 72) and the run-time-sized one (24); P over one
    workgroup of queries and not a multiple of the key chunk. Where the device runs it on cooperative
    matrices (vision_attention_cm: 16, 72, 24 and 64 padded to 32, 80, 32 and 64),
    against the reference on float16-rounded q * scale, k and v, within 2e-3 * max |v| (P in float16:
    2^-11 relative a weight, l summing the same rounded weights)."""
    rng = np.random.default_rng(6 + p)
    q, k, v = (rng.standard_normal((2, p, heads * dh)).astype(np.float32) for _ in range(3))
    scale = dh**-0.5
    name = vp.attention_kernel(dh, vp.attention_cm(ops.ctx.options, ops.ctx.caps))
    got, labels = ran(ops, lambda: ops.attention(q * 2, k, v, heads, scale))
    assert name in labels
    got = poisoned(ops, lambda: ops.attention(q * 2, k, v, heads, scale))
    if name.startswith("vision_attention_cm"):
        want = REF.attention(r16(q * 2 * scale), r16(k), r16(v), heads, 1.0)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(v).max())
    else:
        np.testing.assert_allclose(got, REF.attention(q * 2, k, v, heads, scale), rtol=1e-5, atol=2e-6)


# -- the whole tower -----------------------------------------------------------------------------------------
def random_tower(cfg, seed: int) -> dict[str, np.ndarray]:
    """Weights of ``cfg``'s shapes, scaled like tests/hf_tiny.py's real tiny tower."""
    from hmad.model.vision import expected_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith(("ln1.weight", "ln2.weight", "post_ln.weight")):
            a = 1 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            a = 0.05 * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / math.sqrt(math.prod(shape[1:]) if len(shape) != 2 else shape[-1])
        out[name] = a.astype(np.float32)
    out["mm.soft_emb_norm.weight"] += 1
    return out


def r16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


class F16Reference(VisionOps):
    """The numpy ops on the matrices as ``ops`` stores them (float16-rounded where its format says), with x
    rounded to float16 where ``ops`` runs that GEMM on cooperative matrices (row_scale.comp's copy), and
    q * scale, k, v where it runs the attention on them."""

    def __init__(self, ops):
        self.ops = ops
        coopmat = policy.coopmat_on(ops.ctx.options, ops.ctx.caps)
        self.w16 = vp.weight_format(ops.weight_format, "", 2, "float32", coopmat) == "f16"

    def _w(self, w: np.ndarray) -> np.ndarray:
        return r16(w) if self.w16 else w

    def attention(self, q, k, v, n_heads: int, scale: float):
        dh = q.shape[-1] // n_heads
        name = vp.attention_kernel(dh, vp.attention_cm(self.ops.ctx.options, self.ops.ctx.caps))
        if not name.startswith("vision_attention_cm"):
            return super().attention(q, k, v, n_heads, scale)
        return super().attention(r16(q * np.float32(scale)), r16(k), r16(v), n_heads, 1.0)

    def _x(self, x: np.ndarray, t: int, k: int) -> np.ndarray:
        return r16(x) if gemm_route(self.ops, "f16", t, k).startswith("mul_mm_coopmat_") else x

    def patch_embed(self, pixels, w, b, patch: int):
        n, c, s, _ = pixels.shape
        px = self._x(pixels, n * (s // patch) ** 2, vp.padded_k(c * patch * patch))  # im2col only moves them
        return super().patch_embed(px, self._w(w), b, patch)

    def linear(self, x, w, b):
        return super().linear(self._x(x, x.size // x.shape[-1], x.shape[-1]), self._w(w), b)

    def matmul(self, x, w):
        return super().matmul(self._x(x, x.size // x.shape[-1], x.shape[-1]), self._w(w))


def tower_tol(ops) -> float:
    """The whole tower's tolerance (module docstring): 2e-3 where some GEMM or the attention may run on
    cooperative matrices, else 2e-4."""
    return 2e-3 if policy.coopmat_on(ops.ctx.options, ops.ctx.caps) else 2e-4


def check_tower(cfg, weights, ops, n_images: int, seed: int):
    from hmad.model.siglip import VisionTower

    rng = np.random.default_rng(seed)
    ref, tol = F16Reference(ops), tower_tol(ops)
    px = rng.uniform(-1, 1, (n_images, 3, cfg.image_size, cfg.image_size)).astype(np.float32)
    want = VisionTower(cfg, weights, ref).encode(px)
    tower = VisionTower(cfg, ops.upload(weights), ops)
    recordings = ops.recordings
    got = ops.run(tower, px)
    assert got.shape == want.shape == (n_images, cfg.mm_tokens_per_image, cfg.text_hidden)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    # replayed with other pixels: recorded once
    px2 = rng.uniform(-1, 1, px.shape).astype(np.float32)
    want2 = VisionTower(cfg, weights, ref).encode(px2)
    np.testing.assert_allclose(ops.run(tower, px2), want2, rtol=tol, atol=tol * np.abs(want2).max())
    assert ops.recordings == recordings + 1
    # the same through the arrays themselves (uploaded on first use), and np.asarray on the result
    got2 = np.asarray(VisionTower(cfg, weights, ops).encode(px))
    np.testing.assert_allclose(got2, want, rtol=tol, atol=tol * np.abs(want).max())
    # against the float32 weights: float16 storage (and x) cost more, within a few times that
    want32 = VisionTower(cfg, weights, REF).encode(px)
    np.testing.assert_allclose(got, want32, rtol=10 * tol, atol=10 * tol * np.abs(want32).max())
    return tower, px, want


@pytest.mark.gpu
def test_tiny_hf_tower_matches_numpy(ops, tmp_path, monkeypatch):
    """The real tiny VLM checkpoint's tower, its weights packed into several small arenas."""
    from hf_tiny import make_tiny_hf_checkpoint

    from hmad.backends.vulkan import vision
    from hmad.model.vision import read_hf_vision

    make_tiny_hf_checkpoint(tmp_path, multimodal=True, vision="real")
    cfg, weights = read_hf_vision(tmp_path)
    monkeypatch.setattr(vision, "ARENA_BYTES", 16 << 10)
    before, arenas = ops.encodes, len(ops.arenas)
    check_tower(cfg, weights, ops, 3, seed=7)
    assert ops.encodes == before + 3  # one submit an encode (2 replays, 1 per call)
    assert len(ops.arenas) > arenas + 2


def medium_config():
    from hmad.model.vision import VisionConfig

    return VisionConfig(
        image_size=64,
        patch_size=4,
        hidden=64,
        n_layers=2,
        n_heads=2,
        ffn=172,
        eps=1e-6,
        mm_tokens_per_image=16,
        text_hidden=96,
    )


@pytest.mark.gpu
def test_medium_tower_float16_weights(ops16):
    """The medium tower with its matrices stored float16 (as the weight format auto stores them where the
    GEMMs run on cooperative matrices), against numpy on the same rounded matrices."""
    cfg = medium_config()
    check_tower(cfg, random_tower(cfg, 13), ops16, 2, seed=14)


@pytest.mark.gpu
def test_medium_tower_matches_numpy_in_passes(backend, ops):
    """2 images of 16 x 16 patches, width 64 in 2 heads of 32, FFN 172, a 4 x 4 pool, text width 96; then
    with a bind range that holds one image's activations, so ``encode`` runs one pass an image."""
    cfg = medium_config()
    tower, px, want = check_tower(cfg, random_tower(cfg, 11), ops, 2, seed=12)
    tol = tower_tol(ops)
    # every GEMM of the uploaded tower on the text kernels: fc1 and q/k/v/out (K 64), the patch embedding
    # (K 48 padded to 64), fc2 (K 172 padded to 192); check_tower's arrays (not padded) ran fc2 on
    # vision_linear.comp
    fmt = "f16" if F16Reference(ops).w16 else "f32"
    routes = {gemm_route(ops, fmt, 2 * 256, k) for k in (64, 192)}
    assert gemm_route(ops, fmt, 2 * 256, 172) == f"vision_linear_{fmt}" and not any(
        "vision" in r for r in routes
    )
    if ops.dev.caps["timestamps"]:  # a replay with timestamps: its own recording, every command labelled
        recordings = ops.recordings
        ops.timestamps = True
        try:
            np.testing.assert_allclose(ops.run(tower, px), want, rtol=tol, atol=tol * np.abs(want).max())
        finally:
            ops.timestamps = False
        labels = [lab for lab, _ in ops.last_gpu["commands"]]
        assert routes <= set(labels) and ops.recordings == recordings + 1
        assert not any(lab.startswith("vision_linear") for lab in labels)
        ops.run(tower, px)
        assert ops.recordings == recordings + 1 and ops.last_gpu == {}
    caps = backend.ctx.caps
    per = vp.activation_bytes(cfg.n_patches, cfg.hidden, cfg.ffn, 48)
    backend.ctx.caps = dataclasses.replace(caps, max_range=per)
    try:
        before, recordings = ops.encodes, ops.recordings
        got = ops.run(tower, px)
        assert ops.encodes == before + 2 and ops.recordings == recordings + 1  # 1 image a pass
    finally:
        backend.ctx.caps = caps
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.gpu
def test_timestamps_label_every_command(ops):
    if not ops.dev.caps["timestamps"]:
        pytest.skip("the device has no timestamps")
    x = np.ones((1, 4, 8), np.float32)
    ops.timestamps = True
    try:
        np.asarray(ops.add(ops.gelu_tanh(x), x))
    finally:
        ops.timestamps = False
    labels = [lab for lab, _ in ops.last_gpu["commands"]]
    assert labels[:3] == ["vision input", "vision_gelu", "vision_add"] and labels[-1] == "vision output"
    assert ops.last_gpu["total_ns"] >= 0


@pytest.mark.gpu
def test_a_stale_activation_is_refused(ops):
    x = np.ones((1, 4, 8), np.float32)
    y = ops.gelu_tanh(x)
    np.asarray(ops.gelu_tanh(y))
    with pytest.raises(ValueError, match="stale"):
        ops.gelu_tanh(y)


@pytest.mark.gpu
def test_cooperative_matrix_routing_records_every_kernel_as_built(backend, monkeypatch):
    """Where the device has cooperative matrices (not lavapipe, whose driver cannot build those kernels):
    a tower's encode recorded with the capabilities of such a device and a recorder that checks each
    dispatch against the build list (binding count, push-constant struct) instead of recording it. Every
    GEMM of the uploaded tower runs mul_mm_coopmat after one row_scale per input (q, k, v share one), the
    attention vision_attention_cm with the q, k, v biases fused, the other biases in vision_bias_gelu /
    vision_add3, and the weights are float16 (weight format auto)."""
    from types import SimpleNamespace

    from hmad.backends.vulkan.kernels_coopmat import coopmat_variant
    from hmad.backends.vulkan.registry import SOURCES
    from hmad.backends.vulkan.variants import VARIANTS
    from hmad.backends.vulkan.vision import VulkanVisionOps
    from hmad.model.siglip import VisionTower

    built = {v.name: v for v in VARIANTS}
    ctx = backend.ctx
    monkeypatch.setattr(ctx, "caps", dataclasses.replace(NVIDIA, subgroup_shuffle=True))
    monkeypatch.setattr(ctx, "options", dataclasses.replace(ctx.options, coopmat_waves=False))
    device = SimpleNamespace(limits={**ctx.dev.limits, "maxComputeSharedMemorySize": 48 << 10})

    def kernel(name, block=None):
        v = built[name]
        size = coopmat_variant(name)[1].block if name.startswith("mul_mm") else block or SOURCES[v.source][1]
        return SimpleNamespace(name=name, block_size=size, device=device, groups_for=lambda n: (n, 1, 1))

    calls = []

    class Checker:
        def dispatch(self, k, buffers, push, groups, label=""):
            v = built[k.name]
            assert len(buffers) == v.n_buffers and type(push) is SOURCES[v.source][0], k.name
            calls.append((k.name, getattr(push, "bias", None)))

        def copy(self, *args, **kwargs):
            calls.append(("copy", None))

    monkeypatch.setattr(ctx, "kernel", kernel)
    o = VulkanVisionOps(ctx)
    try:
        o.rec = Checker()
        o._recorder = lambda: o.rec
        cfg = dataclasses.replace(medium_config(), hidden=128, n_layers=1)  # 2 heads of 64
        weights = o.upload(random_tower(cfg, 5))
        assert weights["v.blk.0.attn_q.weight"].fmt == "f16" and weights["v.patch_embd.weight"].nk == (
            128,
            64,
        )
        VisionTower(cfg, weights, o).encode(np.zeros((2, 3, 64, 64), np.float32))
    finally:
        o.rec = None
        o.close()
    names = [n for n, _ in calls]
    assert not any(n.startswith(("vision_linear", "vision_matmul", "mul_mat_")) for n in names), names
    gemms = [n for n in names if n.startswith("mul_mm_coopmat_f16_")]
    assert len(gemms) == 8 and names.count("row_scale") == 6  # patch, q k v, out, fc1, fc2, projector
    assert ("vision_attention_cm_d64", 1) in calls and "vision_add" not in names
    assert names.count("vision_bias_gelu") == 1 and names.count("vision_add3") == 3
