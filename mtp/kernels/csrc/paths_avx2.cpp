// The avx2 instruction path: impl.h compiled for it (a file of its own, so the
// builder compiles the paths in parallel).
#include "common.h"

namespace mtp_kernels {
#if defined(__x86_64__)
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define MTP_ISA MTP_AVX2
#include "simd.h"
#include "impl.h"
#undef MTP_ISA
#pragma GCC pop_options
}  // namespace avx2
#endif
}  // namespace mtp_kernels
