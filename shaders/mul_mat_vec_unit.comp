#version 450
// y[t, row_offset + n] = sum_k x[t, k] * W[n, k] for t < T <= MAX_T (decode and small batches): float32 x, W
// in its GGUF type read one "unit" at a time by dq_int8.glsl (the int8 mat-vec's decoders: 32 or 64 weights
// as int8 lane words and float factors). Every product and sum is float32 (vulkan.matvec: float; x is never
// quantized): per 32-value block, sum(q * x) in float32 times the block's factors. (The default exact path,
// mul_mat_vec_q8.comp with three planes of x, is as accurate and faster: docs/performance.md.)
// GEGLU: W is the gate and binding 3 the up projection (same type and shape);
// y = gelu_tanh(x . gate) * (x . up), as geglu.comp.
// Work: LANES invocations share NR consecutive rows; each takes units u = lane, lane + LANES, ... of those
// rows, loads each unit once and each 32-value block of x once for all NR rows and T tokens (x, not W, is
// the larger stream through L1: NR rows per x load halve it); the lanes' sums are added in shared memory
// (no assumption on the subgroup size: lavapipe's is 8, RADV's 32 or 64).
// Lane bytes to float without a conversion instruction: byte b in the mantissa of 2^23 is 2^23 + b exactly.
// Bindings: 0 W, 1 X (vec4), 2 Y, [3 W_up]. Push as mul_mat_vec.comp.
// Requires K % UNIT_W == 0, x_stride % 4 == 0, BLOCK_SIZE % LANES == 0.
#include "common.glsl"
#include "dq_int8.glsl"

layout(binding = 0) readonly buffer W { W_ELEM w_gate[]; };
#define WB(i) w_gate[i]
#define LOAD_UNIT load_unit
#include "dq_int8.glsl"
#ifdef GEGLU
layout(binding = 3) readonly buffer WU { W_ELEM w_up[]; };
#undef WB
#undef LOAD_UNIT
#define WB(i) w_up[i]
#define LOAD_UNIT load_unit_up
#include "dq_int8.glsl"
#define NSUM 2u
#else
#define NSUM 1u
#endif

#define LANES 32u
#ifndef MAX_T
#define MAX_T 8u  // the _t1 variants: 1 (batch-1 decode: fewer registers, more rows in flight)
#endif
#ifndef NR
#define NR 2u     // rows per lane group
#endif
#define UW (UNIT_W / 4u)   // lane words per unit
#define UB (UNIT_W / 32u)  // x blocks per unit
#define NACC (NSUM * NR * MAX_T)  // accumulator (s, r, t) at (s * NR + r) * MAX_T + t
#define GROUPS (BLOCK_SIZE / LANES)

layout(binding = 1) readonly buffer X { vec4 x4[]; };
layout(binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint K;
    uint N;
    uint T;
    uint x_stride;
    uint y_stride;
    uint row_bytes;
    uint row_offset;
} p;

shared float red[LANES][GROUPS * NACC + 1u];

#ifdef TYPE_Q4_K
#define LANE_BIAS 0u            // unsigned nibbles 0..15
#define LANE_ZERO 8388608.0     // 2^23
#else
#define LANE_BIAS 0x80808080u   // signed bytes: + 128 (xor of the sign bit) makes them 0..255
#define LANE_ZERO 8388736.0     // 2^23 + 128
#endif

// The 4 int8 lanes of a word as floats, exactly.
vec4 lane_floats(uint w) {
    w ^= LANE_BIAS;
    const uint m = 0x4B000000u;  // 2^23
    return vec4(uintBitsToFloat((w & 0xFFu) | m), uintBitsToFloat(((w >> 8) & 0xFFu) | m),
                uintBitsToFloat(((w >> 16) & 0xFFu) | m), uintBitsToFloat((w >> 24) | m)) - LANE_ZERO;
}

// Block b of a unit (lane words 8b..8b+7) . the 32 x values xv, scaled by the unit's factors f
// (dq_int8.glsl); sx = sum(xv), for Q4_K's minimums.
float block_term(const uint q[UW], vec4 f, uint b, const vec4 xv[8], float sx) {
    float lo = 0.0, hi = 0.0;
    [[unroll]] for (uint i = 0; i < 4u; ++i) {
        lo += dot(lane_floats(q[8u * b + i]), xv[i]);
        hi += dot(lane_floats(q[8u * b + 4u + i]), xv[4u + i]);
    }
#if defined(TYPE_Q6_K)
    return f.x * lo + f.y * hi;
#elif defined(TYPE_Q4_K)
    return f[b] * (lo + hi) + f[2u + b] * sx;
#else
    return f.x * (lo + hi);
#endif
}

void main() {
    const uint tid = gl_LocalInvocationID.x, lane = tid % LANES, grp = tid / LANES;
    const uint row0 = (group_index() * GROUPS + grp) * NR;
    const uint xs4 = p.x_stride / 4u;
    uint rb[NR];
    [[unroll]] for (uint r = 0; r < NR; ++r) rb[r] = min(row0 + r, p.N - 1u) * (p.row_bytes / WSIZE);
    float acc[NACC];
    [[unroll]] for (uint a = 0; a < NACC; ++a) acc[a] = 0.0;

    for (uint u = lane; u < p.K / UNIT_W; u += LANES) {
        uint q[NR][UW];
        vec4 f[NR];
        [[unroll]] for (uint r = 0; r < NR; ++r) load_unit(rb[r], u, q[r], f[r]);
#ifdef GEGLU
        uint qu[NR][UW];
        vec4 fu[NR];
        [[unroll]] for (uint r = 0; r < NR; ++r) load_unit_up(rb[r], u, qu[r], fu[r]);
#endif
        [[unroll]] for (uint t = 0; t < MAX_T; ++t) {
            if (t < p.T) {
                [[unroll]] for (uint b = 0; b < UB; ++b) {
                    const uint xa = t * xs4 + u * (UNIT_W / 4u) + 8u * b;
                    vec4 xv[8];
                    [[unroll]] for (uint i = 0; i < 8u; ++i) xv[i] = x4[xa + i];
                    float sx = 0.0;
#ifdef TYPE_Q4_K
                    const vec4 s4 = ((xv[0] + xv[1]) + (xv[2] + xv[3])) + ((xv[4] + xv[5]) + (xv[6] + xv[7]));
                    sx = (s4.x + s4.y) + (s4.z + s4.w);
#endif
                    [[unroll]] for (uint r = 0; r < NR; ++r) {
                        acc[r * MAX_T + t] += block_term(q[r], f[r], b, xv, sx);
#ifdef GEGLU
                        acc[(NR + r) * MAX_T + t] += block_term(qu[r], fu[r], b, xv, sx);
#endif
                    }
                }
            }
        }
    }

    [[unroll]] for (uint a = 0; a < NACC; ++a) red[lane][grp * NACC + a] = acc[a];
    barrier();
    // invocation i < GROUPS * NR * T sums (lane group, row, token) = (i / (NR T), i / T % NR, i % T)
    if (tid < GROUPS * NR * p.T) {
        const uint g = tid / (NR * p.T), r = (tid / p.T) % NR, t = tid % p.T;
        float s = 0.0;
        for (uint l = 0; l < LANES; ++l) s += red[l][g * NACC + r * MAX_T + t];
#ifdef GEGLU
        float su = 0.0;
        for (uint l = 0; l < LANES; ++l) su += red[l][g * NACC + (NR + r) * MAX_T + t];
        s = gelu_mul(s, su);
#endif
        const uint n = (group_index() * GROUPS + g) * NR + r;
        if (n < p.N) y[t * p.y_stride + p.row_offset + n] = s;
    }
}
