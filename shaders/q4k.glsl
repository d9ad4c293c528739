// Q4_K's packed scales, shared by the decoders that read a block's 16-byte header as one uvec4
// (dq_int8.glsl, mul_mm_coopmat.comp): header .x = d | dmin (float16 each), .yzw = the 12 scale bytes.
#ifndef Q4K_GLSL
#define Q4K_GLSL
// 6-bit (sc, m) of sub-block j from the scale words s (= header .yzw): bytes 0-3 sc 0-3 (low 6 bits), 4-7
// m 0-3, 8-11 low/high nibbles sc/m 4-7 with the top bits of bytes 0-7.
// Shifts by a variable amount only: a variable index into a vector would go through local memory.
uint q4k_byte(uint w, uint n) { return (w >> (8u * n)) & 0xFFu; }
uvec2 q4k_scale_min(uvec3 s, uint j) {
    if (j < 4u) return uvec2(q4k_byte(s.x, j) & 63u, q4k_byte(s.y, j) & 63u);
    const uint hi4 = q4k_byte(s.z, j - 4u);
    return uvec2((hi4 & 0xFu) | ((q4k_byte(s.x, j - 4u) >> 6) << 4), (hi4 >> 4) | ((q4k_byte(s.y, j - 4u) >> 6) << 4));
}
#endif
