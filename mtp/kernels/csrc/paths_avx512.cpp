// The avx512 and avx512_bf16 (with AMX) instruction paths: impl.h compiled for them (a file
// of their own, so the builder compiles the paths in parallel).
#include "common.h"

namespace mtp_kernels {
#if defined(__x86_64__)
namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#define MTP_ISA MTP_AVX512
#include "simd.h"
#include "impl.h"
#undef MTP_ISA
#pragma GCC pop_options
}  // namespace avx512

namespace avx512_bf16 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#define MTP_ISA MTP_AVX512
#include "simd.h"
#include "impl.h"
#undef MTP_ISA
#pragma GCC pop_options
}  // namespace avx512_bf16

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#include "amx.h"
#pragma GCC pop_options
#endif
}  // namespace mtp_kernels
