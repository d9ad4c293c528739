#version 450
// Write this step's k and v rows (T, Hkv, Dh) into one layer's paged KV pools (slots, Hkv, Dh):
// row t goes to slot meta[slot_off + t] (the step metadata's global or local slot section, see
// hmad/backends/vulkan/stepmeta.py); slot 0xFFFFFFFF (padding rows) writes nothing. Pool element type by
// POOL_TYPE (float, or float16_t for a float16 cache). Grid-stride over T * Hkv * Dh.
#include "common.glsl"
#ifndef POOL_TYPE
#define POOL_TYPE float
#endif

layout(binding = 0) readonly buffer K { float k[]; };
layout(binding = 1) readonly buffer V { float v[]; };
layout(binding = 2) readonly buffer Meta { uint meta[]; };
layout(binding = 3) writeonly buffer KP { POOL_TYPE k_pool[]; };
layout(binding = 4) writeonly buffer VP { POOL_TYPE v_pool[]; };

layout(push_constant) uniform Push {
    uint n_tokens;
    uint row;       // Hkv * Dh: elements per token, and per pool slot
    uint k_stride;  // elements between tokens of k
    uint v_stride;
    uint slot_off;  // index of token 0's slot in meta
} p;

void main() {
    const uint n = p.n_tokens * p.row;
    const uint stride = grid_size();
    for (uint i = global_index(); i < n; i += stride) {
        const uint t = i / p.row, c = i % p.row;
        const uint slot = meta[p.slot_off + t];
        if (slot == 0xFFFFFFFFu) continue;
        k_pool[slot * p.row + c] = POOL_TYPE(k[t * p.k_stride + c]);
        v_pool[slot * p.row + c] = POOL_TYPE(v[t * p.v_stride + c]);
    }
}
