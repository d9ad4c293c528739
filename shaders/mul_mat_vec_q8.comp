#version 450
// y[t, row_offset + n] = sum_k x[t, k] * W[n, k] for t < T <= 8, with x quantized to int8 (q8act.glsl) and W
// read as GGUF blocks decoded to int8 lanes (dq_int8.glsl): the dot products run on packed 4 x int8 (OpSDot),
// the scales in float. GEGLU: W is the gate and binding 4 the up projection (same type and shape);
// y = gelu_tanh(x . gate) * (x . up), as geglu.comp.
// Work: KS lane groups of LANES invocations share NR consecutive rows (BLOCK_SIZE / LANES / KS * NR rows per
// workgroup); lane l of lane group c takes units u = l + LANES c, l + LANES (KS + c), ... of those rows,
// decodes each unit once and uses it for every token, and loads each block of x once for all NR rows (x,
// three planes of it, is the larger stream through L1); the lanes' partial sums are added in shared memory
// (no assumption on the subgroup size: lavapipe's is 8, RADV's 32 or 64). ONE_LANE (LANES 1, the "_l4",
// "_l8" and "_l16" layouts, for CPU implementations): each invocation takes its NR rows' whole K and writes
// them, no shared memory, W and x read as storage texel buffers (imageLoad: a CPU implementation fetches them
// for all its SIMD lanes at once, physical.texel_loads); it runs row by row, so that the unrolled body holds
// one row's unit for every token, not NR rows' (llvmpipe compiles it many times faster and runs it as fast:
// docs/tuning.md); a row's sum runs over its units in order whatever NR. The layouts (NR, KS, LANES) are
// variants (variants.Q8_LAYOUTS), picked per weight shape (kernels_q8.q8_matvec_layout).
// PLANES 3 (the exact decode path): x comes as three int8 planes (q8act.glsl), each block's three integer dots
// combined with their power-of-two plane scales before the float factors.
// Bindings: 0 W, 1 XQ (uvec4: 4 words), 2 XD (vec2), 3 Y, [4 W_up]. Push as mul_mat_vec.comp.
// Requires K % 64 == 0 (XQ's order), BLOCK_SIZE % LANES == 0.
// QOUT (GEGLU, the T = 1 variants): a fused tail (arrive.glsl): the last of the workgroups writing a q8 block
// of y (32 rows) quantizes that block for the down projection (matvec_qout.glsl: quantize_q8.comp's
// arithmetic), one dispatch and one barrier fewer. Bindings 5 y's XQ, 6 y's XD, 7 counters (N / 32, zero),
// 8 y's range again (read as vec4). Requires row_offset 0, N % 64 == 0, a workgroup's rows dividing 32.
#include "common.glsl"
#include "q8act.glsl"
#include "dq_int8.glsl"

#ifdef ONE_LANE  // W and x as storage texel buffers (the one-lane layouts are for CPU implementations)
layout(binding = 0, W_TEXEL) uniform readonly uimageBuffer w_gate;
#define WB(i) (imageLoad(w_gate, int(i)) W_PICK)
#else
layout(binding = 0) readonly buffer W { W_ELEM w_gate[]; };
#define WB(i) w_gate[i]
#endif
#define LOAD_UNIT load_unit
#include "dq_int8.glsl"
#ifdef GEGLU
#undef WB
#undef LOAD_UNIT
#ifdef ONE_LANE
layout(binding = 4, W_TEXEL) uniform readonly uimageBuffer w_up;
#define WB(i) (imageLoad(w_up, int(i)) W_PICK)
#else
layout(binding = 4) readonly buffer WU { W_ELEM w_up[]; };
#define WB(i) w_up[i]
#endif
#define LOAD_UNIT load_unit_up
#include "dq_int8.glsl"
#endif

#ifdef ONE_LANE
#define LANES 1u  // the one-lane layouts: each invocation its rows' whole K (CPU implementations)
#else
#define LANES 32u
#endif
#ifndef MAX_T
#define MAX_T 8u  // the _t1 variants: 1 (decode at batch 1: fewer registers, more rows in flight)
#endif
#ifndef NR
#define NR 2u  // rows per lane group (the faster default at the 27B Q4_K shape: docs/tuning.md)
#endif
#define UW (UNIT_W / 4u)      // lane words per unit
#define UB (UNIT_W / 32u)     // x blocks per unit
#define GROUPS (BLOCK_SIZE / LANES)
#ifndef KS
#define KS 1u  // lane groups per row group, splitting the rows' units between them (more lanes on a long K)
#endif
#define RGROUPS (GROUPS / KS)  // row groups per workgroup: RGROUPS * NR rows

#ifdef ONE_LANE
layout(binding = 1, rgba32ui) uniform readonly uimageBuffer xq_img;
layout(binding = 2, rg32f) uniform readonly imageBuffer xd_img;
#define XQ4(i) imageLoad(xq_img, int(i))
#define XD2(i) imageLoad(xd_img, int(i)).xy
#else
layout(binding = 1) readonly buffer XQ { uvec4 xq4[]; };
layout(binding = 2) readonly buffer XD { vec2 xd[]; };
#define XQ4(i) xq4[i]
#define XD2(i) xd[i]
#endif
#ifdef QOUT
layout(binding = 3) coherent writeonly buffer Y { float y[]; };  // read back by the tail (binding 8)
#else
layout(binding = 3) writeonly buffer Y { float y[]; };
#endif

layout(push_constant) uniform Push {
    uint K;
    uint N;
    uint T;
    uint x_stride;    // unused: x rows are K values apart (XQ PLANES * K/4 words, XD K/32 pairs)
    uint y_stride;
    uint row_bytes;
    uint row_offset;
} p;

#ifdef QOUT
#include "matvec_qout.glsl"
#endif

#ifdef GEGLU
#define NSUM 2u
#else
#define NSUM 1u
#endif
#define NACC (NSUM * NR * MAX_T)  // accumulator (s, r, t) at (s * NR + r) * MAX_T + t
#ifndef ONE_LANE
shared float red[LANES][GROUPS * NACC + 1u];
#endif

// The integer dots of block b's lane words (q[8b..8b+7]) with one plane's 32 x values (x0, x1): (first 16
// values, last 16)
ivec2 block_dots(const uint q[UW], uint b, uvec4 x0, uvec4 x1) {
    const int lo = sdot4(q[8u * b], x0.x) + sdot4(q[8u * b + 1u], x0.y) + sdot4(q[8u * b + 2u], x0.z)
                 + sdot4(q[8u * b + 3u], x0.w);
    const int hi = sdot4(q[8u * b + 4u], x1.x) + sdot4(q[8u * b + 5u], x1.y) + sdot4(q[8u * b + 6u], x1.z)
                 + sdot4(q[8u * b + 7u], x1.w);
    return ivec2(lo, hi);
}

// x block xb (of token t) as PLANES pairs of uvec4
struct XBlock {
    uvec4 w[2u * PLANES];
    vec2 ds;  // (d, s): XD
};

// (block xb is quarters 2 (xb % 2) and 2 (xb % 2) + 1 of 64-value group xb / 2: q8act.glsl's XQ order, in
// which lanes on consecutive units read consecutive uvec4s)
XBlock x_block(uint t, uint xb) {
    XBlock x;
    const uint groups = p.K / 64u, j = 2u * (xb & 1u);
    [[unroll]] for (uint pl = 0; pl < PLANES; ++pl) {
        const uint g = (t * PLANES + pl) * (p.K / 16u) + xb / 2u;  // plane pl of token t, xb's group
        x.w[2u * pl] = XQ4(g + j * groups);
        x.w[2u * pl + 1u] = XQ4(g + (j + 1u) * groups);
    }
    x.ds = XD2(t * (p.K / 32u) + xb);
    return x;
}

// Block b of a unit (words q, factors f: dq_int8.glsl) . x block x, in float
float block_term(const uint q[UW], vec4 f, uint b, XBlock x) {
#if PLANES == 3
    const vec2 d3 = vec2(block_dots(q, b, x.w[4], x.w[5])) * (1.0 / 128.0);
    const vec2 d2 = (vec2(block_dots(q, b, x.w[2], x.w[3])) + d3) * (1.0 / 128.0);
    const vec2 dd = vec2(block_dots(q, b, x.w[0], x.w[1])) + d2;
#else
    const vec2 dd = vec2(block_dots(q, b, x.w[0], x.w[1]));
#endif
#if defined(TYPE_Q6_K)
    return x.ds.x * (f.x * dd.x + f.y * dd.y);
#elif defined(TYPE_Q4_K)
    return f[b] * x.ds.x * (dd.x + dd.y) + f[2u + b] * x.ds.y;
#else
    return f.x * x.ds.x * (dd.x + dd.y);
#endif
}

#ifdef ONE_LANE
// (KS 1) row n's sums (n < N) for every token: whole (no lanes to add), written as they are
void one_row(const uint n) {
    const uint rb = n * (p.row_bytes / WSIZE);
    float acc[NSUM * MAX_T];  // (s, t) at s * MAX_T + t
    [[unroll]] for (uint a = 0; a < NSUM * MAX_T; ++a) acc[a] = 0.0;
    for (uint u = 0; u < p.K / UNIT_W; ++u) {
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
                [[unroll]] for (uint b = 0; b < UB; ++b) {
                    const XBlock x = x_block(t, u * UB + b);
                    acc[t] += block_term(q, f, b, x);
#ifdef GEGLU
                    acc[MAX_T + t] += block_term(qu, fu, b, x);
#endif
                }
            }
        }
    }
    [[unroll]] for (uint t = 0; t < MAX_T; ++t) {
#ifdef GEGLU
        const float s = gelu_mul(acc[t], acc[MAX_T + t]);
#else
        const float s = acc[t];
#endif
        if (t < p.T) y[t * p.y_stride + p.row_offset + n] = s;
    }
}

void main() {
    const uint row0 = (group_index() * RGROUPS + gl_LocalInvocationID.x) * NR;
    for (uint r = 0; r < NR && row0 + r < p.N; ++r) one_row(row0 + r);
}
#else
void main() {
    const uint tid = gl_LocalInvocationID.x, lane = tid % LANES, grp = tid / LANES;
    const uint row0 = (group_index() * RGROUPS + grp / KS) * NR;
    uint rb[NR];
    [[unroll]] for (uint r = 0; r < NR; ++r) rb[r] = min(row0 + r, p.N - 1u) * (p.row_bytes / WSIZE);
    float acc[NACC];
    [[unroll]] for (uint a = 0; a < NACC; ++a) acc[a] = 0.0;
    for (uint u = lane + LANES * (grp % KS); u < p.K / UNIT_W; u += LANES * KS) {
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
                    const XBlock x = x_block(t, u * UB + b);
                    [[unroll]] for (uint r = 0; r < NR; ++r) {
                        acc[r * MAX_T + t] += block_term(q[r], f[r], b, x);
#ifdef GEGLU
                        acc[(NR + r) * MAX_T + t] += block_term(qu[r], fu[r], b, x);
#endif
                    }
                }
            }
        }
    }

    [[unroll]] for (uint a = 0; a < NACC; ++a) red[lane][grp * NACC + a] = acc[a];
    barrier();
    // invocation i < RGROUPS * NR * T sums (row group, row, token) = (i / (NR T), i / T % NR, i % T) over
    // the row group's KS lane groups
    if (tid < RGROUPS * NR * p.T) {
        const uint g = tid / (NR * p.T), r = (tid / p.T) % NR, t = tid % p.T;
        float s = 0.0;
        for (uint c = g * KS; c < (g + 1u) * KS; ++c)
            for (uint l = 0; l < LANES; ++l) s += red[l][c * NACC + r * MAX_T + t];
#ifdef GEGLU
        float su = 0.0;
        for (uint c = g * KS; c < (g + 1u) * KS; ++c)
            for (uint l = 0; l < LANES; ++l) su += red[l][c * NACC + (NR + r) * MAX_T + t];
        s = gelu_mul(s, su);
#endif
        const uint n = (group_index() * RGROUPS + g) * NR + r;
        if (n < p.N) y[t * p.y_stride + p.row_offset + n] = s;
    }
#ifdef QOUT
    const uint rows = RGROUPS * NR, n0 = group_index() * rows;  // this workgroup's rows, inside one block
    if (n0 < p.N && last_to_arrive(n0 / 32u, 32u / rows)) quantize_block(n0 / 32u);
#endif
}
#endif  // ONE_LANE
