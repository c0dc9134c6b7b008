// One SIMD vector of floats for the instruction path selected by MTP_ISA (included once per
// path, inside that path's namespace and `#pragma GCC target` region by paths_*.cpp). The
// operators are free functions after each struct: GCC does not give in-class friend
// definitions the target of their region.
//
// Every kernel is written against this struct only, so each path runs the same sequence of
// operations for every (row, output) pair: the bits of a result never depend on where it sits.
// Tails go through `load_n`, which zero-fills the missing lanes: the same vector code runs on
// them as on full chunks (no scalar remainder loop with different rounding).

#if MTP_ISA != MTP_PORTABLE
// Fixed tree: halves, then quarters, ... (the same shuffle sequence on every call).
inline float hsum256(__m256 v) {
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
#endif

#if MTP_ISA == MTP_AVX512
// The width's intrinsics: MTP_PS(add) = _mm512_add_ps, MTP_SI(add) = _mm512_add_epi32.
#define MTP_PS(OP) _mm512_##OP##_ps
#define MTP_SI(OP) _mm512_##OP##_epi32
#define MTP_SI_AS_PS _mm512_castsi512_ps

struct V {
  static constexpr int W = 16;
  __m512 v;
  static V zero() { return {MTP_PS(setzero)()}; }
  static V set1(float a) { return {MTP_PS(set1)(a)}; }
  static V load(const float* p) { return {MTP_PS(loadu)(p)}; }
  static V load(const uint16_t* p) {
    // bf16 -> f32 is exact: the 16 bits become the top half of the float.
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static V load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(mask(n), p)}; }
  static V load_n(const uint16_t* p, int n) {
    __m256i h = _mm256_maskz_loadu_epi16(mask(n), p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  void store(float* p) const { MTP_PS(storeu)(p, v); }
  void store_n(float* p, int n) const { _mm512_mask_storeu_ps(p, mask(n), v); }
  float hsum() const {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return hsum256(a);
  }
};

inline V vround(V a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}

#elif MTP_ISA == MTP_AVX2
#define MTP_PS(OP) _mm256_##OP##_ps
#define MTP_SI(OP) _mm256_##OP##_epi32
#define MTP_SI_AS_PS _mm256_castsi256_ps

struct V {
  static constexpr int W = 8;
  __m256 v;
  static V zero() { return {MTP_PS(setzero)()}; }
  static V set1(float a) { return {MTP_PS(set1)(a)}; }
  static V load(const float* p) { return {MTP_PS(loadu)(p)}; }
  static V load(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
  }
  template <typename T> static V load_n(const T* p, int n) {
    T buf[W] = {};  // zero-filled lanes past n, then the full-width load
    std::memcpy(buf, p, sizeof(T) * n);
    return load(buf);
  }
  void store(float* p) const { MTP_PS(storeu)(p, v); }
  void store_n(float* p, int n) const {
    float buf[W];
    store(buf);
    std::memcpy(p, buf, sizeof(float) * n);
  }
  float hsum() const { return hsum256(v); }
};

inline V vround(V a) {
  return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}

#else  // portable: plain loops over 8 lanes that the compiler vectorises (any CPU, ARM too)

struct V {
  static constexpr int W = 8;
  float v[W];
  static V zero() { return set1(0.0f); }
  static V set1(float a) {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = a;
    return r;
  }
  static V load(const float* p) {
    V r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static V load(const uint16_t* p) {
    V r;
    for (int i = 0; i < W; ++i) {
      uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
      std::memcpy(&r.v[i], &bits, 4);
    }
    return r;
  }
  template <typename T> static V load_n(const T* p, int n) {
    T buf[W] = {};
    std::memcpy(buf, p, sizeof(T) * n);
    return load(buf);
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  void store_n(float* p, int n) const { std::memcpy(p, v, sizeof(float) * n); }
  // No fused multiply-add here: -ffp-contract=off keeps a*b+c two roundings on every CPU.
  float hsum() const {
    float h[W / 2];
    for (int i = 0; i < W / 2; ++i) h[i] = v[i] + v[i + W / 2];
    float q0 = h[0] + h[2], q1 = h[1] + h[3];
    return q0 + q1;
  }
};

inline V fma(V a, V b, V c) {
  V r;
  for (int i = 0; i < V::W; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
  return r;
}
#define MTP_LANEWISE(NAME, EXPR)                      \
inline V NAME(V a, V b) {                           \
  V r;                                              \
  for (int i = 0; i < V::W; ++i) r.v[i] = (EXPR);      \
  return r;                                         \
}
MTP_LANEWISE(operator+, a.v[i] + b.v[i])
MTP_LANEWISE(operator-, a.v[i] - b.v[i])
MTP_LANEWISE(operator*, a.v[i] * b.v[i])
MTP_LANEWISE(operator/, a.v[i] / b.v[i])
MTP_LANEWISE(vmax, a.v[i] > b.v[i] ? a.v[i] : b.v[i])
MTP_LANEWISE(vmin, a.v[i] < b.v[i] ? a.v[i] : b.v[i])
#undef MTP_LANEWISE
inline V vround(V a) {
  V r;
  for (int i = 0; i < V::W; ++i) r.v[i] = std::nearbyint(a.v[i]);
  return r;
}
inline V pow2i(V n) {
  V r;
  for (int i = 0; i < V::W; ++i) {
    uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.v[i]) + 127) << 23;
    std::memcpy(&r.v[i], &bits, 4);
  }
  return r;
}

#endif

#if MTP_ISA == MTP_AVX512 || MTP_ISA == MTP_AVX2
// The lane-wise operations, written once for both x86 widths.
inline V fma(V a, V b, V c) { return {MTP_PS(fmadd)(a.v, b.v, c.v)}; }
inline V operator+(V a, V b) { return {MTP_PS(add)(a.v, b.v)}; }
inline V operator-(V a, V b) { return {MTP_PS(sub)(a.v, b.v)}; }
inline V operator*(V a, V b) { return {MTP_PS(mul)(a.v, b.v)}; }
inline V operator/(V a, V b) { return {MTP_PS(div)(a.v, b.v)}; }
inline V vmax(V a, V b) { return {MTP_PS(max)(a.v, b.v)}; }
inline V vmin(V a, V b) { return {MTP_PS(min)(a.v, b.v)}; }
// 2^n for integral n in [-126, 127], built in the exponent field.
inline V pow2i(V n) {
  auto e = MTP_SI(add)(MTP_SI(cvtps)(n.v), MTP_SI(set1)(127));
  return {MTP_SI_AS_PS(MTP_SI(slli)(e, 23))};
}
#undef MTP_PS  // simd.h is included once per path in one file
#undef MTP_SI
#undef MTP_SI_AS_PS
#endif

// exp(x) for every lane by the same code: Cody-Waite range reduction and a degree-6
// polynomial (Cephes' expf), about 1 ulp; inputs clamped to the finite range of float.
static inline V vexp(V x) {
  x = vmin(vmax(x, V::set1(-87.3f)), V::set1(88.3f));
  V n = vround(x * V::set1(1.44269504088896341f));
  V r = x - n * V::set1(0.693359375f);
  r = r - n * V::set1(-2.12194440e-4f);
  V p = V::set1(1.9875691500e-4f);
  p = fma(p, r, V::set1(1.3981999507e-3f));
  p = fma(p, r, V::set1(8.3334519073e-3f));
  p = fma(p, r, V::set1(4.1665795894e-2f));
  p = fma(p, r, V::set1(1.6666665459e-1f));
  p = fma(p, r, V::set1(5.0000001201e-1f));
  p = fma(p, r * r, r + V::set1(1.0f));
  return p * pow2i(n);
}
