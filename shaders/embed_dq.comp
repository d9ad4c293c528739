#version 450
// y[t, :] = table[ids[ids_off + t], :] * scale for a table in a block-quantized GGUF type, read as it lies in
// the file through dequant.glsl's dq8 (TYPE_* define: 8 weights at a time), one workgroup per token. The same
// gather as embed.comp (which keeps the float and Q8_0 tables) without a float copy of the table: the 27B's
// 262144 x 5376 Q4_K embedding would be 2.8 GB of float16 made on the CPU at every load.
// A table bigger than maxStorageBufferRange is bound in ranges of whole rows, one dispatch per range: rows
// [row_begin, row_begin + n_rows) are in this binding, and tokens outside them are left to the other dispatches.
// Requires dim % 8 == 0 (every GGUF block type holds a multiple of 32 weights).
// INPUT_EMBEDS (the _in variants): rows with an embed_src word take the input embeddings (binding 3), as in
// embed.comp.
#include "common.glsl"
#include "dequant.glsl"

layout(binding = 1) readonly buffer Ids { uint ids[]; };
layout(binding = 2) writeonly buffer Y { float y[]; };
#if defined(INPUT_EMBEDS)
layout(binding = 3) readonly buffer Embeds { float embeds[]; };
#endif

layout(push_constant) uniform Push {
    uint n_tokens;   // rows of y
    uint dim;        // D
    uint ids_off;    // index of token 0's id in ids (the step metadata's tokens section)
    uint row_begin;  // first table row in this binding
    uint n_rows;     // table rows in this binding
    uint y_stride;   // elements between rows of y
    uint row_bytes;  // bytes of one table row in the file
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
    const uint rb = (id - p.row_begin) * (p.row_bytes / WSIZE);
    const uint yo = t * p.y_stride;
    for (uint k = 8u * gl_LocalInvocationID.x; k < p.dim; k += 8u * BLOCK_SIZE) {
        vec4 lo, hi;
        dq8(rb, k, lo, hi);
        lo *= p.scale;
        hi *= p.scale;
        [[unroll]] for (uint i = 0; i < 4u; ++i) {
            y[yo + k + i] = lo[i];
            y[yo + k + 4u + i] = hi[i];
        }
    }
}
