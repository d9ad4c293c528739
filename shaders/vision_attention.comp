#version 450
// Dense non-causal attention of the vision encoder, flash style (one pass, online softmax):
// o = softmax(q k^T * scale) v per image and head; q, k, v, o (n, P, W) float32, W = heads * dh, head h in
// columns h*dh .. h*dh+dh-1. Every patch sees every patch of its own image.
// A workgroup of BLOCK_SIZE invocations takes BLOCK_SIZE query rows of one (image, head); each invocation
// holds its row's q (scaled by scale * log2 e) and output in registers. Per chunk of KC keys the workgroup
// stages K and V in shared memory; each invocation takes the chunk's keys one by one, rescaling its sums
// only where a key raises the running max (the loop over keys is not unrolled: small code, which a CPU
// driver compiles in a moment).
// With ``bias`` set, q, k and v are read plus their biases qb, kb, vb (W,) (the GEMMs' biases, added here).
// DH: the head size the registers are sized for (a multiple of 4); with EXACT the push's dh equals it,
// else dh <= DH (a multiple of 4) is read at run time. Dispatch (ceil(P / BLOCK_SIZE), heads, n).
#include "common.glsl"

#ifndef KC
#define KC 16u
#endif
#define D4 (DH / 4u)
#define NEG_INF uintBitsToFloat(0xFF800000u)
#ifdef EXACT
#define ND4 D4
#define DLOOP [[unroll]]
#else
#define ND4 (p.dh / 4u)
#define DLOOP [[dont_unroll]]  // registers indexed at run time: a fallback, small to compile
#endif

layout(binding = 0) readonly buffer Q { vec4 q4[]; };
layout(binding = 1) readonly buffer K { vec4 k4[]; };
layout(binding = 2) readonly buffer V { vec4 v4[]; };
layout(binding = 3) writeonly buffer O { vec4 o4[]; };
layout(binding = 4) readonly buffer QB { vec4 qb4[]; };
layout(binding = 5) readonly buffer KB { vec4 kb4[]; };
layout(binding = 6) readonly buffer VB { vec4 vb4[]; };

layout(push_constant) uniform Push {
    uint P;  // patches per image
    uint W;  // row width: heads * dh (a multiple of 4)
    uint dh;
    float scale;
    uint bias;  // 1: add qb, kb, vb
} p;

shared vec4 ks[KC][D4];
shared vec4 vs[KC][D4];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint row = gl_WorkGroupID.x * BLOCK_SIZE + tid, h = gl_WorkGroupID.y, img = gl_WorkGroupID.z;
    const uint w4 = p.W / 4u, col4 = h * (p.dh / 4u);
    const uint img_row = img * p.P;  // the image's first row
    const bool live = row < p.P;
    const float qs = p.scale * 1.4426950408889634;  // exp2 of scores in log2 units
    vec4 q[D4], o[D4];
    const uint qrow = (img_row + min(row, p.P - 1u)) * w4 + col4;
    DLOOP for (uint d = 0; d < ND4; ++d) {
        q[d] = (q4[qrow + d] + (p.bias != 0u ? qb4[col4 + d] : vec4(0.0))) * qs;
        o[d] = vec4(0.0);
    }
    float m = NEG_INF, l = 0.0;
    for (uint c0 = 0; c0 < p.P; c0 += KC) {
        for (uint e = tid; e < KC * ND4; e += BLOCK_SIZE) {
            const uint j = e / ND4, d = e % ND4;
            const uint key = min(c0 + j, p.P - 1u);
            const uint at = (img_row + key) * w4 + col4 + d;
            const bool b = p.bias != 0u;
            ks[j][d] = k4[at] + (b ? kb4[col4 + d] : vec4(0.0));
            vs[j][d] = v4[at] + (b ? vb4[col4 + d] : vec4(0.0));
        }
        barrier();
        const uint nk = min(KC, p.P - c0);
        for (uint j = 0; j < nk; ++j) {
            float a = 0.0;
            DLOOP for (uint d = 0; d < ND4; ++d) a += dot(q[d], ks[j][d]);
            if (a > m) {  // a new running max: rescale what was summed (rarer as the keys go by)
                const float corr = exp2(m - a);  // m = -inf at the first key: 0
                l *= corr;
                DLOOP for (uint d = 0; d < ND4; ++d) o[d] *= corr;
                m = a;
            }
            const float e = exp2(a - m);
            l += e;
            DLOOP for (uint d = 0; d < ND4; ++d) o[d] += e * vs[j][d];
        }
        barrier();
    }
    if (!live) return;
    const uint orow = (img_row + row) * w4 + col4;
    const float inv = 1.0 / l;
    DLOOP for (uint d = 0; d < ND4; ++d) o4[orow + d] = o[d] * inv;
}
