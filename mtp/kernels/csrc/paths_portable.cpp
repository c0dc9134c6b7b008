// The portable instruction path: impl.h compiled for it (a file of its own, so the
// builder compiles the paths in parallel).
#include "common.h"

namespace mtp_kernels {
namespace portable {
#define MTP_ISA MTP_PORTABLE
#include "simd.h"
#include "impl.h"
#undef MTP_ISA
}  // namespace portable
}  // namespace mtp_kernels
