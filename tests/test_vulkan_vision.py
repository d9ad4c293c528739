"""The vision encoder on the Vulkan backend (backends/vulkan/vision.py) against the numpy VisionOps.

Kernel tests: each op on fresh random inputs, its output range poisoned with NaN first (every scratch
buffer the op's outputs can land in is filled with NaN at the head of the same command buffer, and the pool
must not grow, so no output comes from an unpoisoned buffer). Then the whole tower: the tiny VLM checkpoint
of tests/hf_tiny.py, and a medium random tower (2 images of 256 patches, width 64, FFN 172: partial GEMM
tiles along rows, columns and K, several attention workgroups per head), against model/siglip.py's
VisionTower on the numpy ops, through ``vision.encode`` (recorded once per image count, replayed with new
pixels) and through the tower's own ``encode`` (one command buffer a call). The kernel-choice functions
(vision_policy.py) are tested without a device.

Tolerances (float32 everywhere on the device, sums in another order than numpy's):
- GEMM (linear, matmul, patch embedding): |err| <= 2e-6 * (|x| @ |w| + |b|), about K^0.5 float32 roundings
  of the magnitudes summed; with float16 weights the reference is numpy on the same float16-rounded weights
  (the kernel widens them exactly), so the bound is the same; against the float32 weights the float16
  storage costs up to 2^-11 relative per weight (not asserted: that is the format's, not the kernel's);
- layer norm, RMS norm: rtol 1e-5, atol 1e-5 (one-pass sums in a tree, inversesqrt instead of / sqrt);
- GELU: |err| <= 1e-6 |x| + 1e-6 (the 1 / (1 + exp(-2u)) form against 0.5 (1 + tanh u));
- add, average pool: 1e-6 relative (the pool sums row by row, then divides; numpy's mean sums pairwise);
- attention: rtol 1e-5, atol 2e-6 (online softmax in exp2, chunk by chunk);
- the whole tower: rtol 2e-4, atol 2e-4 * max |reference| (the per-op errors through LayerNorms and GEMMs).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hmad.backends.vision_ops import VisionOps
from hmad.backends.vulkan import vision_policy as vp
from hmad.backends.vulkan.policy import DeviceCaps

REF = VisionOps()
NAN_BITS = 0x7FC00000


# -- kernel choice (no device) -------------------------------------------------------------------------------
def test_weight_formats():
    assert vp.weight_format("auto", "v.blk.0.attn_q.weight", 2, "float32") == "f32"
    assert vp.weight_format("auto", "v.blk.0.attn_q.weight", 2, "float16") == "f16"
    assert vp.weight_format("f16", "v.blk.0.ffn_up.weight", 2, "float32") == "f16"
    assert vp.weight_format("f32", "mm.input_projection.weight", 2, "float16") == "f32"
    assert vp.weight_format("f16", "v.patch_embd.weight", 4, "float32") == "f16"
    # vectors and the position embedding are read by the norms and the add: always float32
    assert vp.weight_format("f16", "v.blk.0.ln1.weight", 1, "float16") == "f32"
    assert vp.weight_format("f16", "v.position_embd.weight", 2, "float16") == "f32"
    with pytest.raises(ValueError, match="bf16"):
        vp.weight_format("bf16", "x", 2, "float32")


def test_kernel_choices():
    assert vp.gemm_kernel("f16", transposed=False) == "vision_linear_f16"
    assert vp.gemm_kernel("f32", transposed=True) == "vision_matmul_f32"
    assert vp.attention_kernel(72) == "vision_attention_dh72"  # Gemma 3's SigLIP: 1152 / 16
    assert vp.attention_kernel(16) == "vision_attention_dh16"
    assert vp.attention_kernel(24) == "vision_attention_any"
    assert vp.attention_kernel(256) == "vision_attention_any"
    assert vp.attention_kernel(260) is None and vp.attention_kernel(18) is None
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
def ops16(backend):
    from hmad.backends.vulkan.vision import VulkanVisionOps

    o = VulkanVisionOps(backend.ctx, weight_format="f16")
    yield o
    o.close()


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


def gemm_bound(x, w, b=None):
    mag = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    return 2e-6 * (mag + (0 if b is None else np.abs(b)))


@pytest.mark.gpu
def test_vision_ops_come_from_the_backend(backend, ops):
    from hmad.backends.vulkan.vision import VulkanVisionOps

    assert isinstance(ops, VulkanVisionOps) and backend.vision_ops() is ops


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f32", "f16"])
def test_linear_matches_reference(ops, ops16, fmt):
    rng = np.random.default_rng(1)
    o = ops16 if fmt == "f16" else ops
    x = rng.standard_normal((2, 37, 45)).astype(np.float32)  # 74 rows, K 45: partial tiles everywhere
    w = rng.standard_normal((70, 45)).astype(np.float32)
    b = rng.standard_normal(70).astype(np.float32)
    wr = w.astype(np.float16).astype(np.float32) if fmt == "f16" else w
    got = poisoned(o, lambda: o.linear(x, w, b))
    assert got.shape == (2, 37, 70)
    err = np.abs(got - REF.linear(x, wr, b))
    assert (err <= gemm_bound(x, wr, b).reshape(err.shape)).all(), err.max()
    got = poisoned(o, lambda: o.linear(x, w, None))
    assert (np.abs(got - REF.linear(x, wr, None)) <= gemm_bound(x, wr).reshape(got.shape)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["f32", "f16"])
def test_projector_matmul_matches_reference(ops, ops16, fmt):
    rng = np.random.default_rng(2)
    o = ops16 if fmt == "f16" else ops
    x = rng.standard_normal((3, 9, 40)).astype(np.float32)
    w = rng.standard_normal((40, 66)).astype(np.float32)  # (D, E): read as (K, N)
    wr = w.astype(np.float16).astype(np.float32) if fmt == "f16" else w
    got = poisoned(o, lambda: o.matmul(x, w))
    err = np.abs(got - REF.matmul(x, wr))
    assert (err <= gemm_bound(x, wr.T).reshape(err.shape)).all(), err.max()


@pytest.mark.gpu
def test_patch_embed_matches_reference(ops):
    rng = np.random.default_rng(3)
    px = rng.standard_normal((2, 3, 20, 20)).astype(np.float32)  # 5 x 5 patches of 4
    w = rng.standard_normal((24, 3, 4, 4)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    got = poisoned(ops, lambda: ops.patch_embed(px, w, b, 4))
    want = REF.patch_embed(px, w, b, 4)
    cols = px.reshape(2, 3, 5, 4, 5, 4).transpose(0, 2, 4, 1, 3, 5).reshape(2, 25, 48)
    assert got.shape == want.shape == (2, 25, 24)
    assert (np.abs(got - want) <= gemm_bound(cols, w.reshape(24, 48), b)).all()


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
@pytest.mark.parametrize(("p", "heads", "dh"), [(70, 2, 16), (33, 1, 72), (150, 3, 24)])
def test_attention_matches_reference(ops, p, heads, dh):
    """Head sizes with their own variant (16, Gemma's 72) and the run-time-sized one (24); P over one
    workgroup of queries and not a multiple of the key chunk."""
    rng = np.random.default_rng(6 + p)
    q, k, v = (rng.standard_normal((2, p, heads * dh)).astype(np.float32) for _ in range(3))
    scale = dh**-0.5
    got = poisoned(ops, lambda: ops.attention(q * 2, k, v, heads, scale))
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


def check_tower(cfg, weights, ops, n_images: int, seed: int):
    from hmad.model.siglip import VisionTower

    rng = np.random.default_rng(seed)
    px = rng.uniform(-1, 1, (n_images, 3, cfg.image_size, cfg.image_size)).astype(np.float32)
    want = VisionTower(cfg, weights, REF).encode(px)
    tower = VisionTower(cfg, ops.upload(weights), ops)
    recordings = ops.recordings
    got = ops.run(tower, px)
    assert got.shape == want.shape == (n_images, cfg.mm_tokens_per_image, cfg.text_hidden)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    # replayed with other pixels: recorded once
    px2 = rng.uniform(-1, 1, px.shape).astype(np.float32)
    want2 = VisionTower(cfg, weights, REF).encode(px2)
    np.testing.assert_allclose(ops.run(tower, px2), want2, rtol=2e-4, atol=2e-4 * np.abs(want2).max())
    assert ops.recordings == recordings + 1
    # the same through the arrays themselves (uploaded on first use), and np.asarray on the result
    got2 = np.asarray(VisionTower(cfg, weights, ops).encode(px))
    np.testing.assert_allclose(got2, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
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


@pytest.mark.gpu
def test_medium_tower_matches_numpy_in_passes(backend, ops):
    """2 images of 16 x 16 patches, width 64 in 2 heads of 32, FFN 172, a 4 x 4 pool, text width 96; then
    with a bind range that holds one image's activations, so ``encode`` runs one pass an image."""
    from hmad.model.vision import VisionConfig

    cfg = VisionConfig(
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
    tower, px, want = check_tower(cfg, random_tower(cfg, 11), ops, 2, seed=12)
    caps = backend.ctx.caps
    per = vp.activation_bytes(cfg.n_patches, cfg.hidden, cfg.ffn, 48)
    backend.ctx.caps = dataclasses.replace(caps, max_range=per)
    try:
        before, recordings = ops.encodes, ops.recordings
        got = ops.run(tower, px)
        assert ops.encodes == before + 2 and ops.recordings == recordings + 1  # 1 image a pass
    finally:
        backend.ctx.caps = caps
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


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
