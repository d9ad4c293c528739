#version 450
// The patch embedding's im2col: pixels (n, C, S, S) float32 -> rows (n * G * G, Kp), G = S / p, of the
// C * p * p values of a patch then zeros up to Kp (the GEMM's K, padded to whole 8-value groups).
// Row b * G * G + gy * G + gx (PyTorch's flatten(2) order) holds the patch at grid row gy, column gx, its
// values in (c, i, j) order, the conv weight (D, C, p, p)'s flattened order. Grid-stride over n values.
#include "common.glsl"

layout(binding = 0) readonly buffer Px { float px[]; };
layout(binding = 1) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
    uint n;  // values written: images * G * G * C * p * p
    uint S;
    uint psize;
    uint C;
    uint Kp;  // the row length (>= C * p * p)
} p;

void main() {
    const uint G = p.S / p.psize, pp = p.psize * p.psize, K = p.C * pp;
    const uint stride = grid_size();
    for (uint o = global_index(); o < p.n; o += stride) {
        const uint row = o / p.Kp, col = o % p.Kp;
        if (col >= K) {
            y[o] = 0.0;
            continue;
        }
        const uint img = row / (G * G), cell = row % (G * G);
        const uint gy = cell / G, gx = cell % G;
        const uint c = col / pp, ij = col % pp, i = ij / p.psize, j = ij % p.psize;
        y[o] = px[((img * p.C + c) * p.S + gy * p.psize + i) * p.S + gx * p.psize + j];
    }
}
