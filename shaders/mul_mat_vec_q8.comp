#version 450
// y[t, row_offset + n] = sum_k x[t, k] * W[n, k] for t < T <= 8, with x quantized to int8 (q8act.glsl) and W
// read as GGUF blocks decoded to int8 lanes (dq_int8.glsl): the dot products run on packed 4 x int8 (OpSDot),
// the scales in float. GEGLU: W is the gate and binding 4 the up projection (same type and shape);
// y = gelu_tanh(x . gate) * (x . up), as geglu.comp.
// Work: LANES invocations per row (BLOCK_SIZE / LANES rows per workgroup); each lane takes units u = lane,
// lane + LANES, ... of its row, decodes the unit once and uses it for every token; the lanes' partial sums
// are added in shared memory (no assumption on the subgroup size: lavapipe's is 8, RADV's 32 or 64).
// Bindings: 0 W, 1 XQ (uvec4: 4 words), 2 XD (vec2), 3 Y, [4 W_up]. Push as mul_mat_vec.comp.
// Requires K % UNIT_W == 0, BLOCK_SIZE % LANES == 0.
#include "common.glsl"
#include "q8act.glsl"
#include "dq_int8.glsl"

layout(binding = 0) readonly buffer W { W_ELEM w_gate[]; };
#define WB w_gate
#define LOAD_UNIT load_unit
#include "dq_int8.glsl"
#ifdef GEGLU
layout(binding = 4) readonly buffer WU { W_ELEM w_up[]; };
#undef WB
#undef LOAD_UNIT
#define WB w_up
#define LOAD_UNIT load_unit_up
#include "dq_int8.glsl"
#endif

#define LANES 32u
#ifndef MAX_T
#define MAX_T 8u  // the _t1 variants: 1 (decode at batch 1: fewer registers, more rows in flight)
#endif
#define UW (UNIT_W / 4u)      // lane words per unit
#define UB (UNIT_W / 32u)     // x blocks per unit

layout(binding = 1) readonly buffer XQ { uvec4 xq4[]; };
layout(binding = 2) readonly buffer XD { vec2 xd[]; };
layout(binding = 3) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint K;
    uint N;
    uint T;
    uint x_stride;    // unused: x rows are K values apart (XQ K/4 words, XD K/32 pairs)
    uint y_stride;
    uint row_bytes;
    uint row_offset;
} p;

#ifdef GEGLU
#define NSUM 2u
#else
#define NSUM 1u
#endif
shared float red[LANES][(BLOCK_SIZE / LANES) * MAX_T * NSUM + 1u];

// unit . x for token t: the int8 dots per 32-block, scaled (see dq_int8.glsl for f)
float unit_dot(const uint q[UW], vec4 f, uint t, uint u) {
    const uint xb = t * (p.K / 32u) + u * UB;  // first x block of the unit
    float s = 0.0;
    [[unroll]] for (uint b = 0; b < UB; ++b) {
        const uvec4 x0 = xq4[2u * (xb + b)], x1 = xq4[2u * (xb + b) + 1u];
        const int lo = sdot4(q[8u * b], x0.x) + sdot4(q[8u * b + 1u], x0.y) + sdot4(q[8u * b + 2u], x0.z)
                     + sdot4(q[8u * b + 3u], x0.w);
        const int hi = sdot4(q[8u * b + 4u], x1.x) + sdot4(q[8u * b + 5u], x1.y) + sdot4(q[8u * b + 6u], x1.z)
                     + sdot4(q[8u * b + 7u], x1.w);
        const vec2 ds = xd[xb + b];
#if defined(TYPE_Q6_K)
        s += ds.x * (f.x * float(lo) + f.y * float(hi));
#elif defined(TYPE_Q4_K)
        s += f[b] * ds.x * float(lo + hi) + f[2u + b] * ds.y;
#else
        s += f.x * ds.x * float(lo + hi);
#endif
    }
    return s;
}

float gelu_mul(float g, float u) {
    const float a = 0.7978845608028654 * (g + 0.044715 * g * g * g);
    return g / (1.0 + exp(-2.0 * a)) * u;
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint lane = tid % LANES, r = tid / LANES;
    const uint row = group_index() * (BLOCK_SIZE / LANES) + r;
    const uint rb = min(row, p.N - 1u) * (p.row_bytes / WSIZE);
    const uint units = p.K / UNIT_W;
    float acc[MAX_T * NSUM];
    [[unroll]] for (uint a = 0; a < MAX_T * NSUM; ++a) acc[a] = 0.0;
    for (uint u = lane; u < units; u += LANES) {
        uint q[UW];
        vec4 f;
        load_unit(rb, u, q, f);
#ifdef GEGLU
        uint qu[UW];
        vec4 fu;
        load_unit_up(rb, u, qu, fu);
#endif
        [[unroll]] for (uint t = 0; t < MAX_T; ++t) {
            if (t < p.T) {
                acc[t] += unit_dot(q, f, t, u);
#ifdef GEGLU
                acc[MAX_T + t] += unit_dot(qu, fu, t, u);
#endif
            }
        }
    }
    const uint base = r * MAX_T * NSUM;
    [[unroll]] for (uint a = 0; a < MAX_T * NSUM; ++a) red[lane][base + a] = acc[a];
    barrier();
    // invocation i < rows * T sums row i / T, token i % T over the lanes
    const uint rows = BLOCK_SIZE / LANES;
    if (tid < rows * p.T) {
        const uint rr = tid / p.T, t = tid % p.T, n = group_index() * rows + rr;
        float s = 0.0;
        for (uint l = 0; l < LANES; ++l) s += red[l][rr * MAX_T * NSUM + t];
#ifdef GEGLU
        float su = 0.0;
        for (uint l = 0; l < LANES; ++l) su += red[l][rr * MAX_T * NSUM + MAX_T + t];
        s = gelu_mul(s, su);
#endif
        if (n < p.N) y[t * p.y_stride + p.row_offset + n] = s;
    }
}
