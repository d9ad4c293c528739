// Weight decoders of the int8 mat-vec (mul_mat_vec_q8.comp): one "unit" of a GGUF row at a time, as int8 lane
// words q[] (4 weights per word, the same order as the q8 activations of q8act.glsl) plus float factors f,
// so that unit . x = sum over the unit's 32-blocks b of  f_b * d_x[b] * sdot(q, xq) (+ f_min_b * s_x[b]).
// Offsets are folded into the lanes where the type has one: (q - o) mod 256 for q in 0..2o-1 is
// ((q + 128 - o) ^ 0x80) per byte, with no carry between bytes.
//   UNIT_W         weights per unit (32, or 64 for Q4_K: one 32-byte qs chunk holds two sub-blocks)
//   W_ELEM, WSIZE  the element a weight buffer is read as, and its bytes (a row starts at row_bytes / WSIZE)
//   W_TEXEL, W_PICK  the same element as a storage texel buffer's format, and what of imageLoad's result it is
//   LOAD_UNIT(rb, u, q, f)   unit u of the row starting at element rb, read through WB(i) (element i)
// Included twice or more: first for the constants (before the .comp declares its weight buffers), then with
// WB(i) and LOAD_UNIT defined, once per weight buffer, for a decoder reading that buffer (GLSL cannot pass one).
// One type per variant (TYPE_* define), the same layouts as dequant.glsl.

#ifndef DQ_INT8_CONSTANTS
#define DQ_INT8_CONSTANTS
#define HALF16(h) unpackHalf2x16(uint(h)).x
#define LO4 0x0F0F0F0Fu

// The 5th bits of 4 weights (bits e of b, e = 0..3) moved to bit 4 of byte e.
uint spread4(uint b) {
    return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}

#if defined(TYPE_Q8_0) || defined(TYPE_Q4_0) || defined(TYPE_Q5_0) || defined(TYPE_Q6_K)
#define W_ELEM uint16_t
#define W_TEXEL r16ui
#define W_PICK .x
#define WSIZE 2u
#define UNIT_W 32u
#elif defined(TYPE_Q4_K)
#define W_ELEM uvec4
#define W_TEXEL rgba32ui
#define W_PICK
#define WSIZE 16u
#define UNIT_W 64u
#include "q4k.glsl"
#else
#error "define one of TYPE_Q8_0, TYPE_Q4_0, TYPE_Q5_0, TYPE_Q4_K, TYPE_Q6_K"
#endif
#endif  // DQ_INT8_CONSTANTS

#ifdef LOAD_UNIT
#if defined(TYPE_Q8_0)
// Q8_0: 34 bytes = 17 uint16: d f16, qs int8[32].   w = d * q
void LOAD_UNIT(uint rb, uint u, out uint q[UNIT_W / 4u], out vec4 f) {
    const uint b = rb + u * 17u;
    f = vec4(HALF16(WB(b)), 0.0, 0.0, 0.0);
    [[unroll]] for (uint i = 0; i < 8u; ++i) q[i] = uint(WB(b + 1u + 2u * i)) | (uint(WB(b + 2u + 2u * i)) << 16);
}

#elif defined(TYPE_Q4_0)
// Q4_0: 18 bytes = 9 uint16: d f16, qs 16 (weight j low nibble of byte j, weight 16+j high nibble).
//   w = d * (q - 8)
void LOAD_UNIT(uint rb, uint u, out uint q[UNIT_W / 4u], out vec4 f) {
    const uint b = rb + u * 9u;
    f = vec4(HALF16(WB(b)), 0.0, 0.0, 0.0);
    [[unroll]] for (uint i = 0; i < 4u; ++i) {
        const uint w = uint(WB(b + 1u + 2u * i)) | (uint(WB(b + 2u + 2u * i)) << 16);
        q[i] = ((w & LO4) + 0x78787878u) ^ 0x80808080u;
        q[4u + i] = (((w >> 4) & LO4) + 0x78787878u) ^ 0x80808080u;
    }
}

#elif defined(TYPE_Q5_0)
// Q5_0: 22 bytes = 11 uint16: d f16, qh u32 (bit j: 5th bit of weight j), qs 16 (as Q4_0).
//   w = d * (q - 16)
void LOAD_UNIT(uint rb, uint u, out uint q[UNIT_W / 4u], out vec4 f) {
    const uint b = rb + u * 11u;
    f = vec4(HALF16(WB(b)), 0.0, 0.0, 0.0);
    const uint qh = uint(WB(b + 1u)) | (uint(WB(b + 2u)) << 16);
    [[unroll]] for (uint i = 0; i < 4u; ++i) {
        const uint w = uint(WB(b + 3u + 2u * i)) | (uint(WB(b + 4u + 2u * i)) << 16);
        const uint lo = (w & LO4) | spread4(qh >> (4u * i));
        const uint hi = ((w >> 4) & LO4) | spread4(qh >> (16u + 4u * i));
        q[i] = (lo + 0x70707070u) ^ 0x80808080u;
        q[4u + i] = (hi + 0x70707070u) ^ 0x80808080u;
    }
}

#elif defined(TYPE_Q4_K)
// Q4_K: 144 bytes = 9 uvec4: [0] d|dmin, scales 0..11; [1..8] qs, chunk c (uvec4 1+2c, 2+2c) holding
// sub-block 2c in the low nibbles and 2c+1 in the high ones. Unit = chunk: 64 weights, x blocks 2u, 2u+1.
//   w = d * sc[j] * q - dmin * m[j];   f = (d sc0, d sc1, -dmin m0, -dmin m1)
void LOAD_UNIT(uint rb, uint u, out uint q[UNIT_W / 4u], out vec4 f) {
    const uint b = rb + (u / 4u) * 9u, c = u % 4u;
    const uvec4 h = WB(b);
    const vec2 dm = unpackHalf2x16(h.x);
    const uvec2 s0 = q4k_scale_min(h.yzw, 2u * c), s1 = q4k_scale_min(h.yzw, 2u * c + 1u);
    f = vec4(dm.x * float(s0.x), dm.x * float(s1.x), -dm.y * float(s0.y), -dm.y * float(s1.y));
    const uvec4 a = WB(b + 1u + 2u * c), e = WB(b + 2u + 2u * c);
    const uint w[8] = uint[8](a.x, a.y, a.z, a.w, e.x, e.y, e.z, e.w);
    [[unroll]] for (uint i = 0; i < 8u; ++i) {
        q[i] = w[i] & LO4;
        q[8u + i] = (w[i] >> 4) & LO4;
    }
}

#elif defined(TYPE_Q6_K)
// Q6_K: 210 bytes = 105 uint16: ql 128 (u16 0..63), qh 64 (64..95), scales int8[16] (96..103), d f16 (104).
// Unit u = 32 weights: superblock u/8, half h = (u%8)/4, group g = u%4: low bits = nibble g/2 of
// ql[64h + 32(g%2) + l], high bits = bits 2g of qh[32h + l]; its 16-weight halves are scaled by
// sc[8h+2g] and sc[8h+2g+1].   w = d * sc * (q - 32);   f = (d sc0, d sc1, 0, 0)
void LOAD_UNIT(uint rb, uint u, out uint q[UNIT_W / 4u], out vec4 f) {
    const uint b = rb + (u / 8u) * 105u, hh = (u % 8u) / 4u, g = u % 4u;
    const uint ql = b + 32u * hh + 16u * (g % 2u), qh = b + 64u + 16u * hh;
    const int sc = int(uint(WB(b + 96u + 4u * hh + g)));
    const float d = HALF16(WB(b + 104u));
    f = vec4(d * float(bitfieldExtract(sc, 0, 8)), d * float(bitfieldExtract(sc, 8, 8)), 0.0, 0.0);
    const uint ls = 4u * (g / 2u), hs = 2u * g;
    [[unroll]] for (uint i = 0; i < 8u; ++i) {
        const uint wl = uint(WB(ql + 2u * i)) | (uint(WB(ql + 2u * i + 1u)) << 16);
        const uint wh = uint(WB(qh + 2u * i)) | (uint(WB(qh + 2u * i + 1u)) << 16);
        const uint v = ((wl >> ls) & LO4) | (((wh >> hs) & 0x03030303u) << 4);
        q[i] = (v + 0x60606060u) ^ 0x80808080u;
    }
}
#endif
#endif  // LOAD_UNIT
