#version 450
// The dense attention's operands as float16 heads, for vision_attention_cm.comp: for image i, head h, row
// r < PP (P rounded up to whole ROWS-row blocks) and dims d < DHP (the head rounded up to whole 16-wide
// blocks),
//   qh[i, h, r, d] = (q[i, r, h dh + d] + qb[h dh + d]) * scale,   kh, vh: (k + kb), (v + vb)
// the biases added only with ``bias``; zero past P and past dh (padded keys score finitely and are masked
// by the attention; padded dims add 0 to every dot; padded values add 0 to every output). q, k, v (n, P, W)
// float32, W = heads * dh; qh, kh, vh (n, heads, PP, DHP) float16 as uvec4 (8 values), one invocation an
// uvec4 of each, grid-stride. Requires dh % 8 == 0.
// Bindings: 0 q, 1 k, 2 v, 3 qb, 4 kb, 5 vb (float32), 6 qh, 7 kh, 8 vh (uvec4).
#include "common.glsl"

layout(binding = 0) readonly buffer Q { float q[]; };
layout(binding = 1) readonly buffer K { float k[]; };
layout(binding = 2) readonly buffer V { float v[]; };
layout(binding = 3) readonly buffer QB { float qb[]; };
layout(binding = 4) readonly buffer KB { float kb[]; };
layout(binding = 5) readonly buffer VB { float vb[]; };
layout(binding = 6) writeonly buffer QH { uvec4 qh[]; };
layout(binding = 7) writeonly buffer KH { uvec4 kh[]; };
layout(binding = 8) writeonly buffer VH { uvec4 vh[]; };

layout(push_constant) uniform Push {
    uint n;      // images
    uint P;      // patches per image
    uint PP;     // rows per head in qh, kh, vh
    uint W;      // row width of q, k, v: heads * dh
    uint dh;
    uint DHP;    // padded head (a multiple of 16)
    float scale; // q's factor
    uint bias;   // 1: add qb, kb, vb
} p;

// Eight values of a row of x from element o, plus the bias's from element c when ``bias``, times f, as the
// uvec4 of their float16 values in order
#define PACK8(x, xb, o, c, f)                                                                         \
    pack8_f16(f * (vec4(x[o], x[o + 1u], x[o + 2u], x[o + 3u])                                       \
                   + (p.bias != 0u ? vec4(xb[c], xb[c + 1u], xb[c + 2u], xb[c + 3u]) : vec4(0.0))),  \
              f * (vec4(x[o + 4u], x[o + 5u], x[o + 6u], x[o + 7u])                                  \
                   + (p.bias != 0u ? vec4(xb[c + 4u], xb[c + 5u], xb[c + 6u], xb[c + 7u]) : vec4(0.0))))

uvec4 pack8_f16(vec4 a, vec4 b) {
    return uvec4(packFloat2x16(f16vec2(a.xy)), packFloat2x16(f16vec2(a.zw)), packFloat2x16(f16vec2(b.xy)),
                 packFloat2x16(f16vec2(b.zw)));
}

void main() {
    const uint words = p.DHP / 8u, heads = p.W / p.dh;
    const uint total = p.n * heads * p.PP * words;
    for (uint idx = global_index(); idx < total; idx += grid_size()) {
        const uint w = idx % words, r = (idx / words) % p.PP, hi = idx / (words * p.PP);
        const uint h = hi % heads, img = hi / heads;
        uvec4 qd = uvec4(0u), kd = uvec4(0u), vd = uvec4(0u);
        if (r < p.P && 8u * w < p.dh) {
            const uint c = h * p.dh + 8u * w, o = (img * p.P + r) * p.W + c;
            qd = PACK8(q, qb, o, c, p.scale);
            kd = PACK8(k, kb, o, c, 1.0);
            vd = PACK8(v, vb, o, c, 1.0);
        }
        qh[idx] = qd;
        kh[idx] = kd;
        vh[idx] = vd;
    }
}
