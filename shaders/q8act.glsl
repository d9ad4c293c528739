// Activations quantized for the int8 mat-vec (ggml's q8_1 idea), per block of 32 values along K:
//   XQ  T rows of K/4 uint words; word i holds values 4i..4i+3 as int8, value 4i in the low byte, and is
//       stored at xq_word(i, K / 64) of its row (below);
//   XD  T rows of K/32 vec2 (d, s): value ~ d * q, and s = d * sum(q) over the block (for weight minimums).
// XQ's order within a row: K is cut into groups of 64 values (4 quarters of 16 values, a uvec4 each) and the
// row holds every group's quarter 0, then every group's quarter 1, ...: quarter j of group g is uvec4
// j * (K / 64) + g. The mat-vec's lanes take consecutive units (64 or 32 weights), so a warp's load of one
// quarter reads consecutive 16-byte words (in K order, lanes would read 16 bytes every 64: 4x the cache
// lines a load). Requires K % 64 == 0.
// d = max|x| / 127 and q = round(x / d), as ggml's quantize_row_q8_1.
// Three planes (the exact decode path, PLANES 3): XQ holds T x 3 rows of K/4 words (token t, plane p at row
// 3t + p): x = d * (q1 + q2 / 128 + q3 / 16384) + r, each plane rounding the rest of the one before
// (|q2|, |q3| <= 64: int8 never overflows; the plane scales are powers of two, so the dot products combine
// exactly) and |r| <= d / 32768 = max|x| * 2.4e-7: a few float32 roundings of the block's largest value.
// Its XD s is the block's float32 sum of x.
//
// sdot4(a, b): the dot product of two words read as 4 signed int8 each (OpSDot, SPV_KHR_integer_dot_product;
// declared through GL_EXT_spirv_intrinsics because the GLSL extension is newer than Debian's glslc). Needs the
// Vulkan 1.3 feature shaderIntegerDotProduct (lavapipe, RADV and NVIDIA have it).
#extension GL_EXT_spirv_intrinsics : require

spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot4_packed(int a, int b, spirv_literal int packed_vector_format);

int sdot4(uint a, uint b) {
    return sdot4_packed(int(a), int(b), 0);  // 0: PackedVectorFormat4x8Bit
}

// The int8 values of 4 values already divided by d (roundf: halves away from zero, as ggml), and their word.
ivec4 q8_round(vec4 r) {
    return ivec4(sign(r) * floor(abs(r) + 0.5));
}
uint q8_word(ivec4 q) {
    return uint(q.x & 0xFF) | (uint(q.y & 0xFF) << 8) | (uint(q.z & 0xFF) << 16) | (uint(q.w) << 24);
}

#ifndef PLANES
#define PLANES 1  // 3: the exact path's three planes
#endif

// Where word w (values 4w..4w+3) of an XQ row of `groups` = K / 64 groups is stored, in words from the row's
// start: quarter (w / 4) % 4 of group w / 16, word w % 4 of that quarter.
uint xq_word(uint w, uint groups) {
    return ((((w >> 2) & 3u) * groups + (w >> 4)) << 2) | (w & 3u);
}

// The three planes of 4 values (see the top): d the block's scale, id = 1 / d (0 for an all-zero block).
void q8x3_round(vec4 v, float d, float id, out ivec4 q1, out ivec4 q2, out ivec4 q3) {
    q1 = q8_round(v * id);
    const vec4 r1 = v - d * vec4(q1);
    q2 = q8_round(r1 * (128.0 * id));
    const vec4 r2 = r1 - (d * (1.0 / 128.0)) * vec4(q2);
    q3 = q8_round(r2 * (16384.0 * id));
}

// 4 values of a block as XQ words, one per plane (word p goes to XQ row PLANES * t + p of token t); returns
// their share of the block's XD s: sum(q) for one plane (exact in float), sum(x) for three.
float q8_words(vec4 v, float d, float id, out uint w[PLANES]) {
#if PLANES == 3
    ivec4 q1, q2, q3;
    q8x3_round(v, d, id, q1, q2, q3);
    w[0] = q8_word(q1);
    w[1] = q8_word(q2);
    w[2] = q8_word(q3);
    return (v.x + v.y) + (v.z + v.w);
#else
    const ivec4 q = q8_round(v * id);
    w[0] = q8_word(q);
    return float(q.x + q.y + q.z + q.w);
#endif
}

// The XD entry (d, s) of a block whose words' shares (q8_words) add up to sum.
vec2 q8_block_ds(float d, float sum) {
    return vec2(d, PLANES == 3 ? sum : d * sum);
}
