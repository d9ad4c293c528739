// Input embeddings in the embedding gather (embed.comp, embed_dq.comp; their INPUT_EMBEDS variants): a row of
// y given as a float32 vector (an image's soft tokens) instead of its token's scaled table row. Include after
// the Push block (dim, y_stride, row_begin) and, with INPUT_EMBEDS, the Embeds and Y buffers.
#if defined(INPUT_EMBEDS)
// Row t's vector when its embed_src word src is set (1 + its index among the step's vectors, which start at
// row row0 of embeds[]), written by the dispatch of the table's first range only; returns whether row t is
// one (then the caller writes nothing more).
bool input_row(uint t, uint src, uint row0) {
    if (src == 0u) return false;
    if (p.row_begin != 0u) return true;  // another range's dispatch: the first one writes it
    const uint eo = (row0 + src - 1u) * p.dim, yo = t * p.y_stride;
    for (uint c = gl_LocalInvocationID.x; c < p.dim; c += BLOCK_SIZE) y[yo + c] = embeds[eo + c];
    return true;
}
#endif
