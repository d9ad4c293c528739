// Weight decoders of the matmul shaders: GGUF rows read as they lie in the file, block by block.
//
// One type per variant, chosen by a #define: TYPE_F32, TYPE_F16, TYPE_BF16, TYPE_Q8_0, TYPE_Q4_0, TYPE_Q5_0, TYPE_Q4_K,
// TYPE_Q6_K. Each declares the weight buffer (binding 0) with the widest element the type's block alignment
// allows, and defines
//   WSIZE                        bytes per element of that buffer (a row starts at element row*row_bytes/WSIZE);
//   dq8(rb, k, lo, hi)           weights k..k+7 (k % 8 == 0) of the row starting at element rb, as two vec4.
// Decoding follows ggml's dequantize_row_* (hmad/model/quants.py): the same products, possibly fused (FMA),
// so a weight may differ from numpy's by one float32 rounding. Multi-byte fields are little-endian.
// Needs storageBuffer16BitAccess (the 16-bit loads) and nothing else beyond Vulkan 1.2 core.
// With TEXEL_LOADS the weight is a storage texel buffer of the same elements (r16ui, r32ui, rgba32ui,
// rgba32f: the host views it in the format declared here) read with imageLoad: CPU implementations fetch
// texels for all their SIMD lanes at once (physical.texel_loads). The decoders read through W16 / W32 /
// WU4 / WF4 (element i of the buffer), so both forms decode alike.

// Byte n (0..3) of a 32-bit word / of a 16-bit element.
#define BYTE32(w, n) (((w) >> (8u * (n))) & 0xFFu)
#define HALF16(h) unpackHalf2x16(uint(h)).x

// The 16-bit element types' weight buffer (WSIZE 2), read through W16(i).
#if defined(TYPE_Q8_0) || defined(TYPE_Q4_0) || defined(TYPE_Q5_0) || defined(TYPE_Q6_K)
#ifdef TEXEL_LOADS
layout(binding = 0, r16ui) uniform readonly uimageBuffer w_img;
#define W16(i) imageLoad(w_img, int(i)).x
#else
layout(binding = 0) readonly buffer W { uint16_t w16[]; };
#define W16(i) uint(w16[i])
#endif
#endif

#if defined(TYPE_F32)
// F32: 4 bytes per weight; rows of K % 4 == 0 weights are whole vec4s.
#define WSIZE 16u
#ifdef TEXEL_LOADS
layout(binding = 0, rgba32f) uniform readonly imageBuffer w_img;
#define WF4(i) imageLoad(w_img, int(i))
#else
layout(binding = 0) readonly buffer W { vec4 wv[]; };
#define WF4(i) wv[i]
#endif
void dq8(uint rb, uint k, out vec4 lo, out vec4 hi) {
    lo = WF4(rb + k / 4u);
    hi = WF4(rb + k / 4u + 1u);
}

#elif defined(TYPE_F16) || defined(TYPE_BF16)
// F16 / BF16: 2 bytes per weight; 8 weights per uvec4 (rows of K % 8 == 0 weights).
// BF16 is the top half of an f32: w = uintBitsToFloat(bits << 16).
#define WSIZE 16u
#ifdef TEXEL_LOADS
layout(binding = 0, rgba32ui) uniform readonly uimageBuffer w_img;
#define WU4(i) imageLoad(w_img, int(i))
#else
layout(binding = 0) readonly buffer W { uvec4 wu[]; };
#define WU4(i) wu[i]
#endif
#ifdef TYPE_F16
vec2 unpack2(uint u) { return unpackHalf2x16(u); }
#else
vec2 unpack2(uint u) { return vec2(uintBitsToFloat(u << 16), uintBitsToFloat(u & 0xFFFF0000u)); }
#endif
void dq8(uint rb, uint k, out vec4 lo, out vec4 hi) {
    const uvec4 u = WU4(rb + k / 8u);
    lo = vec4(unpack2(u.x), unpack2(u.y));
    hi = vec4(unpack2(u.z), unpack2(u.w));
}

#elif defined(TYPE_Q8_0)
// Q8_0: 32 weights in 34 bytes: d f16, qs int8[32].   w = d * q
// 17 uint16 per block: [0] d, [1 + j/2] qs bytes j (low) and j+1 (high).
#define WSIZE 2u
void dq8(uint rb, uint k, out vec4 lo, out vec4 hi) {
    const uint b = rb + (k / 32u) * 17u;
    const uint q = b + 1u + (k % 32u) / 2u;
    const float d = HALF16(W16(b));
    float v[8];
    [[unroll]] for (uint i = 0; i < 4u; ++i) {
        const int h = int(W16(q + i));
        v[2u * i] = float(bitfieldExtract(h, 0, 8));
        v[2u * i + 1u] = float(bitfieldExtract(h, 8, 8));
    }
    lo = d * vec4(v[0], v[1], v[2], v[3]);
    hi = d * vec4(v[4], v[5], v[6], v[7]);
}

#elif defined(TYPE_Q4_0)
// Q4_0: 32 weights in 18 bytes: d f16, qs 16 (weight j in the low nibble of byte j, weight 16+j in the high
//       nibble).   w = d * (q - 8)
// 9 uint16 per block: [0] d, [1 + j/2] qs bytes j, j+1.
#define WSIZE 2u
void dq8(uint rb, uint k, out vec4 lo, out vec4 hi) {
    const uint b = rb + (k / 32u) * 9u;
    const uint j = k % 32u;
    const float d = HALF16(W16(b));
    const uint q = b + 1u + (j % 16u) / 2u;
    const uint shift = (j / 16u) * 4u;
    float v[8];
    [[unroll]] for (uint i = 0; i < 4u; ++i) {
        const uint h = W16(q + i) >> shift;
        v[2u * i] = float(int(h & 0xFu) - 8);
        v[2u * i + 1u] = float(int((h >> 8) & 0xFu) - 8);
    }
    lo = d * vec4(v[0], v[1], v[2], v[3]);
    hi = d * vec4(v[4], v[5], v[6], v[7]);
}

#elif defined(TYPE_Q5_0)
// Q5_0: 32 weights in 22 bytes: d f16, qh 4 (u32, bit j = 5th bit of weight j), qs 16 (weight j in the low
//       nibble of byte j, weight 16+j in the high nibble).   w = d * (q - 16)
// 11 uint16 per block: [0] d, [1..2] qh, [3 + j/2] qs bytes j, j+1.
#define WSIZE 2u
void dq8(uint rb, uint k, out vec4 lo, out vec4 hi) {
    const uint b = rb + (k / 32u) * 11u;
    const uint j = k % 32u;
    const float d = HALF16(W16(b));
    const uint qh = (W16(b + 1u) | (W16(b + 2u) << 16)) >> j;
    const uint q = b + 3u + (j % 16u) / 2u;
    const uint shift = (j / 16u) * 4u;
    float v[8];
    [[unroll]] for (uint i = 0; i < 4u; ++i) {
        const uint h = W16(q + i) >> shift;
        v[2u * i] = float(int((h & 0xFu) | (((qh >> (2u * i)) & 1u) << 4)) - 16);
        v[2u * i + 1u] = float(int(((h >> 8) & 0xFu) | (((qh >> (2u * i + 1u)) & 1u) << 4)) - 16);
    }
    lo = d * vec4(v[0], v[1], v[2], v[3]);
    hi = d * vec4(v[4], v[5], v[6], v[7]);
}

#elif defined(TYPE_Q4_K)
// Q4_K: 256 weights in 144 bytes: d f16, dmin f16, scales 12, qs 128. 8 sub-blocks of 32 weights.
//   scales (6 bits each): bytes 0-3 = scales 0-3 (low 6 bits; bits 6-7 = high bits of scales 4-7),
//   bytes 4-7 = mins 0-3 (same, for mins 4-7), bytes 8-11 = low nibble: scales 4-7, high nibble: mins 4-7.
//   qs: 32-byte chunk c holds sub-block 2c in the low nibbles and 2c+1 in the high nibbles.
//   w = d * sc[j] * q - dmin * m[j]
// 36 uint32 per block (144 % 4 == 0, so rows stay word-aligned): [0] d|dmin, [1..3] scales, [4..35] qs.
#define WSIZE 4u
#ifdef TEXEL_LOADS
layout(binding = 0, r32ui) uniform readonly uimageBuffer w_img;
#define W32(i) imageLoad(w_img, int(i)).x
#else
layout(binding = 0) readonly buffer W { uint w32[]; };
#define W32(i) w32[i]
#endif
uint q4k_scale_byte(uint b, uint n) { return BYTE32(W32(b + 1u + n / 4u), n % 4u); }
void dq8(uint rb, uint k, out vec4 lo, out vec4 hi) {
    const uint b = rb + (k / 256u) * 36u;
    const uint i = k % 256u;
    const uint j = i / 32u;  // sub-block
    const vec2 dm = unpackHalf2x16(W32(b));
    uint sc, m;
    if (j < 4u) {
        sc = q4k_scale_byte(b, j) & 63u;
        m = q4k_scale_byte(b, j + 4u) & 63u;
    } else {
        const uint hi4 = q4k_scale_byte(b, j + 4u);
        sc = (hi4 & 0xFu) | ((q4k_scale_byte(b, j - 4u) >> 6) << 4);
        m = (hi4 >> 4) | ((q4k_scale_byte(b, j) >> 6) << 4);
    }
    const float dl = dm.x * float(sc), ml = dm.y * float(m);
    const uint q = b + 4u + (i / 64u) * 8u + (i % 32u) / 4u;
    const uint shift = (j % 2u) * 4u;
    const uint w0 = W32(q) >> shift, w1 = W32(q + 1u) >> shift;
    const vec4 q0 = vec4(w0 & 0xFu, (w0 >> 8) & 0xFu, (w0 >> 16) & 0xFu, (w0 >> 24) & 0xFu);
    const vec4 q1 = vec4(w1 & 0xFu, (w1 >> 8) & 0xFu, (w1 >> 16) & 0xFu, (w1 >> 24) & 0xFu);
    lo = q0 * dl - ml;
    hi = q1 * dl - ml;
}

#elif defined(TYPE_Q6_K)
// Q6_K: 256 weights in 210 bytes: ql 128 (low 4 bits), qh 64 (high 2 bits), scales 16 int8, d f16.
//   Two halves of 128 weights; in half h, weight l (0..127) has its low bits in the nibble l/64 of
//   ql[64h + l%64] and its high bits at shift 2*(l/32) of qh[32h + l%32]. 16 sub-blocks of 16 weights.
//   w = d * sc[i/16] * (q - 32)
// 105 uint16 per block: [0..63] ql, [64..95] qh, [96..103] scales, [104] d.
#define WSIZE 2u
void dq8(uint rb, uint k, out vec4 lo, out vec4 hi) {
    const uint b = rb + (k / 256u) * 105u;
    const uint i = k % 256u;
    const uint h = i / 128u, l = i % 128u;
    const uint ql = b + (64u * h + l % 64u) / 2u, qh = b + 64u + (32u * h + l % 32u) / 2u;
    const uint lshift = (l / 64u) * 4u, hshift = (l / 32u) * 2u;
    const int sc = bitfieldExtract(int(W16(b + 96u + i / 32u)), int(((i / 16u) % 2u) * 8u), 8);
    const float dl = HALF16(W16(b + 104u)) * float(sc);
    float v[8];
    [[unroll]] for (uint e = 0; e < 4u; ++e) {
        const uint a = W16(ql + e) >> lshift, c = W16(qh + e) >> hshift;
        v[2u * e] = float(int((a & 0xFu) | ((c & 3u) << 4)) - 32);
        v[2u * e + 1u] = float(int(((a >> 8) & 0xFu) | (((c >> 8) & 3u) << 4)) - 32);
    }
    lo = dl * vec4(v[0], v[1], v[2], v[3]);
    hi = dl * vec4(v[4], v[5], v[6], v[7]);
}

#else
#error "define one of TYPE_F32, TYPE_F16, TYPE_BF16, TYPE_Q8_0, TYPE_Q4_0, TYPE_Q5_0, TYPE_Q4_K, TYPE_Q6_K"
#endif
