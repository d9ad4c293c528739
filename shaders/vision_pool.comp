#version 450
// The projector's average pool: x (n, side * side, D) -> y (n, t * t, D), t = side / k; token r * t + c is
// the mean of grid rows r*k .. r*k+k-1 and columns c*k .. c*k+k-1 (row-major sum, then / (k * k)).
// Grid-stride over n values (images * t * t * D).
#include "common.glsl"

layout(binding = 0) readonly buffer X { float x[]; };
layout(binding = 1) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint n;
    uint side;
    uint k;
    uint D;
} p;

void main() {
    const uint t = p.side / p.k;
    const uint stride = grid_size();
    for (uint o = global_index(); o < p.n; o += stride) {
        const uint d = o % p.D, tok = (o / p.D) % (t * t), img = o / (p.D * t * t);
        const uint r = tok / t, c = tok % t;
        float s = 0.0;
        for (uint i = 0; i < p.k; ++i) {
            const uint base = (img * p.side * p.side + (r * p.k + i) * p.side + c * p.k) * p.D + d;
            for (uint j = 0; j < p.k; ++j) s += x[base + j * p.D];
        }
        y[o] = s / float(p.k * p.k);
    }
}
