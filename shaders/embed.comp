#version 450
// y[t, :] = table[ids[ids_off + t], :] * scale: token embedding rows (times Gemma's sqrt(D)), one workgroup per
// token. Variants by table type: float (default), TABLE_F16 (float16_t), TABLE_Q8_0 (the GGUF blocks as raw
// bytes: 32 weights in 34 bytes, d f16 then qs int8[32], w = d * q; a row is dim / 32 blocks).
// A table bigger than maxStorageBufferRange is bound in ranges of whole rows, one dispatch per range: rows
// [row_begin, row_begin + n_rows) are in this binding, and tokens outside them are left to the other dispatches.
// INPUT_EMBEDS (the _in variants: the forward pass's embedding): a row whose embed_src word (step metadata,
// src_off) is set takes instead, as it is (no scale), the float32 vector at row meta[row0_off] + src - 1 of
// the input embeddings (binding 3: an image's soft tokens, stepmeta.py), written by the table's first range's
// dispatch (row_begin 0); rows with embed_src 0 never read it.
#include "common.glsl"

layout(binding = 0) readonly buffer Ids { uint ids[]; };
#if defined(TABLE_Q8_0)
layout(binding = 1) readonly buffer Table { uint8_t tab[]; };
#elif defined(TABLE_F16)
layout(binding = 1) readonly buffer Table { float16_t tab[]; };
#else
layout(binding = 1) readonly buffer Table { float tab[]; };
#endif
layout(binding = 2) writeonly buffer Y { float y[]; };
#if defined(INPUT_EMBEDS)
layout(binding = 3) readonly buffer Embeds { float embeds[]; };
#endif

layout(push_constant) uniform Push {
    uint n_tokens;   // rows of y
    uint dim;        // D (a multiple of 32 for Q8_0)
    uint ids_off;    // index of token 0's id in ids (the step metadata's tokens section)
    uint row_begin;  // first table row in this binding
    uint n_rows;     // table rows in this binding
    uint y_stride;   // elements between rows of y
    float scale;
    uint src_off;    // INPUT_EMBEDS: the step metadata's embed_src section
    uint row0_off;   // ... and its header word embeds_row0
} p;

#include "input_embeds.glsl"

void main() {
    const uint t = group_index();
    if (t >= p.n_tokens) return;
#if defined(INPUT_EMBEDS)
    if (input_row(t, ids[p.src_off + t], ids[p.row0_off])) return;
#endif
    const uint id = ids[p.ids_off + t];
    if (id < p.row_begin || id - p.row_begin >= p.n_rows) return;
    const uint r = id - p.row_begin;
    const uint yo = t * p.y_stride;
    for (uint c = gl_LocalInvocationID.x; c < p.dim; c += BLOCK_SIZE) {
#if defined(TABLE_Q8_0)
        const uint b = (r * (p.dim / 32) + c / 32) * 34;
        const float d = unpackHalf2x16(uint(tab[b]) | (uint(tab[b + 1]) << 8)).x;
        int q = int(uint(tab[b + 2 + c % 32]));
        q -= (q & 128) << 1;  // sign-extend the int8
        const float w = d * float(q);
#else
        const float w = float(tab[r * p.dim + c]);
#endif
        y[yo + c] = w * p.scale;
    }
}
