// The paged KV cache as the step metadata describes it (hmad/backends/vulkan/stepmeta.py), shared by the
// attention kernels. Include after declaring the metadata buffer `meta[]`.

// Cache slot of key position j of a sequence whose block table starts at meta[tab] with tab_len entries:
// block table[(j / B) % tab_len], offset j % B (a global table covers every position; a local one is a ring).
uint kv_slot(uint tab, uint tab_len, uint j, uint B) {
    return meta[tab + (j / B) % tab_len] * B + j % B;
}

// First key position a query at pos attends to: 0 on a global layer (window 0), else max(0, pos - window + 1).
uint window_lo(uint pos, uint window) {
    return (window != 0 && pos + 1 > window) ? pos + 1 - window : 0;
}

// Last key position row t (at pos) sees: pos (causal), or, where the visible section vis_off (0: none) has an
// entry for the row, that entry - 1 (an image's soft tokens see their whole image: stepmeta.py).
uint last_key(uint vis_off, uint t, uint pos) {
    const uint v = vis_off != 0u ? meta[vis_off + t] : 0u;
    return v != 0u ? v - 1u : pos;
}
