// Gemma's per-head q/k normalisation and NeoX RoPE, shared by norm_rope.comp and norm_rope_kv.comp. Include
// after the Push block (head_dim, base, scale, eps) and after common.glsl; needs subgroup arithmetic.
//   v = x / sqrt(mean(x^2) + eps) * w over a head's Dh values;   pairs (i, i + Dh/2) rotated by
//   angle pos / scale * base^(-2i/Dh), reduced to [-pi, pi] before sin/cos (drivers are accurate there).

const float TWO_PI_HI = 6.28318548202514648;  // float(2 pi)
const float TWO_PI_LO = -1.7484556e-7;        // 2 pi - TWO_PI_HI

shared float nr_partial[BLOCK_SIZE];

// 1 / rms of a head, given each invocation's partial sum of squares (every invocation gets it)
float head_inv_rms(float ss) {
    ss = subgroupAdd(ss);
    if (subgroupElect()) nr_partial[gl_SubgroupID] = ss;
    barrier();
    ss = 0.0;
    for (uint i = 0; i < gl_NumSubgroups; ++i) ss += nr_partial[i];
    return inversesqrt(ss / float(p.head_dim) + p.eps);
}

// (cos, sin) of pair i's angle at position pos
vec2 rope_cos_sin(uint i, float pos) {
    const float inv_freq = exp2(-float(2u * i) / float(p.head_dim) * log2(p.base));
    const float ang = pos / p.scale * inv_freq;
    const float k = round(ang * 0.15915494309189535);
    const float r = fma(-k, TWO_PI_LO, fma(-k, TWO_PI_HI, ang));
    return vec2(cos(r), sin(r));
}

// The normed pair (x0 sc w0, x1 sc w1) rotated: (y_i, y_{i + Dh/2})
vec2 rope_pair(float x0, float x1, vec2 cs) {
    return vec2(x0 * cs.x - x1 * cs.y, x1 * cs.x + x0 * cs.y);
}
