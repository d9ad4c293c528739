#version 450
// NeoX rotary embedding of x (T, H, Dh), pairs (i, i + Dh/2):
//   y0 = x0 cos(a) - x1 sin(a),  y1 = x1 cos(a) + x0 sin(a),  a = pos / scale * base^(-2i / Dh)
// with pos = pos[pos_off + t]. One invocation per pair, grid-stride. In place when X and Y are bound to the
// same range (each invocation reads its pair before writing it, so no qualifiers that forbid aliasing);
// strides let it work on the q or k part of a fused qkv row.
#include "common.glsl"

layout(binding = 0) buffer X { float x[]; };
layout(binding = 1) readonly buffer Pos { uint pos[]; };
layout(binding = 2) buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint n_tokens;
    uint n_heads;
    uint head_dim;  // Dh, even
    uint x_stride;  // elements between tokens of x (heads are contiguous, Dh apart)
    uint y_stride;
    uint pos_off;   // index of token 0's position in pos (the step metadata's positions section)
    float base;     // rope_freq_base
    float scale;    // linear scaling factor (1: none)
} p;

const float TWO_PI_HI = 6.28318548202514648;  // float(2 pi)
const float TWO_PI_LO = -1.7484556e-7;        // 2 pi - TWO_PI_HI

void main() {
    const uint half_dim = p.head_dim / 2;
    const uint n = p.n_tokens * p.n_heads * half_dim;
    const float log2_base = log2(p.base);
    const uint stride = grid_size();
    for (uint idx = global_index(); idx < n; idx += stride) {
        const uint i = idx % half_dim;
        const uint th = idx / half_dim;
        const uint h = th % p.n_heads, t = th / p.n_heads;
        const float inv_freq = exp2(-float(2 * i) / float(p.head_dim) * log2_base);
        const float a = float(pos[p.pos_off + t]) / p.scale * inv_freq;
        // reduce to [-pi, pi] first: drivers' sin/cos are only accurate there
        const float k = round(a * 0.15915494309189535);
        const float r = fma(-k, TWO_PI_LO, fma(-k, TWO_PI_HI, a));
        const float c = cos(r), s = sin(r);
        const uint xo = t * p.x_stride + h * p.head_dim + i;
        const uint yo = t * p.y_stride + h * p.head_dim + i;
        const float x0 = x[xo], x1 = x[xo + half_dim];
        y[yo] = x0 * c - x1 * s;
        y[yo + half_dim] = x1 * c + x0 * s;
    }
}
