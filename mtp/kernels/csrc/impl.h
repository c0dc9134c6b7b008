// The kernels of one instruction path, written once against `V` (simd.h). paths_*.cpp include
// this file once per path, each inside its own namespace and `#pragma GCC target` region.
//
// Row invariance by construction: each (row, output) pair owns one accumulator vector that
// runs over K in the same chunk order, tail by a zero-filled load, then the same horizontal
// sum. Tiling (rows per tile, outputs per group) and the split over threads only choose which
// pairs run side by side, never the operations of a pair.

// Rows per tile and outputs per group: ROWS * COLS accumulators plus COLS weight vectors must
// fit the register file (32 zmm on avx512, 16 ymm on avx2).
#if MTP_ISA == MTP_AVX512
constexpr int ROWS = 4, COLS = 4;
#else
constexpr int ROWS = 4, COLS = 2;
#endif

// How a tile steps over K: x f32 against weights T converted to f32, one FMA per chunk of
// V::W. (bf16 weights on avx512 go by PairStep; bf16 x bf16 with AMX by amx.h.)
template <typename T>
struct FmaStep {
  using XT = float;
  using WT = T;
  using XV = V;
  using WV = V;
  static constexpr int CH = V::W;
  static int64_t ldx(int64_t K) { return K; }
  static XV loadx(const XT* p) { return V::load(p); }
  static XV loadx_n(const XT* p, int n) { return V::load_n(p, n); }
  static WV loadw(const WT* p) { return V::load(p); }
  static WV loadw_n(const WT* p, int n) { return V::load_n(p, n); }
  static V step(V acc, XV x, WV w) { return fma(x, w, acc); }
};

// Weight rows to prefetch ahead in the first row tile: one group on avx512. Measured on the
// SmolLM2 pass, 1 thread: float32 M=8 60-65 ms with it, 75-95 ms without; 8-16 rows ahead
// or non-temporal hints were slower.
constexpr int64_t PREFETCH_ROWS = 4;

// One tile: R rows of x (row stride K) against C weight rows, K long, by the step P.
template <int R, int C, typename P>
static void tile(const typename P::XT* x, const typename P::WT* w, const float* bias, int64_t K,
                 float* y, int64_t ldy, int64_t pf) {
  const int64_t ldx = P::ldx(K);
  V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::zero();
  int64_t k = 0;
  for (; k + P::CH <= K; k += P::CH) {
    typename P::WV wv[C];
    for (int c = 0; c < C; ++c) wv[c] = P::loadw(w + c * K + k);
    // Touch the weights PF rows ahead (the next groups) now: streaming them from memory then
    // overlaps this group's arithmetic. A hint only: no effect on any result.
    if (pf)
      for (int c = 0; c < C; ++c) __builtin_prefetch(w + (c + pf) * K + k + P::CH, 0, 3);
    for (int r = 0; r < R; ++r) {
      typename P::XV xv = P::loadx(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = P::step(acc[r][c], xv, wv[c]);
    }
  }
  if (k < K) {
    int n = static_cast<int>(K - k);
    typename P::WV wv[C];
    for (int c = 0; c < C; ++c) wv[c] = P::loadw_n(w + c * K + k, n);
    for (int r = 0; r < R; ++r) {
      typename P::XV xv = P::loadx_n(x + r * ldx + k, n);
      for (int c = 0; c < C; ++c) acc[r][c] = P::step(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      y[r * ldy + c] = acc[r][c].hsum() + (bias ? bias[c] : 0.0f);
}

// All row tiles of x against C weight rows (the C x K weights stay in L1 between tiles).
template <int C, typename P>
static void column_group(const typename P::XT* x, int64_t M, const typename P::WT* w,
                         const float* bias, int64_t K, float* y, int64_t N) {
  int64_t m = 0;
  const int64_t ldx = P::ldx(K);
  // Only the first row tile prefetches: the later ones find the weights in L1.
  for (; m + ROWS <= M; m += ROWS)
    tile<ROWS, C, P>(x + m * ldx, w, bias, K, y + m * N, N, m == 0 ? PREFETCH_ROWS : 0);
  int64_t pf = m == 0 ? PREFETCH_ROWS : 0;
  const typename P::XT* xm = x + m * ldx;
  float* ym = y + m * N;
  switch (M - m) {
    case 1: tile<1, C, P>(xm, w, bias, K, ym, N, pf); break;
    case 2: tile<2, C, P>(xm, w, bias, K, ym, N, pf); break;
    case 3: tile<3, C, P>(xm, w, bias, K, ym, N, pf); break;
    default: break;
  }
}

// The output columns [g0, g1) * COLS: full groups, then the last partial group.
template <typename P>
static void linear_groups(const typename P::XT* x, int64_t M, const typename P::WT* w,
                          const float* bias, int64_t K, float* y, int64_t N, int64_t g0,
                          int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t n = g * COLS;
    const float* b = bias ? bias + n : nullptr;
    int64_t cols = N - n < COLS ? N - n : COLS;
    if (cols == COLS) {
      column_group<COLS, P>(x, M, w + n * K, b, K, y + n, N);
    } else if (cols == 1) {
      column_group<1, P>(x, M, w + n * K, b, K, y + n, N);
#if MTP_ISA == MTP_AVX512
    } else if (cols == 2) {
      column_group<2, P>(x, M, w + n * K, b, K, y + n, N);
    } else {
      column_group<3, P>(x, M, w + n * K, b, K, y + n, N);
#endif
    }
  }
}

// y (M, N) f32 = x (M, K) @ w (N, K)^T + bias, split over threads by output groups only.
template <typename P>
static void linear_p(const typename P::XT* x, int64_t M, const typename P::WT* w,
                     const float* bias, int64_t K, float* y, int64_t N) {
  int64_t groups = (N + COLS - 1) / COLS;
  // Enough weights per thread chunk (~64K) that a small matrix is not split into slivers.
  int64_t grain = std::max<int64_t>(1, 65536 / (COLS * K));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    linear_groups<P>(x, M, w, bias, K, y, N, g0, g1);
  });
}

#if MTP_ISA == MTP_AVX512
// bf16 weights on avx512 by pairs: one 512-bit load holds 32 weights; its even elements
// become f32 by one shift, its odd ones by one mask (half the conversion work of widening 16
// at a time). x comes pre-arranged to match (pair_layout): per 32-chunk of K its 16 even then
// its 16 odd elements, K padded with zeros to a multiple of 32. Each (row, output) still runs
// one fixed sequence: even FMA, odd FMA, chunk after chunk.
struct PairStep {
  using XT = float;
  using WT = uint16_t;
  struct XV { V even, odd; };
  using WV = XV;
  static constexpr int CH = 32;
  static int64_t ldx(int64_t K) { return (K + 31) / 32 * 32; }
  static XV loadx(const XT* p) { return {V::load(p), V::load(p + 16)}; }
  static XV loadx_n(const XT* p, int) { return loadx(p); }  // zero padding is there
  static WV split(__m512i v) {
    return {{_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))},
            {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)))}};
  }
  static WV loadw(const WT* p) { return split(_mm512_loadu_si512(p)); }
  static WV loadw_n(const WT* p, int n) {
    return split(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1u), p));
  }
  static V step(V acc, XV x, WV w) { return fma(x.odd, w.odd, fma(x.even, w.even, acc)); }
};
constexpr int PAIR_LAYOUT = 1;
#else
constexpr int PAIR_LAYOUT = 0;
#endif

static void linear_f32(const float* x, int64_t M, const float* w, const float* bias, int64_t K,
                       float* y, int64_t N) {
  linear_p<FmaStep<float>>(x, M, w, bias, K, y, N);
}

static void linear_bf16(const float* x, int64_t M, const uint16_t* w, const float* bias,
                        int64_t K, float* y, int64_t N) {
#if MTP_ISA == MTP_AVX512
  linear_p<PairStep>(x, M, w, bias, K, y, N);
#else
  linear_p<FmaStep<uint16_t>>(x, M, w, bias, K, y, N);
#endif
}


// A full or a zero-filled partial chunk: the same lane values either way, a cheaper load.
template <typename T>
static inline V load_r(const T* p, int r) { return r == V::W ? V::load(p) : V::load_n(p, r); }

// dot(a, b) over n floats (a f32, b f32 or bf16): one accumulator, fixed chunks, fixed hsum.
template <typename T>
static float dot(const float* a, const T* b, int64_t n) {
  V acc = V::zero();
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) acc = fma(V::load(a + i), V::load(b + i), acc);
  if (i < n) {
    int r = static_cast<int>(n - i);
    acc = fma(V::load_n(a + i, r), V::load_n(b + i, r), acc);
  }
  return acc.hsum();
}

template <typename T>
static void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) V::load(src + i).store(dst + i);
  if (i < n) V::load_n(src + i, static_cast<int>(n - i)).store_n(dst + i, static_cast<int>(n - i));
}

// dot() of q with four keys at once: four independent chains (latency hidden), each one the
// very sequence dot() runs, so a key's score has the same bits either way.
template <typename T>
static void dot4(const float* q, const T* k, int64_t ksl, const int64_t* idx, int64_t hd,
                 float* out) {
  const T* kr[4] = {k + idx[0] * ksl, k + idx[1] * ksl, k + idx[2] * ksl, k + idx[3] * ksl};
  V acc[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
  int64_t i = 0;
  for (; i + V::W <= hd; i += V::W) {
    V qv = V::load(q + i);
    for (int t = 0; t < 4; ++t) acc[t] = fma(qv, V::load(kr[t] + i), acc[t]);
  }
  if (i < hd) {
    int r = static_cast<int>(hd - i);
    V qv = V::load_n(q + i, r);
    for (int t = 0; t < 4; ++t) acc[t] = fma(qv, V::load_n(kr[t] + i, r), acc[t]);
  }
  for (int t = 0; t < 4; ++t) out[t] = acc[t].hsum();
}

// out = sum_j w_j v_j / l over the NC chunks of hd at once (j in slot order in every lane: the
// same sums as one chunk at a time).
template <int NC, typename T>
static void weighted_sum(const float* w, const T* v, int64_t vsl, const int64_t* idx, int64_t n,
                         int64_t hd, float l, float* out) {
  V acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = V::zero();
  int last = static_cast<int>(hd - (NC - 1) * V::W);  // lanes of the last chunk
  for (int64_t j = 0; j < n; ++j) {
    V wj = V::set1(w[j]);
    const T* vr = v + idx[j] * vsl;
    for (int c = 0; c < NC; ++c)
      acc[c] = fma(wj, load_r(vr + c * V::W, c == NC - 1 ? last : V::W), acc[c]);
  }
  V lv = V::set1(l);
  for (int c = 0; c < NC; ++c) (acc[c] / lv).store_n(out + c * V::W, c == NC - 1 ? last : V::W);
}

// One query: softmax over its visible slots in increasing order, then the weighted sum of v.
template <typename T>
static void attend_one(const float* q, const T* k, const T* v, int64_t ksl, int64_t vsl,
                       const bool* mask, int64_t msl, int64_t L, int64_t hd, float scale,
                       float* out, std::vector<int64_t>& idx, std::vector<float>& s) {
  int64_t n = 0;
  for (int64_t l = 0; l < L; ++l)
    if (mask[l * msl]) idx[n++] = l;
  if (n == 0) {
    std::fill(out, out + hd, 0.0f);
    return;
  }
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) dot4(q, k, ksl, &idx[j], hd, &s[j]);
  for (; j < n; ++j) s[j] = dot(q, k + idx[j] * ksl, hd);
  float m = -std::numeric_limits<float>::infinity();
  for (j = 0; j < n; ++j) {
    s[j] *= scale;
    m = std::max(m, s[j]);
  }
  V mv = V::set1(m);
  for (j = 0; j + V::W <= n; j += V::W) vexp(V::load(s.data() + j) - mv).store(s.data() + j);
  if (j < n) {
    int r = static_cast<int>(n - j);
    vexp(V::load_n(s.data() + j, r) - mv).store_n(s.data() + j, r);
  }
  float l = 0.0f;
  for (j = 0; j < n; ++j) l += s[j];
  switch ((hd + V::W - 1) / V::W) {  // chunks of hd: their sums side by side
    case 1: weighted_sum<1>(s.data(), v, vsl, idx.data(), n, hd, l, out); break;
    case 2: weighted_sum<2>(s.data(), v, vsl, idx.data(), n, hd, l, out); break;
    case 4: weighted_sum<4>(s.data(), v, vsl, idx.data(), n, hd, l, out); break;
    case 8: weighted_sum<8>(s.data(), v, vsl, idx.data(), n, hd, l, out); break;
    default:
      for (int64_t d = 0; d < hd; d += V::W) {
        int r = hd - d < V::W ? static_cast<int>(hd - d) : V::W;
        V acc = V::zero();
        for (j = 0; j < n; ++j) acc = fma(V::set1(s[j]), load_r(v + idx[j] * vsl + d, r), acc);
        (acc / V::set1(l)).store_n(out + d, r);
      }
  }
}


template <typename T>
static void attention_t(const AttnArgs& a) {
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  float scale = 1.0f / std::sqrt(static_cast<float>(a.hd));
  int64_t group = a.H / a.KV;
  at::parallel_for(0, a.B * a.H * a.T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> idx(a.L);
    std::vector<float> s(a.L), qf(a.hd);
    for (int64_t i = i0; i < i1; ++i) {
      int64_t b = i / (a.H * a.T), h = (i / a.T) % a.H, t = i % a.T, g = h / group;
      to_float(q + b * a.qs[0] + t * a.qs[1] + h * a.qs[2], qf.data(), a.hd);
      attend_one(qf.data(), k + b * a.ks[0] + g * a.ks[1], v + b * a.vs[0] + g * a.vs[1],
                 a.ks[2], a.vs[2], a.mask + b * a.ms[0] + t * a.ms[1], a.ms[2], a.L, a.hd,
                 scale, a.out + ((b * a.T + t) * a.H + h) * a.hd, idx, s);
    }
  });
}

static void attention_f32(const AttnArgs& a) { attention_t<float>(a); }
static void attention_bf16(const AttnArgs& a) { attention_t<uint16_t>(a); }

// Sum of squares of each row: the fixed reduction order that makes rms_norm row invariant.
template <typename T>
static float sum_squares(const T* x, int64_t n) {
  V acc = V::zero();
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) {
    V xv = V::load(x + i);
    acc = fma(xv, xv, acc);
  }
  if (i < n) {
    V xv = V::load_n(x + i, static_cast<int>(n - i));
    acc = fma(xv, xv, acc);
  }
  return acc.hsum();
}

static inline float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
static inline float as_float(float f) { return f; }
static inline float as_float(uint16_t b) { return bf16_to_float(b); }

// Round a float to bf16 (nearest even) and back, as torch's .to(bfloat16) does.
static inline float round_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return f;  // NaN stays NaN
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &bits, 4);
  return f;
}

// y = round_x(x * rsqrt(mean(x^2) + eps)) * w, in f32 (the caller rounds to the result dtype).
template <typename T, typename U>
static void rms_norm_t(const T* x, const U* w, int64_t M, int64_t D, float eps, float* y) {
  constexpr bool x_bf16 = std::is_same<T, uint16_t>::value;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)),
                   [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = x + m * D;
      float r = 1.0f / std::sqrt(sum_squares(xr, D) / static_cast<float>(D) + eps);
      for (int64_t d = 0; d < D; ++d) {
        float normed = as_float(xr[d]) * r;
        if (x_bf16) normed = round_bf16(normed);
        y[m * D + d] = normed * as_float(w[d]);
      }
    }
  });
}

static void rms_norm_any(const void* x, bool x_bf16, const void* w, bool w_bf16, int64_t M,
                         int64_t D, float eps, float* y) {
  const auto* x16 = static_cast<const uint16_t*>(x);
  const auto* x32 = static_cast<const float*>(x);
  const auto* w16 = static_cast<const uint16_t*>(w);
  const auto* w32 = static_cast<const float*>(w);
  if (x_bf16 && w_bf16) rms_norm_t(x16, w16, M, D, eps, y);
  else if (x_bf16) rms_norm_t(x16, w32, M, D, eps, y);
  else if (w_bf16) rms_norm_t(x32, w16, M, D, eps, y);
  else rms_norm_t(x32, w32, M, D, eps, y);
}

// y = round(silu(g)) * u over n elements; silu(g) = g / (1 + exp(-g)) by vexp on every lane.
template <typename T>
static void silu_mul_t(const T* g, const T* u, int64_t n, float* y) {
  constexpr bool bf16 = std::is_same<T, uint16_t>::value;
  constexpr int64_t block = 4096;
  at::parallel_for(0, (n + block - 1) / block, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t i0 = b * block, i1 = std::min(n, i0 + block);
      for (int64_t i = i0; i < i1; i += V::W) {
        int r = i1 - i < V::W ? static_cast<int>(i1 - i) : V::W;
        V gv = load_r(g + i, r);
        (gv / (V::set1(1.0f) + vexp(V::zero() - gv))).store_n(y + i, r);
      }
      for (int64_t i = i0; i < i1; ++i) {
        float s = bf16 ? round_bf16(y[i]) : y[i];
        y[i] = s * as_float(u[i]);
      }
    }
  });
}

static void silu_mul_any(const void* g, const void* u, bool bf16, int64_t n, float* y) {
  if (bf16) silu_mul_t(static_cast<const uint16_t*>(g), static_cast<const uint16_t*>(u), n, y);
  else silu_mul_t(static_cast<const float*>(g), static_cast<const float*>(u), n, y);
}

const Table table = {linear_f32, linear_bf16, PAIR_LAYOUT, attention_f32, attention_bf16,
                     rms_norm_any, silu_mul_any};  // external: declared in common.h
