// What the kernel files share: includes, the path numbering, the attention arguments and the
// table of one instruction path's entry points (one table per path, in paths_*.cpp).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#define MTP_PORTABLE 0
#define MTP_AVX2 1
#define MTP_AVX512 2

namespace mtp_kernels {

// One attention call: pointers and the element strides of the leading dims.
struct AttnArgs {
  const void *q, *k, *v;
  const bool* mask;
  float* out;
  int64_t B, T, H, KV, L, hd;
  int64_t qs[3], ks[3], vs[3], ms[3];  // strides (elements) of the leading dims
};

// The entry points of one instruction path.
struct Table {
  void (*linear_f32)(const float*, int64_t, const float*, const float*, int64_t, float*, int64_t);
  void (*linear_bf16)(const float*, int64_t, const uint16_t*, const float*, int64_t, float*,
                      int64_t);
  // 1: linear_bf16 takes x in the pair layout (impl.h, PairStep), rows of K rounded up to 32
  int pair_layout;
  void (*attention_f32)(const AttnArgs&);
  void (*attention_bf16)(const AttnArgs&);
  void (*rms_norm)(const void*, bool, const void*, bool, int64_t, int64_t, float, float*);
  void (*silu_mul)(const void*, const void*, bool, int64_t, float*);
};

// Each path's table (paths_portable.cpp, paths_avx2.cpp, paths_avx512.cpp).
namespace portable { extern const Table table; }
#if defined(__x86_64__)
namespace avx2 { extern const Table table; }
namespace avx512 { extern const Table table; }
namespace avx512_bf16 { extern const Table table; }
namespace amx {
// (N, K) bf16 -> AMX tile layout; y (M, N) = xp (zero padded 16-row tiles, Kp) @ packed^T.
void pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* out);
void linear(const uint16_t* xp, int64_t M, const uint16_t* packed, const float* bias, int64_t N,
            int64_t Kp, float* y);
}  // namespace amx
#endif

}  // namespace mtp_kernels
