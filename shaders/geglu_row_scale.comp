#version 450
// The FFN's GeGLU as the down projection's GEMM reads it: for row t (one workgroup a row),
// f[n] = gelu_mul(sum_s gate[s, t, n], sum_s up[s, t, n]) of the gate and up GEMMs' split-K partial sums
// (split_reduce.comp GEGLU's f, the same sums in the same order), then s[t] and xh[t] exactly as row_scale.comp
// makes them of f; f itself is never written. One pass when the row is in range (scale 1.0, the common case):
// xh is written as f is made and the row's max checked after; a row past it is made again with its scale.
// Against split_reduce_geglu + row_scale: f's 4 bytes a value neither written nor read back, one dispatch less.
// An invocation makes 8 values at a time (two vec4 loads a split and projection, one uvec4 of xh).
// Bindings: 0 gate partials, 1 s, 2 up partials (split s of (T, N) at s T N), 3 xh (T rows of N halves).
// Requires N % 8 == 0.
#include "common.glsl"
#include "row_scale.glsl"

layout(binding = 0) readonly buffer P { vec4 part[]; };
layout(binding = 1) writeonly buffer S { float s[]; };
layout(binding = 2) readonly buffer PU { vec4 part_up[]; };
layout(binding = 3) writeonly buffer XH { uvec4 xh8[]; };  // 8 float16 in the tiles' order

layout(push_constant) uniform Push {  // split_reduce.comp's (y_stride, row_offset unused)
    uint N;
    uint T;
    uint splits;
    uint y_stride;
    uint row_offset;
} p;

// f at elements 4 i .. 4 i + 3 of (T, N)
vec4 geglu4(uint i) {
    const uint total4 = p.T * p.N / 4u;
    vec4 g = vec4(0.0), u = vec4(0.0);
    for (uint s = 0; s < p.splits; ++s) g += part[s * total4 + i];
    for (uint s = 0; s < p.splits; ++s) u += part_up[s * total4 + i];
    return vec4(gelu_mul(g.x, u.x), gelu_mul(g.y, u.y), gelu_mul(g.z, u.z), gelu_mul(g.w, u.w));
}

void main() {
    const uint row = group_index();
    if (row >= p.T) return;
    const uint tid = gl_LocalInvocationID.x, groups = p.N / 8u, base = row * groups;
    float m = 0.0;
    for (uint j = tid; j < groups; j += BLOCK_SIZE) {  // values 8j.. of the row, at scale 1.0
        const vec4 lo = geglu4(2u * (base + j)), hi = geglu4(2u * (base + j) + 1u);
        m = sticky_max(sticky_max(m, abs(lo.x)), abs(lo.y));
        m = sticky_max(sticky_max(m, abs(lo.z)), abs(lo.w));
        m = sticky_max(sticky_max(m, abs(hi.x)), abs(hi.y));
        m = sticky_max(sticky_max(m, abs(hi.z)), abs(hi.w));
        xh8[base + j] = pack8_tiles(lo, hi);
    }
    const float sc = row_scale_of(m, tid);
    if (tid == 0) s[row] = sc;
    if (sc == 1.0) return;  // uniform: every invocation has the row's scale
    const float inv = 1.0 / sc;  // exact: a power of two
    for (uint j = tid; j < groups; j += BLOCK_SIZE)  // the same values again, scaled (this invocation's)
        xh8[base + j] = pack8_tiles(geglu4(2u * (base + j)) * inv, geglu4(2u * (base + j) + 1u) * inv);
}
