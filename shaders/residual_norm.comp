#version 450
// The residual step between two sub-layers, one workgroup per token row (fused: three dispatches -> one):
//   x' = x + rms(a) * wa          (the sub-layer output, post-normed, added to the residual stream)
//   h  = rms(x') * wh             (the next sub-layer's pre-norm; with NEXT defined)
// rms(v) = v / sqrt(mean(v^2) + eps), sums in float32 as rms_norm.comp. Q8OUT: h is also written quantized
// for the int8 mat-vec (q8act.glsl), through a copy of the row in shared memory (D <= MAX_COLS).
// Bindings: 0 x, 1 a, 2 wa, 3 x' [, 4 wh, 5 h [, 6 hq, 7 hd]].
#include "common.glsl"
#extension GL_KHR_shader_subgroup_arithmetic : require
#ifdef Q8OUT
#include "q8act.glsl"
#define MAX_COLS 6144  // Gemma 3 27B: 5376 (24 KiB of shared memory)
#endif

layout(binding = 0) readonly buffer X { float x[]; };
layout(binding = 1) readonly buffer A { float a[]; };
layout(binding = 2) readonly buffer WA { float wa[]; };
layout(binding = 3) writeonly buffer XO { float xo[]; };
#ifdef NEXT
layout(binding = 4) readonly buffer WH { float wh[]; };
layout(binding = 5) writeonly buffer H { float h[]; };
#endif
#ifdef Q8OUT
layout(binding = 6) writeonly buffer HQ { uint hq[]; };
layout(binding = 7) writeonly buffer HD { vec2 hd[]; };
#endif

layout(push_constant) uniform Push {
    uint ncols;  // D
    uint nrows;  // T
    float eps;
} p;

shared float partial[BLOCK_SIZE];
#ifdef Q8OUT
shared float s_h[MAX_COLS];  // this row's h (host asserts ncols <= MAX_COLS)
#endif

// the sum over the workgroup of every invocation's v: subgroupAdd, then the subgroups' sums through shared
// memory (two barriers, not a log2(BLOCK_SIZE)-level tree: this kernel runs on one token's row at a time)
float workgroup_sum(float v) {
    barrier();  // partial may still be read from the previous call
    v = subgroupAdd(v);
    if (subgroupElect()) partial[gl_SubgroupID] = v;
    barrier();
    float s = 0.0;
    for (uint i = 0; i < gl_NumSubgroups; ++i) s += partial[i];
    return s;
}

void main() {
    const uint row = group_index();
    if (row >= p.nrows) return;  // uniform per workgroup
    const uint tid = gl_LocalInvocationID.x, o = row * p.ncols;
    float ss = 0.0;
    for (uint c = tid; c < p.ncols; c += BLOCK_SIZE) ss += a[o + c] * a[o + c];
    const float sa = inversesqrt(workgroup_sum(ss) / float(p.ncols) + p.eps);
    ss = 0.0;
    for (uint c = tid; c < p.ncols; c += BLOCK_SIZE) {
        const float v = x[o + c] + a[o + c] * sa * wa[c];
        xo[o + c] = v;
        ss += v * v;
    }
#ifdef NEXT
    const float sh = inversesqrt(workgroup_sum(ss) / float(p.ncols) + p.eps);
#ifndef Q8OUT
    for (uint c = tid; c < p.ncols; c += BLOCK_SIZE) h[o + c] = (x[o + c] + a[o + c] * sa * wa[c]) * sh * wh[c];
#else
    // h into shared memory (every invocation, strided), then one XQ word (4 values) per invocation: the
    // block's max and sum read from shared memory (8 words a block), so no invocation runs a serial chain
    for (uint c = tid; c < p.ncols; c += BLOCK_SIZE) {
        const float v = (x[o + c] + a[o + c] * sa * wa[c]) * sh * wh[c];
        h[o + c] = v;
        s_h[c] = v;
    }
    barrier();
    for (uint w = tid; w < p.ncols / 4u; w += BLOCK_SIZE) {
        const uint b0 = (w / 8u) * 32u;
        float amax = 0.0;
        for (uint i = 0; i < 32u; ++i) amax = max(amax, abs(s_h[b0 + i]));
        const float d = amax / 127.0;
        const float id = d != 0.0 ? 1.0 / d : 0.0;
        const vec4 r = vec4(s_h[4u * w], s_h[4u * w + 1u], s_h[4u * w + 2u], s_h[4u * w + 3u]) * id;
        const ivec4 q = ivec4(sign(r) * floor(abs(r) + 0.5));  // roundf
        hq[row * (p.ncols / 4u) + w] = uint(q.x & 0xFF) | (uint(q.y & 0xFF) << 8) | (uint(q.z & 0xFF) << 16)
                                     | (uint(q.w) << 24);
        if (w % 8u == 0u) {
            int sum = 0;
            for (uint i = 0; i < 32u; ++i) sum += int(sign(s_h[b0 + i] * id) * floor(abs(s_h[b0 + i] * id) + 0.5));
            hd[row * (p.ncols / 32u) + w / 8u] = vec2(d, d * float(sum));
        }
    }
#endif
#endif
}
