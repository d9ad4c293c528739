// The row scales of the cooperative-matrix GEMM's float16 operand (row_scale.comp, geglu_row_scale.comp,
// residual_norm.comp XHOUT): a row's scale is 1.0 while max_k |x[t, k]| <= LIMIT (2^14, headroom below
// float16's 65504), else the power of two 2^ceil(log2(max / LIMIT)); NaN or inf in the row give a NaN or inf
// scale. Within every 8 values xh holds k in the order 0,2,1,3,4,6,5,7: word w of a group is the pair
// (4 (w / 2) + w % 2, that + 2).
// ROW_SCALE_PARTS: only the functions of values (a shader with its own workgroup reduction); else also
// row_scale_of, which needs BLOCK_SIZE (a power of two) and the workgroup's invocations in one row.

const float LIMIT = 16384.0;

// max(m, a) for a >= 0, where a NaN sticks
float sticky_max(float m, float a) {
    return isnan(a) || a > m ? a : m;
}

// The scale of a row whose largest |value| is mx (sticky_max over the row)
float scale_of_max(float mx) {
    return mx <= LIMIT ? 1.0 : (isnan(mx) || isinf(mx) ? mx : exp2(ceil(log2(mx / LIMIT))));
}

// The first k of xh word i of a row (the second is k + 2)
uint xh_word_k(uint i) {
    const uint w = i % 4u;
    return 8u * (i / 4u) + 4u * (w / 2u) + w % 2u;
}

#ifndef ROW_SCALE_PARTS
shared float s_max[BLOCK_SIZE];
shared float s_scale;

// The row's scale from every invocation's max m (sticky_max over its values), returned to all invocations.
float row_scale_of(float m, uint tid) {
    s_max[tid] = m;
    barrier();
    [[unroll]] for (uint h = BLOCK_SIZE / 2; h > 0; h >>= 1) {
        if (tid < h) s_max[tid] = sticky_max(s_max[tid], s_max[tid + h]);
        barrier();
    }
    if (tid == 0) s_scale = scale_of_max(s_max[0]);
    barrier();
    return s_scale;
}
#endif
