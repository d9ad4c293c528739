#version 450
// y[t, row_offset + n] = sum_k x[t, k] * W[n, k] for decode batches, on int8 cooperative matrices: the exact
// path's arithmetic (x as the three int8 planes of q8act.glsl, W = Q4_K's 4-bit integers with float
// factors) with the integer products on the matrix units instead of packed dot products.
//
// Per 32-value block b of K (one Q4_K sub-block, one x block) and plane p, S_p = sum_k q[n, k] x_p[t, k] is
// one int8 x int8 -> int32 product (two where the device's int8 shape has K = 16); the three combine exactly
// in int32 as S = (S_1 2^7 + S_2) 2^7 + S_3 (|S| < 32 * 15 * 127 * 2^14 < 2^31), and then, per (row, token),
//   y += (d sc_b) (d_x / 2^14) S + (-dmin m_b) s_x
// in float32 (dq_int8.glsl's f and q8act.glsl's (d, s)): mul_mat_vec_q8.comp's block_term with the three
// plane dots joined before the conversion.
//
// A workgroup of NSG subgroups owns BN = NSG MR 16 rows and TT = NB NT tokens over one split of K (workgroup
// z covers [z k_split, (z + 1) k_split), as mul_mm_coopmat.comp: partial sums at z T y_stride for
// split_reduce.comp). Steps of BK = 128 values (half a Q4_K superblock, 4 blocks): the workgroup copies the
// step's x planes (16 bytes a load, from XQ's order) into shared memory; each subgroup decodes its own rows'
// nibbles into int8 rows there and their factors (only its own lanes read them); after a barrier each
// subgroup runs, per fragment of 16 rows and block, 3 NT products of 16 x NB (token fragments past T
// skipped: a step of 8 tokens runs half the products and sums of NB 16 where the device has NB 8); it stores
// the int32 tiles of JB blocks (of all its MR fragments with FB) at a time, and its lanes apply the factors to
// the (row, token) sums each keeps in registers. The next step's global loads are issued before the products
// (in flight meanwhile). What bounds it is each batch's chain of products, store, barrier and factors, not
// memory (bench_vulkan_mmq.py at the 27B shapes; the figures are in docs/tuning.md).
// Bindings: 0 W (Q4_K), 1 XQ (uvec4), 2 XD (vec2), 3 y. Push: CoopMatPush (x_stride unused).
// Requires 32-wide subgroups, K % 256 == 0, k_split % BK == 0, T <= TT * gl_NumWorkGroups.x.
// Dispatch (ceil(T / TT), ceil(N / BN), splits).
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "q4k.glsl"

#ifndef MR
#define MR 2u  // 16-row fragments a subgroup
#endif
#ifndef NT
#define NT 1u  // 16-token fragments a workgroup
#endif
#ifndef MK
#define MK 32u  // K of one int8 product (the device's shape: 32 on NVIDIA, 16 on AMD's RDNA3)
#endif
#ifndef JB
#define JB 2u  // blocks whose int32 tiles are stored together (one subgroup barrier pair for JB blocks)
#endif
#ifdef FB
#define FG MR  // fragments whose tiles are stored together (all of a subgroup's: one barrier pair for them)
#else
#define FG 1u
#endif
#define NSG 4u
#define NINV (NSG * 32u)
#define BN (NSG * MR * 16u)
#ifndef NB
#define NB 16u  // tokens of one product (16, or 8 where the device has 16 x 8 int8 products: half the work at T <= 8)
#endif
#define TT (NT * NB)
#define TILE (16u * NB)  // int32 sums of one product
#define EL (TILE / 32u)  // ... a lane's share (post)
#define BK 128u
#define SB (BK / 16u + 1u)                  // shared row stride in uvec4 (16 bytes of pad)
#define XN (3u * TT * (BK / 16u))          // x: uvec4 per step
#define XPT ((XN + NINV - 1u) / NINV)       // ... per invocation
#define QPL (MR * 16u * 4u / 32u)           // W quants: uvec4 per lane per step
#define HPL ((MR * 16u + 31u) / 32u)        // W headers: per lane per step

layout(binding = 0) readonly buffer W { uvec4 w4[]; };  // 144-byte blocks = 9 uvec4
layout(binding = 1) readonly buffer XQ { uvec4 xq4[]; };
layout(binding = 2) readonly buffer XD { vec2 xd[]; };
layout(binding = 3) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint K;
    uint N;
    uint T;
    uint x_stride;  // unused
    uint y_stride;
    uint row_bytes;
    uint row_offset;
    uint k_split;
} p;

shared uvec4 xs[3u * TT * SB];    // plane p, token t: row p TT + t, byte k % 16 of uvec4 k / 16
shared uvec4 ws[NSG * MR * 16u * SB];  // fragment g = sg MR + f, row r: row 16 g + r, int8 lanes
shared vec2 wf[NSG * MR * 16u * 4u];   // (d sc, -dmin m) of (row 16 g + r, block j) at 4 (16 g + r) + j
shared vec2 xf[TT * 4u];               // (d_x / 2^14, s_x) of (token t, block j) at 4 t + j
shared int cs[NSG * FG * JB * TILE];   // a subgroup's FG JB int32 tiles, (row, token) at NB row + token

#define CM_A coopmat<int8_t, gl_ScopeSubgroup, 16, MK, gl_MatrixUseA>
#define CM_B coopmat<int8_t, gl_ScopeSubgroup, MK, NB, gl_MatrixUseB>
#define CM_C coopmat<int, gl_ScopeSubgroup, 16, NB, gl_MatrixUseAccumulator>

uvec4 rx[XPT];
vec2 rxd;
uvec4 rq[QPL];
uvec4 rh[HPL];

void fetch(uint n0, uint t0, uint k0, uint tid, uint sg, uint lane) {
    const uint groups = p.K / 64u;
    [[unroll]] for (uint h = 0; h < XPT; ++h) {
        const uint idx = min(tid + NINV * h, XN - 1u), q = idx % (BK / 16u), row = idx / (BK / 16u);
        const uint pl = row / TT, t = min(t0 + row % TT, p.T - 1u), v = k0 + 16u * q;
        rx[h] = xq4[(t * 3u + pl) * (p.K / 16u) + ((v % 64u) / 16u) * groups + v / 64u];
    }
    if (tid < TT * 4u) rxd = xd[min(t0 + tid / 4u, p.T - 1u) * (p.K / 32u) + k0 / 32u + tid % 4u];
    const uint rstride = p.row_bytes / 16u, sbk = (k0 / 256u) * 9u, c = (k0 % 256u) / 64u;
    const uint g0 = (n0 + sg * MR * 16u);
    [[unroll]] for (uint h = 0; h < QPL; ++h) {
        const uint idx = lane + 32u * h, r = idx / 4u, u = idx % 4u;
        rq[h] = w4[min(g0 + r, p.N - 1u) * rstride + sbk + 1u + 2u * c + u];
    }
    [[unroll]] for (uint h = 0; h < HPL; ++h) {
        const uint r = min(lane + 32u * h, MR * 16u - 1u);
        rh[h] = w4[min(g0 + r, p.N - 1u) * rstride + sbk];
    }
}

void store(uint k0, uint tid, uint sg, uint lane) {
    [[unroll]] for (uint h = 0; h < XPT; ++h) {
        const uint idx = tid + NINV * h;
        if (XN % NINV == 0u || idx < XN) xs[(idx / (BK / 16u)) * SB + idx % (BK / 16u)] = rx[h];
    }
    if (tid < TT * 4u) xf[tid] = vec2(rxd.x * (1.0 / 16384.0), rxd.y);
    const uint rbase = sg * MR * 16u;
    [[unroll]] for (uint h = 0; h < QPL; ++h) {
        // quant uvec4 u of the step: chunk u / 2, bytes 16 (u % 2).. : sub-block 2 (u / 2) low nibbles,
        // 2 (u / 2) + 1 high ones, k 16 (u % 2).. of each
        const uint idx = lane + 32u * h, r = idx / 4u, u = idx % 4u, slot = 4u * (u / 2u) + u % 2u;
        ws[(rbase + r) * SB + slot] = rq[h] & 0x0F0F0F0Fu;
        ws[(rbase + r) * SB + slot + 2u] = (rq[h] >> 4u) & 0x0F0F0F0Fu;
    }
    const uint b0 = (k0 % 256u) / 32u;
    [[unroll]] for (uint h = 0; h < HPL; ++h) {
        const uint r = lane + 32u * h;
        if (r < MR * 16u) {
            const vec2 dm = unpackHalf2x16(rh[h].x);
            [[unroll]] for (uint j = 0; j < 4u; ++j) {
                const uvec2 sm = q4k_scale_min(rh[h].yzw, b0 + j);
                wf[(rbase + r) * 4u + j] = vec2(dm.x * float(sm.x), -dm.y * float(sm.y));
            }
        }
    }
}

// The factors applied to JB tiles' sums (post): a lane owns one token (lr) and the rows lt + (32 / NB) e.
// (Lanes owning a row and every other token, skipping the tokens past T, measured slower.)
void post(inout float a[EL], uint tile, uint g, uint j, uint i, uint lr, uint lt) {
    const vec2 x = xf[4u * (NB * i + lr) + j];
    [[unroll]] for (uint e = 0; e < EL; ++e) {
        const uint r = lt + (32u / NB) * e;
        const vec2 w = wf[4u * (16u * g + r) + j];
        a[e] += w.x * x.x * float(cs[tile * TILE + NB * r + lr]) + w.y * x.y;
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint t0 = gl_WorkGroupID.x * TT, n0 = gl_WorkGroupID.y * BN;
    const uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint lr = lane % NB, lt = lane / NB;  // the lane's place in a fragment (post)
    const int live = int(p.T) - int(t0);          // tokens of the workgroup's tile up to T

    float acc[MR][NT][EL];
    [[unroll]] for (uint f = 0; f < MR; ++f)
        [[unroll]] for (uint i = 0; i < NT; ++i) [[unroll]] for (uint e = 0; e < EL; ++e) acc[f][i][e] = 0.0;

    const uint k_begin = gl_WorkGroupID.z * p.k_split, k_end = min(p.K, k_begin + p.k_split);
    fetch(n0, t0, k_begin, tid, sg, lane);
    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        store(k0, tid, sg, lane);
        barrier();
        if (k0 + BK < k_end) fetch(n0, t0, k0 + BK, tid, sg, lane);  // in flight during the products
        [[unroll]] for (uint f0 = 0; f0 < MR; f0 += FG) {
            [[unroll]] for (uint jb = 0; jb < 4u; jb += JB) {
                CM_C s[FG * JB * NT];  // fragment f0 + ff, block jb + jj, token fragment i at (ff JB + jj) NT + i
                [[unroll]] for (uint ff = 0; ff < FG; ++ff) {
                    const uint g = sg * MR + f0 + ff;
                    [[unroll]] for (uint jj = 0; jj < JB; ++jj) {
                        const uint j = jb + jj, q = (ff * JB + jj) * NT;
                        CM_A a[32u / MK];
                        [[unroll]] for (uint kk = 0; kk < 32u / MK; ++kk)
                            coopMatLoad(a[kk], ws, 16u * g * SB + 2u * j + kk * (MK / 16u), SB,
                                        gl_CooperativeMatrixLayoutRowMajor);
                        [[unroll]] for (uint i = 0; i < NT; ++i) {
                            s[q + i] = CM_C(0);
                            if (NT == 1u || int(NB * i) < live) {  // (uniform)
                                [[unroll]] for (uint pl = 0; pl < 3u; ++pl) {
                                    if (pl > 0u) s[q + i] = s[q + i] * 128;
                                    [[unroll]] for (uint kk = 0; kk < 32u / MK; ++kk) {
                                        CM_B b;
                                        coopMatLoad(b, xs, (pl * TT + NB * i) * SB + 2u * j + kk * (MK / 16u), SB,
                                                    gl_CooperativeMatrixLayoutColumnMajor);
                                        s[q + i] = coopMatMulAdd(a[kk], b, s[q + i]);
                                    }
                                }
                            }
                        }
                    }
                }
                [[unroll]] for (uint i = 0; i < NT; ++i) {
                    if (NT == 1u || int(NB * i) < live) {
                        [[unroll]] for (uint q = 0; q < FG * JB; ++q)
                            coopMatStore(s[q * NT + i], cs, (sg * FG * JB + q) * TILE, NB, gl_CooperativeMatrixLayoutRowMajor);
                        subgroupMemoryBarrierShared();
                        subgroupBarrier();
                        [[unroll]] for (uint ff = 0; ff < FG; ++ff)
                            [[unroll]] for (uint jj = 0; jj < JB; ++jj)
                                post(acc[f0 + ff][i], sg * FG * JB + ff * JB + jj, sg * MR + f0 + ff, jb + jj, i, lr, lt);
                        subgroupBarrier();
                    }
                }
            }
        }
        barrier();
    }

    const uint ybase = gl_WorkGroupID.z * p.T * p.y_stride + p.row_offset;
    [[unroll]] for (uint f = 0; f < MR; ++f) {
        [[unroll]] for (uint i = 0; i < NT; ++i) {
            [[unroll]] for (uint e = 0; e < EL; ++e) {
                const uint n = n0 + 16u * (sg * MR + f) + lt + (32u / NB) * e, t = t0 + NB * i + lr;
                if (t < p.T && n < p.N) y[ybase + t * p.y_stride + n] = acc[f][i][e];
            }
        }
    }
}
