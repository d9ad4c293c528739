#version 450
// y[t, row_offset + n] = sum_k x[t, k] * W[n, k] on cooperative matrices (VK_KHR_cooperative_matrix):
// float16 A (x) and B (W) tiles, float32 accumulators.
//
// A workgroup owns a BT x BN tile of y (tokens t0.., rows n0..) over one split of K (workgroup z covers
// weights [z * k_split, (z + 1) * k_split)). Per step of BK along K the BN x BK tile of W is decoded and the
// BT x BK tile of x copied into shared memory; each of the NSG = SG_T x SG_N subgroups then multiplies its
// (BT / SG_T) x (BN / SG_N) part as TF x NF 16 x 16 x 16 products (A = x rows, row-major; B = Wᵀ, i.e. W
// rows read column-major). With several splits (gl_NumWorkGroups.z > 1) y is a scratch of partial sums,
// split z at element z * T * y_stride, summed by split_reduce.comp: splitting K keeps enough workgroups in
// flight when few tokens leave few output tiles (decode batches). The result goes through a per-subgroup
// 16 x 16 float32 staging tile so partial tiles, row_offset and any y_stride need no alignment.
// Loads are pipelined (2x the first version of this kernel at the 27B prefill shape; docs/tuning.md):
// - x comes in as float16 already divided by its row scale (row_scale.comp: a power of two that keeps
//   Gemma's large activations within float16; the sums are multiplied back): a tile is a plain copy;
// - the global loads of step s + 1 (x, and W raw: Q4_K as its 16-byte header + 8 bytes of quants per 16
//   weights; other types decoded by dequant.glsl's dq8) are issued before the products of step s, so they
//   are in flight while the tensor cores work; after the step's second barrier they go into the tiles;
// - Q4_K weights decoded 16 at a time with one scale decode (the types of 27B models), others 8 at a time;
//   Q4_K without integer-to-float conversions (a quarter-rate instruction on NVIDIA, four per 4 weights in
//   the first decoder): a nibble placed in the low mantissa bits of float16 1024.0 (0x6400) reads as
//   1024 + q, so (h - 1024) is q exactly, and w = fma(q, d*sc, -dmin*m) in float16 (d*sc and dmin*m
//   rounded to float16 first), two weights per instruction.
// Tiles hold k in the order of float16 pairs that decode gives: within every 8, positions 0..7 hold k
// 0,2,1,3,4,6,5,7 (row_scale.comp writes xh so); the products sum over k, so the order is free.
// Layouts (defines; the defaults are the first version's, kernels_matmul.CoopmatLayout):
// - SG_T x SG_N, the grid of subgroups over the tile (default 2 x 4: 8 subgroups of (BT / 2) x (BN / 4));
// - BK32: steps of 32 along K, not 64. Q4_K: the step at k0 takes half e = (k0 / 32) % 2 of the bytes of
//   the 64-weight chunk's 32 quant bytes (bytes 16e..16e+15) with both their nibbles, so its tiles hold k
//   16e..16e+15 and 32+16e..32+16e+15 of the chunk, and x is loaded in that order: each k is in exactly one
//   step, wherever the splits begin;
// - DBUF: two tile sets in shared memory; the next step's tiles are stored while this step's products run,
//   one barrier a step instead of two.
// - WIDE (Q4_K): a W piece is 16 quant bytes (WIDE 1: 32 weights, the chunk's bytes 16g..16g+15) or 32
//   (WIDE 2: the whole 64-weight chunk), loaded as uvec4s with its block's header, not 8 bytes (16
//   weights): fewer loads, and fewer header reloads, per weight (docs/tuning.md).
// Shared memory: NBUF (BN + BT) (BK + 8) 2 bytes of tiles (CoopmatLayout.shared_bytes); the write-out stages
// each subgroup's 16 x 16 float32 results in the W tile, free after the last step: no shared memory of its own,
// so more workgroups fit an SM (docs/tuning.md, residency).
// Bindings: 0 W, 1 xh (float16, rows x_stride halves apart, x_stride % 8 == 0), 2 y, 3 row scales.
// Requires BLOCK_SIZE == NINV = 32 NSG with 32-wide subgroups, K % 32 == 0 (Q4_K: whole superblocks),
// k_split % BK == 0, whole per-invocation counts (TF, NF, XPT, WPT: CoopmatLayout.problems).
// Dispatch (ceil(T / BT), ceil(N / BN), splits): token tiles vary fastest, so the workgroups of all token
// tiles of one W tile run together and W streams from memory once (a 27B matrix, 65 MB, outgrows a large
// GPU's L2 across token tiles); x stays in L2.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#ifdef TYPE_Q4_K
#include "q4k.glsl"
layout(binding = 0) readonly buffer W { uvec4 w4[]; };  // Q4_K: 144-byte blocks = 9 uvec4
#define WSIZE 16u
#else
#include "dequant.glsl"
#endif

#ifndef BT
#define BT 64u
#endif
#ifndef BN
#define BN 64u
#endif
#ifndef SG_T
#define SG_T 2u  // subgroups along the tokens of the tile
#endif
#ifndef SG_N
#define SG_N 4u  // ... and along its rows
#endif
#ifdef BK32
#define BK 32u
#else
#define BK 64u
#endif
#ifdef DBUF
#define NBUF 2u  // tile sets in shared memory
#else
#define NBUF 1u
#endif
#define SK8 ((BK + 8u) / 8u)  // shared row stride in uvec4 (8 float16; 16 bytes of pad)
#define NSG (SG_T * SG_N)
#define NINV (NSG * 32u)  // invocations (BLOCK_SIZE)
#define WT (BT / SG_T)
#define WN (BN / SG_N)
#define TF (WT / 16u)
#define NF (WN / 16u)
#define XPT (BT * BK / 8u / NINV)  // x: uvec4 (8 halves) per invocation per step
#ifdef TYPE_Q4_K
#if !defined(WIDE)
#define QB 8u   // quant bytes a W piece: 16 weights (8 low nibbles, 8 high)
#elif WIDE == 1
#define QB 16u  // ... 32 weights
#else
#define QB 32u  // ... 64 weights (WIDE 2: a whole chunk)
#endif
#define QV (QB / 16u)              // uvec4 of quants a piece (WIDE)
#define PPR (BK / (2u * QB))       // W pieces per row and step
#define PPC (32u / QB)             // ... per 64-weight chunk (BK 64)
#define WPT (BN * PPR / NINV)      // W: (row, piece) per invocation
#else
#define WPT (BN * BK / 8u / NINV)  // W: 8-weight groups per invocation
#endif

layout(binding = 1) readonly buffer X { uvec4 xh[]; };
layout(binding = 2) writeonly buffer Y { float y[]; };
// The residency probe's counters (push K == 0), in y's buffer: [0] workgroups entered, [1] left, [2] the most
// resident at once, [3] read while staying resident (backends/vulkan/residency.py)
layout(binding = 2) volatile coherent buffer Probe { uint probe[]; };
layout(binding = 3) readonly buffer S { float xscale[]; };

layout(push_constant) uniform Push {
    uint K;
    uint N;
    uint T;
    uint x_stride;  // halves between rows of xh
    uint y_stride;
    uint row_bytes;
    uint row_offset;
    uint k_split;
} p;

shared uvec4 ws[NBUF * BN * SK8];  // W tile: float16 (n, k) at ws[n * SK8 + k / 8] lane k % 8 (+ BN SK8: set 1)
shared uvec4 xs[NBUF * BT * SK8];  // x tile likewise

// Index into tile set sb (a variable of that name where they are used) of xs / ws.
#ifdef DBUF
#define XSI(i) (sb * (BT * SK8) + (i))
#define WSI(i) (sb * (BN * SK8) + (i))
#else
#define XSI(i) (i)
#define WSI(i) (i)
#endif

#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

// The registers between a step's loads and its stores into shared memory.
uvec4 rx[XPT];
#ifdef TYPE_Q4_K
uvec4 rh[WPT];  // block header
#ifdef WIDE
uvec4 rq[WPT * QV];  // QB bytes of the chunk's quants a piece
#else
uvec2 rq[WPT];  // 8 bytes of the chunk's quants
#endif
#else
uvec4 rw[WPT];  // 8 decoded weights as float16
#endif

void fetch(uint n0, uint t0, uint k0, uint k_end, uint tid) {
    [[unroll]] for (uint h = 0; h < XPT; ++h) {
        const uint idx = tid + NINV * h, t = idx / (BK / 8u), q = idx % (BK / 8u);
#if defined(TYPE_Q4_K) && defined(BK32)
        // the k that position q's W decodes (see store): k 16e + 8q of the chunk (q < 2), 32 + 16e + 8 (q - 2)
        // (q >= 2), e = (k0 / 32) % 2; K % 256 == 0, so only the token is checked
        const uint xk = k0 - 16u * ((k0 / 32u) % 2u) + (q / 2u) * 32u + 8u * (q % 2u);
        rx[h] = t0 + t < p.T ? xh[((t0 + t) * p.x_stride + xk) / 8u] : uvec4(0u);
#else
        const bool live = t0 + t < p.T && k0 + 8u * q < k_end;
        rx[h] = live ? xh[((t0 + t) * p.x_stride + k0) / 8u + q] : uvec4(0u);
#endif
    }
    const uint rstride = p.row_bytes / WSIZE;
#ifdef TYPE_Q4_K
    // piece (r, j): row n0 + r, bytes QB g..QB g + QB - 1 of the 32-byte quants of chunk c + j / PPC (the
    // step's first chunk c covers k0 - k0 % 64 .. + 63), g = j % PPC; BK32: bytes 8g.., g = 2e + j, half
    // e = (k0 / 32) % 2 of chunk c.
    const uint c = (k0 % 256u) / 64u;
    [[unroll]] for (uint h = 0; h < WPT; ++h) {
        const uint idx = tid + NINV * h, r = idx / PPR, j = idx % PPR;
        const uint b = min(n0 + r, p.N - 1u) * rstride + (k0 / 256u) * 9u;
        rh[h] = w4[b];
#if defined(BK32)
        const uvec4 q = w4[b + 1u + 2u * c + (k0 / 32u) % 2u];
        rq[h] = (j % 2u) == 0u ? q.xy : q.zw;
#elif defined(WIDE)
        [[unroll]] for (uint v = 0; v < QV; ++v) rq[h * QV + v] = w4[b + 1u + 2u * (c + j / PPC) + (j % PPC) * QV + v];
#else
        const uvec4 q = w4[b + 1u + 2u * (c + j / PPC) + (j % PPC) / 2u];
        rq[h] = (j % 2u) == 0u ? q.xy : q.zw;
#endif
    }
#else
    [[unroll]] for (uint h = 0; h < WPT; ++h) {
        const uint idx = tid + NINV * h, r = idx / (BK / 8u), q = idx % (BK / 8u);
        vec4 lo = vec4(0.0), hi = vec4(0.0);
        if (k0 + 8u * q < k_end) dq8(min(n0 + r, p.N - 1u) * rstride, k0 + 8u * q, lo, hi);
        rw[h] = pack8_tiles(lo, hi);
    }
#endif
}

#ifdef TYPE_Q4_K
// The nibbles at bits s..s+3 and s+16..s+19 of w (bytes 0 and 2 at s = 0 or 4, 1 and 3 at s = 8 or 12)
// scaled, as a float16 pair: w = d sc q - dmin m with dl = d sc, ml = dmin m
uint nib2(uint w, uint s, f16vec2 dl, f16vec2 ml) {
    const f16vec2 q = unpackFloat2x16(((w >> s) & 0x000F000Fu) | 0x64006400u) - f16vec2(1024.0hf);
    precise const f16vec2 v = fma(q, dl, -ml);
    return packFloat2x16(v);
}

// 8 weights from the nibbles at bits s.. of words a (k0..3) and b (k4..7), scaled, in the tiles' order
uvec4 nib8(uint a, uint b, uint s, f16vec2 dl, f16vec2 ml) {
    return uvec4(nib2(a, s, dl, ml), nib2(a, s + 8u, dl, ml), nib2(b, s, dl, ml), nib2(b, s + 8u, dl, ml));
}
#endif

// The registers into the tiles (tile set sb with DBUF).
#ifdef DBUF
void store(uint k0, uint tid, uint sb) {
#else
void store(uint k0, uint tid) {
#endif
    [[unroll]] for (uint h = 0; h < XPT; ++h) {
        const uint idx = tid + NINV * h;
        xs[XSI((idx / (BK / 8u)) * SK8 + idx % (BK / 8u))] = rx[h];
    }
#ifdef TYPE_Q4_K
    [[unroll]] for (uint h = 0; h < WPT; ++h) {
        const uint idx = tid + NINV * h, r = idx / PPR, j = idx % PPR;
#ifdef BK32
        const uint c = (k0 % 256u) / 64u, lo = j, hi = PPR + j;  // positions (uvec4) of the two halves
#else
        const uint c = (k0 % 256u) / 64u + j / PPC, g = j % PPC;
        const uint lo = 8u * (j / PPC) + (QB / 8u) * g, hi = lo + 4u;
#endif
        const vec2 dm = unpackHalf2x16(rh[h].x);
        const uvec2 s0 = q4k_scale_min(rh[h].yzw, 2u * c), s1 = q4k_scale_min(rh[h].yzw, 2u * c + 1u);
        const f16vec2 dl0 = f16vec2(dm.x * float(s0.x)), ml0 = f16vec2(dm.y * float(s0.y));
        const f16vec2 dl1 = f16vec2(dm.x * float(s1.x)), ml1 = f16vec2(dm.y * float(s1.y));
        // low nibbles: sub-block 2c, k QB g.. of the chunk (g the piece's place in it, fetch) at position lo;
        // high nibbles: 2c + 1, k 32 + QB g.. at position hi; words .x = k 8g'..8g'+3 (bytes 0-3), .y =
        // k 8g'+4.. (and .z, .w the next 8 with WIDE); pairs (k0, k2), (k1, k3) as the tiles' order wants
#ifdef WIDE
        [[unroll]] for (uint v = 0; v < QV; ++v) {
            const uvec4 q = rq[h * QV + v];
            ws[WSI(r * SK8 + lo + 2u * v)] = nib8(q.x, q.y, 0u, dl0, ml0);
            ws[WSI(r * SK8 + lo + 2u * v + 1u)] = nib8(q.z, q.w, 0u, dl0, ml0);
            ws[WSI(r * SK8 + hi + 2u * v)] = nib8(q.x, q.y, 4u, dl1, ml1);
            ws[WSI(r * SK8 + hi + 2u * v + 1u)] = nib8(q.z, q.w, 4u, dl1, ml1);
        }
#else
        ws[WSI(r * SK8 + lo)] = nib8(rq[h].x, rq[h].y, 0u, dl0, ml0);
        ws[WSI(r * SK8 + hi)] = nib8(rq[h].x, rq[h].y, 4u, dl1, ml1);
#endif
    }
#else
    [[unroll]] for (uint h = 0; h < WPT; ++h) {
        const uint idx = tid + NINV * h;
        ws[WSI((idx / (BK / 8u)) * SK8 + idx % (BK / 8u))] = rw[h];
    }
#endif
}

// One step's products: per 16 of K, TF x NF fragments of this subgroup's part (tile set sb with DBUF).
#define PRODUCTS()                                                                                           \
    [[unroll]] for (uint kk = 0; kk < BK; kk += 16u) {                                                       \
        CM_A a[TF];                                                                                          \
        CM_B b[NF];                                                                                          \
        [[unroll]] for (uint i = 0; i < TF; ++i)                                                             \
            coopMatLoad(a[i], xs, XSI((st + 16u * i) * SK8 + kk / 8u), SK8, gl_CooperativeMatrixLayoutRowMajor); \
        [[unroll]] for (uint j = 0; j < NF; ++j)                                                             \
            coopMatLoad(b[j], ws, WSI((sn + 16u * j) * SK8 + kk / 8u), SK8,                                  \
                        gl_CooperativeMatrixLayoutColumnMajor);                                              \
        [[unroll]] for (uint i = 0; i < TF; ++i)                                                             \
            [[unroll]] for (uint j = 0; j < NF; ++j) acc[i][j] = coopMatMulAdd(a[i], b[j], acc[i][j]);       \
    }

// How many workgroups of this pipeline the device holds at once (its registers and shared memory decide; the
// K split is chosen for whole waves of them: kernels_matmul.split_k_waves): each workgroup counts itself in,
// records how many are in and not yet out, stays for N reads of a counter, and counts itself out.
void probe_residency() {
    if (gl_LocalInvocationID.x != 0u) return;
    const uint entered = atomicAdd(probe[0], 1u) + 1u;
    atomicMax(probe[2], entered - atomicAdd(probe[1], 0u));
    uint seen = 0u;
    for (uint i = 0u; i < p.N; ++i) seen += probe[3];
    atomicAdd(probe[1], 1u + seen);  // probe[3] stays 0: seen only keeps the reads
}

void main() {
    if (p.K == 0u) {  // uniform: a probe dispatch runs nothing else
        probe_residency();
        return;
    }
    const uint tid = gl_LocalInvocationID.x;
    const uint t0 = gl_WorkGroupID.x * BT, n0 = gl_WorkGroupID.y * BN;
    const uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint st = (sg % SG_T) * WT, sn = (sg / SG_T) * WN;  // this subgroup's corner inside the tile

    CM_C acc[TF][NF];
    [[unroll]] for (uint i = 0; i < TF; ++i) [[unroll]] for (uint j = 0; j < NF; ++j) acc[i][j] = CM_C(0.0);

    const uint k_begin = gl_WorkGroupID.z * p.k_split, k_end = min(p.K, k_begin + p.k_split);
    fetch(n0, t0, k_begin, k_end, tid);
#ifdef DBUF
    store(k_begin, tid, 0u);
    barrier();
    uint sb = 0u;  // the tile set this step multiplies
    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        const bool more = k0 + BK < k_end;
        if (more) fetch(n0, t0, k0 + BK, k_end, tid);  // in flight during the products
        PRODUCTS();
        if (more) {  // into the other set: its last readers passed the previous step's barrier
            store(k0 + BK, tid, sb ^ 1u);
            barrier();
        }
        sb ^= 1u;
    }
    barrier();  // every subgroup's last products read before ws stages the results
#else
    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        store(k0, tid);
        barrier();
        if (k0 + BK < k_end) fetch(n0, t0, k0 + BK, k_end, tid);  // in flight during the products
        PRODUCTS();
        barrier();
    }
#endif

    // write out through a staging tile in ws (64 uvec4 a subgroup, free after the loop's last barrier): lane
    // writes 8 of the 256 values
    const uint ybase = gl_WorkGroupID.z * p.T * p.y_stride + p.row_offset;
    [[unroll]] for (uint i = 0; i < TF; ++i) {
        [[unroll]] for (uint j = 0; j < NF; ++j) {
            coopMatStore(acc[i][j], ws, sg * 64u, 4u, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            [[unroll]] for (uint e = 0; e < 8u; ++e) {
                const uint idx = lane + 32u * e, r = idx / 16u, c = idx % 16u;
                const uint t = t0 + st + 16u * i + r, n = n0 + sn + 16u * j + c;
                if (t < p.T && n < p.N)
                    y[ybase + t * p.y_stride + n] = uintBitsToFloat(ws[sg * 64u + idx / 4u][idx % 4u]) * xscale[t];
            }
            subgroupBarrier();
        }
    }
}
