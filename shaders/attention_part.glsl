// Pass 1 of the split-K decode attention (attention_split.comp, attention_decode.comp,
// attention_decode_kl.comp; attention_reduce.comp is pass 2): a workgroup's key range and its partial output
// (m, l, acc[Dh] per token, head and split, at part_base). Include after the Push block, meta[] and part[],
// and after paged_kv.glsl.

const uint NONE = 0xFFFFFFFFu;
#define NEG_INF uintBitsToFloat(0xFF800000u)

// A partial is (m, l, two words of padding, acc[Dh]): acc starts 16-byte aligned, so pass 2 reads it as vec4.
#define PART_ACC 4u

// Word offset in part[] of the partial of token t, query head h, split c.
uint part_base(uint t, uint h, uint c) {
    return ((t * p.n_heads + h) * p.n_splits + c) * (p.head_dim + PART_ACC);
}

// Keys [c0, c1) of split c for token t (per = max(ceil(len / n_splits), min_per) keys a split, from the window's
// first key to the last key the row sees: its position, or its visible entry, paged_kv.glsl's last_key), and
// the sequence's block table meta[tab ..], tab_len entries. c0 >= c1: an empty split or a padding row.
void split_keys(uint t, uint c, uint min_per, out uint c0, out uint c1, out uint tab, out uint tab_len) {
    c0 = 1u, c1 = 0u, tab = 0u, tab_len = 1u;
    const uint seq = meta[p.seq_off + t];
    if (seq == NONE) return;
    const uint pos = meta[p.pos_off + t];
    const uint lo = window_lo(pos, p.window), hi = last_key(p.vis_off, t, pos) + 1u;
    const uint per = max((hi - lo + p.n_splits - 1u) / p.n_splits, min_per);
    c0 = lo + c * per;
    c1 = min(c0 + per, hi);
    tab = meta[p.info_off + 2u * seq];
    tab_len = meta[p.info_off + 2u * seq + 1u];
}

// Whether row t is a prefill tile row (attention_prefill.comp writes its partials).
bool tiled_row(uint t) {
    return p.skip_off != 0u && meta[p.skip_off + t] != 0u;
}

// The partial of an empty split or a padding row, m = -inf and l = 0 (pass 2 gives it no weight); by the
// invocations tid < G of the workgroup, one per query head h0 + tid.
void write_empty_partial(uint t, uint h0, uint c, uint G, uint tid) {
    if (tid < G) {
        const uint pb = part_base(t, h0 + tid, c);
        part[pb] = NEG_INF;
        part[pb + 1u] = 0.0;
    }
}
