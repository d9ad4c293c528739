#version 450
// The residual step between two sub-layers, one workgroup per token row (fused: three dispatches -> one):
//   x' = x + rms(a) * wa          (the sub-layer output, post-normed, added to the residual stream)
//   h  = rms(x') * wh             (the next sub-layer's pre-norm; with NEXT defined)
// rms(v) = v / sqrt(mean(v^2) + eps), sums in float32 as rms_norm.comp. Q8OUT: h is also written quantized
// for the int8 mat-vec (q8act.glsl); each invocation then owns whole 32-blocks and recomputes their h (the
// same arithmetic, so the same values) rather than reading back what other invocations wrote.
// Bindings: 0 x, 1 a, 2 wa, 3 x' [, 4 wh, 5 h [, 6 hq, 7 hd]].
#include "common.glsl"
#ifdef Q8OUT
#include "q8act.glsl"
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

// the sum over the workgroup of every invocation's v
float workgroup_sum(float v) {
    const uint tid = gl_LocalInvocationID.x;
    barrier();  // partial may still be read from the previous call
    partial[tid] = v;
    barrier();
    [[unroll]] for (uint s = BLOCK_SIZE / 2u; s > 0u; s >>= 1) {
        if (tid < s) partial[tid] += partial[tid + s];
        barrier();
    }
    return partial[0];
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
    for (uint j = tid; j < p.ncols / 32u; j += BLOCK_SIZE) {
        float v[32];
        float amax = 0.0;
        [[unroll]] for (uint i = 0; i < 32u; ++i) {
            const uint c = 32u * j + i;
            v[i] = (x[o + c] + a[o + c] * sa * wa[c]) * sh * wh[c];
            h[o + c] = v[i];
            amax = max(amax, abs(v[i]));
        }
        const float d = amax / 127.0;
        const float id = d != 0.0 ? 1.0 / d : 0.0;
        int sum = 0;
        [[unroll]] for (uint i = 0; i < 8u; ++i) {
            uint word = 0u;
            [[unroll]] for (uint e = 0; e < 4u; ++e) {
                const float r = v[4u * i + e] * id;
                const int q = int(sign(r) * floor(abs(r) + 0.5));
                sum += q;
                word |= uint(q & 0xFF) << (8u * e);
            }
            hq[row * (p.ncols / 4u) + 8u * j + i] = word;
        }
        hd[row * (p.ncols / 32u) + j] = vec2(d, d * float(sum));
    }
#endif
#endif
}
