#version 450
// Gemma's per-head q/k normalisation then RoPE, fused (two dispatches -> one), one workgroup per (token, head):
//   v = x[t, h, :] / sqrt(mean(x[t, h, :]^2) + eps) * w;   y = rope(v) as rope.comp (NeoX pairs (i, i+Dh/2),
//   angle pos / scale * base^(-2i/Dh), reduced to [-pi, pi] before sin/cos): norm_rope.glsl.
// Bindings: 0 x (T, H, Dh) rows x_stride apart, 1 w (Dh), 2 step metadata (positions at pos_off), 3 y.
#include "common.glsl"
#extension GL_KHR_shader_subgroup_arithmetic : require

layout(binding = 0) readonly buffer X { float x[]; };
layout(binding = 1) readonly buffer W { float w[]; };
layout(binding = 2) readonly buffer Meta { uint meta[]; };
layout(binding = 3) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint n_tokens;
    uint n_heads;
    uint head_dim;  // Dh, even
    uint x_stride;  // elements between tokens of x
    uint y_stride;
    uint pos_off;   // word offset of the positions in the step metadata
    float base;
    float scale;
    float eps;
} p;

#include "norm_rope.glsl"

void main() {
    const uint g = group_index();
    const uint t = g / p.n_heads, hd = g % p.n_heads;
    if (t >= p.n_tokens) return;  // uniform per workgroup
    const uint tid = gl_LocalInvocationID.x, half_dim = p.head_dim / 2u;
    const uint xo = t * p.x_stride + hd * p.head_dim, yo = t * p.y_stride + hd * p.head_dim;
    float ss = 0.0;
    for (uint c = tid; c < p.head_dim; c += BLOCK_SIZE) ss += x[xo + c] * x[xo + c];
    const float sc = head_inv_rms(ss);
    const float pos = float(meta[p.pos_off + t]);
    for (uint i = tid; i < half_dim; i += BLOCK_SIZE) {
        const float x0 = x[xo + i] * sc * w[i], x1 = x[xo + i + half_dim] * sc * w[i + half_dim];
        const vec2 r = rope_pair(x0, x1, rope_cos_sin(i, pos));
        y[yo + i] = r.x;
        y[yo + i + half_dim] = r.y;
    }
}
