// hmad: zero an (m, n) output tile before a GEMM accumulates K steps into it.
// Built by build.py with -DDIM_M/-DDIM_N (the GEMM's m, n) and linked beside mlir-aie's mm.cc.
// NOT COMPILED OR RUN: written without the Peano toolchain or an NPU (see ../README.md).

#include <aie_api/aie.hpp>
#include <stdint.h>

template <typename T, int N>
static inline void zero_tile(T *__restrict c) {
  constexpr int lanes = 64 / sizeof(T);  // one 512-bit vector
  static_assert(N % lanes == 0, "tile size must be a whole number of vectors");
  const aie::vector<T, lanes> zeros = aie::zeros<T, lanes>();
  for (int i = 0; i < N; i += lanes) {
    aie::store_v(c + i, zeros);
  }
}

extern "C" {
void hmad_zero_i32(int32_t *c) { zero_tile<int32_t, DIM_M * DIM_N>(c); }
void hmad_zero_f32(float *c) { zero_tile<float, DIM_M * DIM_N>(c); }
}
