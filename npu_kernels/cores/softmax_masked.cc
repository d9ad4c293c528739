// hmad: masked softmax of one row of attention scores.
//
//   p[j] = exp(s[j] - max) / sum over lo <= j < hi of exp(s[j] - max)   for lo <= j < hi
//   p[j] = 0                                                            elsewhere
//   with max = the largest s[j] over lo <= j < hi; lim = {lo, hi}; len a multiple of 16.
//
// Correctness first: max, masking, sum and scaling are scalar loops; only exp is vectorised, with the
// primitives mlir-aie's own softmax kernels use: the bf16 lookup-table exp of aie_runtime_lib/AIE2
// (getExpBf16, linked from lut_based_ops.cpp) on AIE2 (npu1), aie::exp2 on AIE2P (npu2).
// NOT COMPILED OR RUN: written without the Peano toolchain or an NPU (see ../README.md).

#include <aie_api/aie.hpp>
#include <stdint.h>

#if defined(HMAD_AIE2)
#include <lut_based_ops.h>
#endif

constexpr int VL = 16;
constexpr float MASKED = -100.0f;  // exp(-100) ~ 4e-44: lanes outside [lo, hi) are zeroed afterwards

static inline aie::vector<bfloat16, VL> exp_bf16(aie::vector<bfloat16, VL> x) {
#if defined(HMAD_AIE2)
  return to_v16bfloat16(getExpBf16(x));
#else
  const aie::vector<bfloat16, VL> log2e = aie::broadcast<bfloat16, VL>((bfloat16)1.4453125f);
  aie::accum<accfloat, VL> scaled = aie::mul(x, log2e);
  return aie::exp2<bfloat16>(scaled.to_vector<float>());
#endif
}

extern "C" {

void hmad_softmax_masked(const float *__restrict s, const int32_t *__restrict lim, bfloat16 *__restrict p,
                         const int32_t len) {
  const int32_t lo = lim[0] < 0 ? 0 : lim[0];
  const int32_t hi = lim[1] > len ? len : lim[1];
  float mx = -3.0e38f;
  for (int32_t j = lo; j < hi; j++) {
    mx = s[j] > mx ? s[j] : mx;
  }
  alignas(32) bfloat16 shifted[VL];
  for (int32_t j0 = 0; j0 < len; j0 += VL) {
    for (int32_t l = 0; l < VL; l++) {
      const int32_t j = j0 + l;
      shifted[l] = (bfloat16)((j >= lo && j < hi) ? s[j] - mx : MASKED);
    }
    aie::store_v(p + j0, exp_bf16(aie::load_v<VL>(shifted)));
  }
  float sum = 0.0f;
  for (int32_t j = 0; j < len; j++) {
    if (j >= lo && j < hi) {
      sum += (float)p[j];
    } else {
      p[j] = (bfloat16)0.0f;
    }
  }
  const float inv = sum > 0.0f ? aie::inv(sum) : 0.0f;
  for (int32_t j = lo; j < hi; j++) {
    p[j] = (bfloat16)((float)p[j] * inv);
  }
}

}  // extern "C"
