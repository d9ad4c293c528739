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

void main() {
    CM_A fa[NA];
    CM_B fb[NB];
    CM_C acc[NA][NB];
    [[unroll]] for (uint i = 0; i < NA; ++i)
        coopMatLoad(fa[i], a, 256u * i, 16u, gl_CooperativeMatrixLayoutRowMajor);
    [[unroll]] for (uint j = 0; j < NB; ++j)
        coopMatLoad(fb[j], b, 256u * j, 16u, gl_CooperativeMatrixLayoutRowMajor);
    [[unroll]] for (uint i = 0; i < NA; ++i) [[unroll]] for (uint j = 0; j < NB; ++j) acc[i][j] = CM_C(0.0);

    for (uint it = 0; it < p.iters; ++it) {
        [[unroll]] for (uint r = 0; r < ROUNDS; ++r)
            [[unroll]] for (uint i = 0; i < NA; ++i)
                [[unroll]] for (uint j = 0; j < NB; ++j) acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);
    }

    float s = 0.0;
    [[unroll]] for (uint i = 0; i < NA; ++i) [[unroll]] for (uint j = 0; j < NB; ++j) s += acc[i][j][0];
    if (gl_WorkGroupID.x < p.store_groups || s == uintBitsToFloat(p.never)) {
        const uint base = (gl_WorkGroupID.x * gl_NumSubgroups + gl_SubgroupID) * NA * NB * 256u;
        [[unroll]] for (uint i = 0; i < NA; ++i)
            [[unroll]] for (uint j = 0; j < NB; ++j)
                coopMatStore(acc[i][j], c, base + (i * NB + j) * 256u, 16u, gl_CooperativeMatrixLayoutRowMajor);
    }
}
