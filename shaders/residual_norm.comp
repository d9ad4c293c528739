#version 450
// The residual step between two sub-layers, one workgroup per token row (fused: three dispatches -> one):
//   x' = x + rms(a) * wa          (the sub-layer output, post-normed, added to the residual stream)
//   h  = rms(x') * wh             (the next sub-layer's pre-norm; with NEXT defined)
// rms(v) = v / sqrt(mean(v^2) + eps), float32 sums. Q8OUT: h is also written quantized for the int8 mat-vec
// (q8act.glsl). Decode runs this on one row at a time, so it is written for latency: each invocation loads
// its (at most WORDS) groups of 4 values once, up front, and keeps them in registers; sums go through
// subgroupAdd and one shared slot per subgroup; a q8 block (8 words) is 8 neighbouring invocations, which
// exchange their maxima and sums through shared memory. XHOUT: h is also written as row_scale.comp writes
// it for the cooperative-matrix GEMM (its row scale s, a power of two, and xh = float16(h / s) in the GEMM
// tiles' order), bit for bit: one row_scale dispatch less for each GEMM reading h.
// a may come as the K-split partial sums of the GEMM that made it (push splits > 1: split s of (T, D) at
// s T D, mul_mm_coopmat.comp's scratch), added here in split order as split_reduce.comp adds them, bit for
// bit: one split_reduce dispatch less, and a's (T, D) floats neither written nor read back.
// Bindings: 0 x, 1 a, 2 wa, 3 x' [, 4 wh, 5 h [, 6 hq, 7 hd] [, s, xh: 6, 7 or after hq, hd]]. Requires
// D % 4 == 0 (Q8OUT: D % 64 == 0), D <= 4 * WORDS * BLOCK_SIZE, BLOCK_SIZE % 8 == 0.
#include "common.glsl"
#extension GL_KHR_shader_subgroup_arithmetic : require
#ifdef Q8OUT
#include "q8act.glsl"
#endif
#ifdef XHOUT
#define ROW_SCALE_PARTS
#include "row_scale.glsl"
#endif
#define WORDS 2u
#if defined(NEXT) && defined(Q8OUT)
// decode-sized steps (int8 mat-vecs follow): wh is loaded with the other inputs, its latency hidden behind
// theirs; elsewhere (prefill rows, many workgroups) after the sums, as its registers would cost occupancy
#define WH_EARLY
#endif

layout(binding = 0) readonly buffer X { vec4 x[]; };
layout(binding = 1) readonly buffer A { vec4 a[]; };
layout(binding = 2) readonly buffer WA { vec4 wa[]; };
layout(binding = 3) writeonly buffer XO { vec4 xo[]; };
#ifdef NEXT
layout(binding = 4) readonly buffer WH { vec4 wh[]; };
layout(binding = 5) writeonly buffer H { vec4 h[]; };
#endif
#ifdef Q8OUT
layout(binding = 6) writeonly buffer HQ { uint hq[]; };
layout(binding = 7) writeonly buffer HD { vec2 hd[]; };
#endif
#if defined(XHOUT) && defined(Q8OUT)
layout(binding = 8) writeonly buffer S { float s[]; };
layout(binding = 9) writeonly buffer XH { uint xh2[]; };  // two float16 per word
#elif defined(XHOUT)
layout(binding = 6) writeonly buffer S { float s[]; };
layout(binding = 7) writeonly buffer XH { uint xh2[]; };
#endif

layout(push_constant) uniform Push {
    uint ncols;  // D
    uint nrows;  // T
    float eps;
    uint splits;  // a's partial sums (1: a is the sum)
} p;

// word i of a: its splits' partial sums added (common.glsl)
SPLIT_SUM_READER(vec4, a_at, a, p.splits, p.nrows * (p.ncols / 4u))

shared float partial[BLOCK_SIZE];
#ifdef Q8OUT
shared float s_max[WORDS * BLOCK_SIZE];  // word tid + i BLOCK_SIZE at i BLOCK_SIZE + tid: its max |h|
shared float s_sum[WORDS * BLOCK_SIZE];  // ... its share of the block's XD s (q8_words)
#endif

#ifdef XHOUT
// the largest of every invocation's m over the workgroup, NaN if any m is NaN (row_scale.glsl's sticky max;
// a max is exact in any order)
float workgroup_absmax(float m) {
    barrier();  // partial may still be read from workgroup_sum
    const float nan = subgroupMax(isnan(m) ? 1.0 : 0.0), mx = subgroupMax(isnan(m) ? 0.0 : m);
    if (subgroupElect()) partial[gl_SubgroupID] = nan > 0.0 ? uintBitsToFloat(0x7FC00000u) : mx;
    barrier();
    float r = 0.0;
    for (uint i = 0; i < gl_NumSubgroups; ++i) r = sticky_max(r, partial[i]);
    return r;
}
#endif

// the sum over the workgroup of every invocation's v
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
    const uint tid = gl_LocalInvocationID.x, nw = p.ncols / 4u, o = row * nw;
    vec4 xv[WORDS], av[WORDS], wv[WORDS];
#ifdef WH_EARLY
    vec4 whv[WORDS];  // the next norm's weights, loaded with the rest
#endif
    float ss = 0.0;
    [[unroll]] for (uint i = 0; i < WORDS; ++i) {
        const uint w = tid + i * BLOCK_SIZE;
        const bool live = w < nw;
        xv[i] = live ? x[o + w] : vec4(0.0);
        av[i] = live ? a_at(o + w) : vec4(0.0);
        wv[i] = live ? wa[w] : vec4(0.0);
#ifdef WH_EARLY
        whv[i] = live ? wh[w] : vec4(0.0);
#endif
        ss += dot(av[i], av[i]);
    }
    const float sa = inversesqrt(workgroup_sum(ss) / float(p.ncols) + p.eps);
    ss = 0.0;
    [[unroll]] for (uint i = 0; i < WORDS; ++i) {
        const uint w = tid + i * BLOCK_SIZE;
        xv[i] = xv[i] + av[i] * sa * wv[i];
        if (w < nw) xo[o + w] = xv[i];
        ss += dot(xv[i], xv[i]);
    }
#ifdef NEXT
    const float sh = inversesqrt(workgroup_sum(ss) / float(p.ncols) + p.eps);
    vec4 hv[WORDS];
#ifdef XHOUT
    float m = 0.0;  // max |h| of this invocation's values, NaN sticking (row_scale.comp)
#endif
    [[unroll]] for (uint i = 0; i < WORDS; ++i) {
        const uint w = tid + i * BLOCK_SIZE;
#ifdef WH_EARLY
        hv[i] = xv[i] * sh * whv[i];
#else
        hv[i] = xv[i] * sh * (w < nw ? wh[w] : vec4(0.0));
#endif
        if (w < nw) h[o + w] = hv[i];
#ifdef XHOUT
        [[unroll]] for (uint c = 0; c < 4u; ++c) m = w < nw ? sticky_max(m, abs(hv[i][c])) : m;
#endif
    }
#ifdef Q8OUT
    // word w is 4 values of q8 block w / 8, whose 8 words are invocations tid & ~7 .. (tid & ~7) + 7 of the
    // same i: every word's max, then its quants and sum share, then each block's first word its XD, two
    // barriers for all WORDS
    [[unroll]] for (uint i = 0; i < WORDS; ++i) {
        const vec4 v = abs(hv[i]);
        s_max[i * BLOCK_SIZE + tid] = max(max(v.x, v.y), max(v.z, v.w));
    }
    barrier();
    float dq[WORDS];
    [[unroll]] for (uint i = 0; i < WORDS; ++i) {
        const uint w = tid + i * BLOCK_SIZE, first = i * BLOCK_SIZE + (tid & ~7u);
        float amax = 0.0;
        [[unroll]] for (uint j = 0; j < 8u; ++j) amax = max(amax, s_max[first + j]);
        dq[i] = amax / 127.0;
        const float id = dq[i] != 0.0 ? 1.0 / dq[i] : 0.0;
        uint qw[PLANES];
        s_sum[i * BLOCK_SIZE + tid] = q8_words(hv[i], dq[i], id, qw);
        if (w < nw) {  // plane pl of row r is XQ row PLANES * r + pl
            [[unroll]] for (uint pl = 0; pl < PLANES; ++pl) hq[(PLANES * row + pl) * nw + xq_word(w, p.ncols / 64u)] = qw[pl];
        }
    }
    barrier();
    [[unroll]] for (uint i = 0; i < WORDS; ++i) {
        const uint w = tid + i * BLOCK_SIZE, first = i * BLOCK_SIZE + tid;
        if (w < nw && (tid & 7u) == 0u) {
            float sum = 0.0;
            [[unroll]] for (uint j = 0; j < 8u; ++j) sum += s_sum[first + j];
            hd[row * (p.ncols / 32u) + w / 8u] = q8_block_ds(dq[i], sum);
        }
    }
#endif
#ifdef XHOUT
    // row_scale.comp's s and xh of h: word w (h's values 4w..4w+3) is xh words 2w (4w, 4w + 2) and 2w + 1
    // (4w + 1, 4w + 3), the pairs of the GEMM tiles' order 0,2,1,3 within each 4
    const float mx = workgroup_absmax(m);
    const float sc = scale_of_max(mx);
    if (tid == 0) s[row] = sc;
    const float inv = 1.0 / sc;  // exact: a power of two
    [[unroll]] for (uint i = 0; i < WORDS; ++i) {
        const uint w = tid + i * BLOCK_SIZE;
        if (w < nw) {
            xh2[row * (p.ncols / 2u) + 2u * w] = packHalf2x16(hv[i].xz * inv);
            xh2[row * (p.ncols / 2u) + 2u * w + 1u] = packHalf2x16(hv[i].yw * inv);
        }
    }
#endif
#endif
}
