#version 450
// The cooperative-matrix peak (bench/bench_vulkan_coopmat_peak.py): nothing but coopMatMulAdd on the shape
// hmad's GEMM uses (mul_mm_coopmat.comp: float16 A and B, 16 x 16 x 16, float32 accumulators).
//
// Every subgroup loads NA A and NB B fragments once (the same ones for all subgroups: a few KB, cached), then
// runs p.iters rounds of ROUNDS x NA x NB products, acc[i][j] += A_i B_j: NA NB independent accumulators, so
// the products of one round do not wait on each other (the tensor units' latency is covered by the other
// accumulators and by the other subgroups of the SM). The accumulators start at zero, so each ends as
// ROUNDS iters A_i B_j. The workgroups below p.store_groups store them (subgroup g of workgroup w at
// c[((w gl_NumSubgroups + g) NA NB + i NB + j) 256], 16 x 16 row-major), and so would any whose sum of
// every accumulator's first element equals p.never (the bits of a NaN: none does): every product feeds
// that condition, so the compiler can neither drop nor move into the branch any of them.
// Bindings: 0 A (NA 16 x 16 float16 row-major, M x K), 1 B (NB 16 x 16 float16 row-major, K x N), 2 C.
// Any workgroup size that is a whole number of subgroups; no shared memory.
//
// Staged variants (kernel names ..._lds, ..._step; a4x4 at block 128 is mul_mm_coopmat_q4_k_128x128_s2x2_w2's
// shape: 4 subgroups each multiplying 64 x 64 of a 128 x 128 tile): what that GEMM's structure reaches on
// shared memory without its global loads and W decode, the bound its prefill time is judged against:
// - LDS: every round's NA A and NB B fragments are loaded from a shared tile of 32 (NA + NB) rows of 72
//   float16 (the GEMM's BK 64 tile, rows padded alike): subgroup g reads A rows (g % 2) 16 NA.. and B rows
//   32 NA + ((g / 2) % 2) 16 NB.., round r columns 16 r.. (8 more on odd iterations, into the pad, so the
//   loads cannot leave the loop); ROUNDS rounds are one 64-wide step. The tile holds float16 1.0 throughout;
// - STEP (with LDS): each iteration it first stores the tile's 64 columns from registers (8 uvec4 a row, as
//   the GEMM stores x and decoded W; 1.0, or the next float16 up on odd iterations) between two barriers, as
//   the GEMM's step does; round r reads columns 16 r.. .
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#ifndef NA
#define NA 2u
#endif
#ifndef NB
#define NB 4u
#endif
#define ROUNDS 4u  // rounds of products per loop iteration (kernels_matmul.COOPMAT_PEAK_ROUNDS)
#ifdef LDS
#define SK8 9u                    // tile row stride in uvec4 (72 float16)
#define AROWS (32u * NA)          // A rows of the tile (B rows follow)
#define TROWS (AROWS + 32u * NB)  // rows of the tile
shared uvec4 tile[TROWS * SK8];
#endif

layout(binding = 0) readonly buffer A { float16_t a[]; };
layout(binding = 1) readonly buffer B { float16_t b[]; };
layout(binding = 2) writeonly buffer C { float c[]; };

layout(push_constant) uniform Push {
    uint iters;         // loop iterations (ROUNDS rounds each)
    uint store_groups;  // workgroups (x index below it) that store their accumulators
    uint never;         // float bits no sum equals (a NaN)
} p;

#define CM_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define CM_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define CM_C coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

#ifdef LDS
// The tile from registers: float16 1.0 (even it) or the next float16 up (odd), PER uvec4 of every row (8: the
// GEMM's data, 9: with the pad).
void store_tile(uint it, uint per) {
    for (uint idx = gl_LocalInvocationID.x; idx < TROWS * per; idx += gl_WorkGroupSize.x)
        tile[(idx / per) * SK8 + idx % per] = uvec4(0x3C003C00u | (it & 1u) * 0x00010001u);
}
#endif

void main() {
    CM_C acc[NA][NB];
    [[unroll]] for (uint i = 0; i < NA; ++i) [[unroll]] for (uint j = 0; j < NB; ++j) acc[i][j] = CM_C(0.0);
#ifdef LDS
    const uint sg = gl_SubgroupID, st = (sg % 2u) * 16u * NA, sn = AROWS + ((sg / 2u) % 2u) * 16u * NB;
    store_tile(0u, SK8);
    barrier();
    for (uint it = 0; it < p.iters; ++it) {
#ifdef STEP
        store_tile(it, 8u);
        barrier();
#endif
        [[unroll]] for (uint r = 0; r < ROUNDS; ++r) {
#ifdef STEP
            const uint c = 2u * r;  // the round's first uvec4 of a row
#else
            const uint c = 2u * r + (it & 1u);
#endif
            CM_A fa[NA];
            CM_B fb[NB];
            [[unroll]] for (uint i = 0; i < NA; ++i)
                coopMatLoad(fa[i], tile, (st + 16u * i) * SK8 + c, SK8, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint j = 0; j < NB; ++j)
                coopMatLoad(fb[j], tile, (sn + 16u * j) * SK8 + c, SK8, gl_CooperativeMatrixLayoutColumnMajor);
            [[unroll]] for (uint i = 0; i < NA; ++i)
                [[unroll]] for (uint j = 0; j < NB; ++j) acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);
        }
#ifdef STEP
        barrier();
#endif
    }
#else
    CM_A fa[NA];
    CM_B fb[NB];
    [[unroll]] for (uint i = 0; i < NA; ++i)
        coopMatLoad(fa[i], a, 256u * i, 16u, gl_CooperativeMatrixLayoutRowMajor);
    [[unroll]] for (uint j = 0; j < NB; ++j)
        coopMatLoad(fb[j], b, 256u * j, 16u, gl_CooperativeMatrixLayoutRowMajor);
    for (uint it = 0; it < p.iters; ++it) {
        [[unroll]] for (uint r = 0; r < ROUNDS; ++r)
            [[unroll]] for (uint i = 0; i < NA; ++i)
                [[unroll]] for (uint j = 0; j < NB; ++j) acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);
    }
#endif

    float s = 0.0;
    [[unroll]] for (uint i = 0; i < NA; ++i) [[unroll]] for (uint j = 0; j < NB; ++j) s += acc[i][j][0];
    if (gl_WorkGroupID.x < p.store_groups || s == uintBitsToFloat(p.never)) {
        const uint base = (gl_WorkGroupID.x * gl_NumSubgroups + gl_SubgroupID) * NA * NB * 256u;
        [[unroll]] for (uint i = 0; i < NA; ++i)
            [[unroll]] for (uint j = 0; j < NB; ++j)
                coopMatStore(acc[i][j], c, base + (i * NB + j) * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
    }
}
