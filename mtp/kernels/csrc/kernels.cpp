// mtp's CPU decoding kernels: linear, attention, rms_norm and silu_mul, bitwise row invariant,
// compiled once per instruction path (paths_*.cpp) and chosen at run time; this file checks
// arguments, picks the path and registers the ops (see impl.h for the invariance).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "common.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mtp_kernels {

// Instruction paths, numbered as the Python side names them: 0 portable, 1 avx2, 2 avx512,
// 3 avx512_bf16.
static bool supported(int64_t isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case 0: return true;
    case 1: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case 2:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case 3: return supported(2) && __builtin_cpu_supports("avx512bf16");
    default: return false;
  }
#else
  return isa == 0;
#endif
}

static const Table& table_for(int64_t isa) {
  TORCH_CHECK_VALUE(supported(isa), "instruction path ", isa, " is not supported on this CPU");
#if defined(__x86_64__)
  if (isa == 3) return avx512_bf16::table;
  if (isa == 2) return avx512::table;
  if (isa == 1) return avx2::table;
#endif
  return portable::table;
}

static std::vector<int64_t> cpu_isas() {
  std::vector<int64_t> out;
  for (int64_t isa = 3; isa >= 0; --isa)
    if (supported(isa)) out.push_back(isa);
  return out;
}

static float bf16_bits(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// f32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN), as c10::BFloat16.
static uint16_t to_bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

// A value of the kernels' storage types (float, or bf16 bits) as float, and back (bf16:
// round to nearest even).
static float as_float(float x) { return x; }
static float as_float(uint16_t x) { return bf16_bits(x); }
template <typename T> static T from_float(float x);
template <> float from_float<float>(float x) { return x; }
template <> uint16_t from_float<uint16_t>(float x) { return to_bf16_bits(x); }

static void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && (t.scalar_type() == at::kFloat || is_bf16(t)),
                    what, " must be a CPU float32 or bfloat16 tensor, got ", t.scalar_type(),
                    " on ", t.device());
}

// The rows of x (M, K) as f32 in `buf`: plain rows, or the pair layout (PairStep in impl.h:
// per 32-chunk of K its 16 even then 16 odd elements, zero padded to a multiple of 32).
static const float* to_f32_rows(const at::Tensor& x, int pair_layout, std::vector<float>& buf) {
  int64_t M = x.size(0), K = x.size(1), ld = pair_layout ? (K + 31) / 32 * 32 : K;
  buf.assign(M * ld, 0.0f);
  bool x16 = is_bf16(x);
  const auto* p16 = static_cast<const uint16_t*>(x.data_ptr());
  const auto* p32 = static_cast<const float*>(x.data_ptr());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      int64_t j = k % 32, pos = pair_layout ? k - j + (j % 2 ? 16 : 0) + j / 2 : k;
      buf[m * ld + pos] = x16 ? bf16_bits(p16[m * K + k]) : p32[m * K + k];
    }
  return buf.data();
}

// Whether AMX-BF16 runs here: the CPU has it and Linux grants this process the tile state.
static bool amx_ready() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ready = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

// The weight (N, K) bf16 in AMX's tile layout (amx.h), or an empty tensor where AMX is not.
static at::Tensor pack_amx(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(is_bf16(weight) && weight.dim() == 2, "pack_amx: weight ",
                    weight.sizes(), " ", weight.scalar_type(), " is not 2-d bfloat16");
  if (!amx_ready()) return at::Tensor();
#if defined(__x86_64__)
  at::Tensor w = weight.contiguous();
  int64_t N = w.size(0), K = w.size(1);
  int64_t NB = (N + 15) / 16, KB = (K + 31) / 32;
  at::Tensor out = at::empty({NB * KB * 512}, w.options());
  amx::pack(static_cast<const uint16_t*>(w.data_ptr()), N, K,
            static_cast<uint16_t*>(out.data_ptr()));
  return out;
#else
  return at::Tensor();
#endif
}

// x (M, K) bf16 by AMX against the packed weight: x copied into zero padded 16-row tiles.
static void linear_amx(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                       float* y, int64_t N) {
#if defined(__x86_64__)
  int64_t M = x.size(0), K = x.size(1), Kp = (K + 31) / 32 * 32, Mp = (M + 15) / 16 * 16;
  TORCH_CHECK_VALUE(packed.numel() == (N + 15) / 16 * (Kp / 32) * 512,
                    "linear: packed weight of ", packed.numel(), " does not fit (", N, ", ", K,
                    ")");
  std::vector<uint16_t> xp(Mp * Kp, 0);
  const auto* src = static_cast<const uint16_t*>(x.data_ptr());
  for (int64_t m = 0; m < M; ++m) std::memcpy(&xp[m * Kp], src + m * K, 2 * K);
  amx::linear(xp.data(), M, static_cast<const uint16_t*>(packed.data_ptr()), bias, N, Kp, y);
#endif
}

// x (M, K) @ weight (N, K)^T + bias (N, f32) -> (M, N) in x's dtype.
static at::Tensor linear(const at::Tensor& x_in, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias, int64_t isa,
                         const c10::optional<at::Tensor>& packed) {
  check_float(x_in, "x");
  check_float(weight, "weight");
  TORCH_CHECK_VALUE(x_in.dim() == 2 && weight.dim() == 2 && x_in.size(1) == weight.size(1),
                    "linear: x ", x_in.sizes(), " does not match weight ", weight.sizes());
  TORCH_CHECK_VALUE(weight.is_contiguous(), "linear: weight must be contiguous");
  const Table& tab = table_for(isa);
  int64_t M = x_in.size(0), K = x_in.size(1), N = weight.size(0);
  at::Tensor x = x_in.contiguous();
  const float* b = nullptr;
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(at::kFloat).contiguous();
    TORCH_CHECK_VALUE(bf.dim() == 1 && bf.size(0) == N, "linear: bias ", bf.sizes(),
                      " does not match ", N, " outputs");
    b = bf.data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // Plain loops rather than ATen conversions: a decoding step makes hundreds of small calls,
  // and each ATen op costs microseconds. bf16 -> f32 is exact (no invariance at stake); the
  // one rounding of a bf16 result is round-to-nearest-even, as torch's.
  bool x16 = is_bf16(x), w16 = is_bf16(weight);
  const auto* wp = weight.data_ptr();
  std::vector<float> yb(x16 ? M * N : 0), xb;
  float* y = x16 ? yb.data() : out.data_ptr<float>();
  if (x16 && w16 && isa == 3 && packed.has_value() && packed->defined() && amx_ready()) {
    linear_amx(x, *packed, b, y, N);
  } else if (w16) {
    const float* xf = to_f32_rows(x, tab.pair_layout, xb);
    tab.linear_bf16(xf, M, static_cast<const uint16_t*>(wp), b, K, y, N);
  } else {
    const float* xf = x16 ? to_f32_rows(x, 0, xb) : x.data_ptr<float>();
    tab.linear_f32(xf, M, static_cast<const float*>(wp), b, K, y, N);
  }
  if (x16) {
    auto* o = static_cast<uint16_t*>(out.data_ptr());
    for (int64_t i = 0; i < M * N; ++i) o[i] = to_bf16_bits(y[i]);
  }
  return out;
}

// q (B, T, H, hd); k, v (B, KV, L, hd) with a contiguous last dim; mask (B, T, L) bool.
static at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& mask, int64_t isa) {
  check_float(q, "q");
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                    "attention: q, k, v dtypes differ: ", q.scalar_type(), ", ",
                    k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() &&
                        mask.dim() == 3 && q.size(0) == k.size(0) && q.size(3) == k.size(3),
                    "attention: shapes q ", q.sizes(), " k ", k.sizes(), " v ", v.sizes(),
                    " mask ", mask.sizes(), " do not fit");
  int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3);
  int64_t KV = k.size(1), L = k.size(2);
  TORCH_CHECK_VALUE(KV > 0 && H % KV == 0, "attention: ", H, " heads not a multiple of ", KV,
                    " kv heads");
  TORCH_CHECK_VALUE(mask.scalar_type() == at::kBool && mask.size(0) == B &&
                        mask.size(1) == T && mask.size(2) == L,
                    "attention: mask ", mask.sizes(), " ", mask.scalar_type(),
                    " is not bool (B, T, L) = (", B, ", ", T, ", ", L, ")");
  const Table& tab = table_for(isa);
  at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  at::Tensor out = at::empty({B, T, H, hd}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return out.to(q.scalar_type());
  AttnArgs a{qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), mask.data_ptr<bool>(),
             out.data_ptr<float>(), B, T, H, KV, L, hd,
             {qc.stride(0), qc.stride(1), qc.stride(2)},
             {kc.stride(0), kc.stride(1), kc.stride(2)},
             {vc.stride(0), vc.stride(1), vc.stride(2)},
             {mask.stride(0), mask.stride(1), mask.stride(2)}};
  if (is_bf16(q)) tab.attention_bf16(a);
  else tab.attention_f32(a);
  return out.to(q.scalar_type());
}

static at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps,
                           int64_t isa) {
  check_float(x_in, "x");
  check_float(w_in, "weight");
  TORCH_CHECK_VALUE(x_in.dim() >= 1 && w_in.dim() == 1 && w_in.size(0) == x_in.size(-1),
                    "rms_norm: x ", x_in.sizes(), " does not match weight ", w_in.sizes());
  const Table& tab = table_for(isa);
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  int64_t D = x.size(-1), M = D ? x.numel() / D : 0;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  if (M > 0)
    tab.rms_norm(x.data_ptr(), is_bf16(x), w.data_ptr(), is_bf16(w), M, D,
                 static_cast<float>(eps), y.data_ptr<float>());
  return y.to(c10::promoteTypes(x.scalar_type(), w.scalar_type()));
}

static at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up, int64_t isa) {
  check_float(gate, "gate");
  TORCH_CHECK_VALUE(up.scalar_type() == gate.scalar_type() && up.sizes() == gate.sizes(),
                    "silu_mul: up ", up.sizes(), " ", up.scalar_type(), " does not match gate ",
                    gate.sizes(), " ", gate.scalar_type());
  const Table& tab = table_for(isa);
  at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor y = at::empty(g.sizes(), g.options().dtype(at::kFloat));
  if (g.numel() > 0)
    tab.silu_mul(g.data_ptr(), u.data_ptr(), is_bf16(g), g.numel(), y.data_ptr<float>());
  return y.to(g.scalar_type());
}

// The rotary embedding of one (row, head) pair of x (hd values) into `out`, in torch's order
// (model.apply_rope: even * cos - odd * sin, even * sin + odd * cos, each product and sum
// rounded to float32, then once to the dtype), so the kernels rotate as torch does.
template <typename T>
static void rotate(const T* x, const float* cos, const float* sin, int64_t hd, T* out) {
  for (int64_t i = 0; i < hd / 2; ++i) {
    float even = as_float(x[2 * i]), odd = as_float(x[2 * i + 1]);
    float a = even * cos[i], b = odd * sin[i], c = even * sin[i], d = odd * cos[i];
    out[2 * i] = from_float<T>(a - b);
    out[2 * i + 1] = from_float<T>(c + d);
  }
}

// A decode step's keys and values into the cache and its queries rotated, in one call:
// q (B, T, H, hd), k, v (B, T, KV, hd) as projected; cos, sin (B, T, hd / 2) float32;
// key_cache, value_cache (B, KV, max_len, hd), written at `slots` (B, T) with k rotated and v.
// Returns q rotated (B, T, H, hd). Elementwise: a row's bits are the same in any call.
static at::Tensor rope_write(const at::Tensor& q_in, const at::Tensor& k_in,
                             const at::Tensor& v_in, const at::Tensor& cos_in,
                             const at::Tensor& sin_in, at::Tensor key_cache,
                             at::Tensor value_cache, const at::Tensor& slots_in) {
  check_float(q_in, "q");
  auto dtype = q_in.scalar_type();
  TORCH_CHECK_VALUE(k_in.scalar_type() == dtype && v_in.scalar_type() == dtype &&
                        key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
                    "rope_write: q, k, v and the caches must share one dtype, q is ", dtype);
  TORCH_CHECK_VALUE(q_in.dim() == 4 && k_in.dim() == 4 && v_in.sizes() == k_in.sizes() &&
                        key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
                    "rope_write: q ", q_in.sizes(), " k ", k_in.sizes(), " v ", v_in.sizes(),
                    " caches ", key_cache.sizes(), " do not fit");
  int64_t B = q_in.size(0), T = q_in.size(1), H = q_in.size(2), hd = q_in.size(3);
  int64_t KV = k_in.size(2), L = key_cache.size(2);
  TORCH_CHECK_VALUE(k_in.size(0) == B && k_in.size(1) == T && k_in.size(3) == hd &&
                        key_cache.size(0) == B && key_cache.size(1) == KV &&
                        key_cache.size(3) == hd && hd % 2 == 0,
                    "rope_write: q ", q_in.sizes(), " k ", k_in.sizes(), " caches ",
                    key_cache.sizes(), " do not fit");
  TORCH_CHECK_VALUE(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
                    "rope_write: the caches' last dim must be contiguous");
  at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK_VALUE(cos.numel() == B * T * hd / 2 && sin.numel() == cos.numel() &&
                        slots.numel() == B * T,
                    "rope_write: cos ", cos.sizes(), " sin ", sin.sizes(), " slots ",
                    slots.sizes(), " do not fit (B, T) = (", B, ", ", T, ")");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK_VALUE(0 <= sl[i] && sl[i] < L, "rope_write: slot ", sl[i], " is outside the ",
                      L, " of the cache");
  at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  auto run = [&](auto zero) {
    using T_ = decltype(zero);
    const T_ *qp = static_cast<const T_*>(q.data_ptr()), *kp = static_cast<const T_*>(k.data_ptr()),
             *vp = static_cast<const T_*>(v.data_ptr());
    T_ *op = static_cast<T_*>(out.data_ptr()), *kc = static_cast<T_*>(key_cache.data_ptr()),
       *vc = static_cast<T_*>(value_cache.data_ptr());
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    const int64_t* ks = key_cache.strides().data();
    const int64_t* vs = value_cache.strides().data();
    for (int64_t bt = 0; bt < B * T; ++bt) {
      int64_t b = bt / T, slot = sl[bt];
      const float *c = cp + bt * hd / 2, *s = sp + bt * hd / 2;
      for (int64_t h = 0; h < H; ++h)
        rotate(qp + (bt * H + h) * hd, c, s, hd, op + (bt * H + h) * hd);
      for (int64_t h = 0; h < KV; ++h) {
        rotate(kp + (bt * KV + h) * hd, c, s, hd, kc + b * ks[0] + h * ks[1] + slot * ks[2]);
        std::memcpy(vc + b * vs[0] + h * vs[1] + slot * vs[2], vp + (bt * KV + h) * hd,
                    hd * sizeof(T_));
      }
    }
  };
  if (is_bf16(q)) run(uint16_t{0});
  else run(0.0f);
  return out;
}

}  // namespace mtp_kernels

TORCH_LIBRARY(mtp_kernels, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, int isa, Tensor? packed=None) -> Tensor",
        &mtp_kernels::linear);
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, int isa) -> Tensor",
        &mtp_kernels::attention);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, int isa) -> Tensor",
        &mtp_kernels::rms_norm);
  m.def("silu_mul(Tensor gate, Tensor up, int isa) -> Tensor", &mtp_kernels::silu_mul);
  m.def("rope_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slots) -> Tensor", &mtp_kernels::rope_write);
  m.def("cpu_isas() -> int[]", &mtp_kernels::cpu_isas);
  m.def("amx_ready() -> bool", &mtp_kernels::amx_ready);
  m.def("pack_amx(Tensor weight) -> Tensor", &mtp_kernels::pack_amx);
}
