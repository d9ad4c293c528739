#version 450
// A pipelined step's input tokens, taken on the device from the step submitted before it (engine/scheduler.py,
// "Pipelining"): row t whose feed word f is not 0 gets the token that step's argmax wrote at ids[f - 1], in
// the step metadata's tokens section, before the forward pass reads it. An id outside the vocabulary (a row
// of only NaN gives 0xFFFFFFFF) becomes 0: the host fails that request when it reads the id.
#include "common.glsl"

layout(binding = 0) buffer M { uint meta[]; };
layout(binding = 1) readonly buffer I { uint ids[]; };

layout(push_constant) uniform Push {
    uint tokens_off;  // word offset of the tokens section (stepmeta.py)
    uint feed_off;    // word offset of the feed section
    uint max_tokens;  // the bucket's rows
    uint vocab;
} p;

void main() {
    const uint n = min(meta[0], p.max_tokens);  // header word 0: the step's tokens
    for (uint t = global_index(); t < n; t += grid_size()) {
        const uint f = meta[p.feed_off + t];
        if (f != 0u) {
            const uint id = ids[f - 1u];
            meta[p.tokens_off + t] = id < p.vocab ? id : 0u;
        }
    }
}
