// bf16 x bf16 linear on AMX tiles (avx512_bf16 path, CPUs with AMX-BF16; paths_avx512.cpp
// includes this inside an amx target region).
//
// Row invariance: every row goes through the same 16-row tile (x zero padded to whole tiles),
// its outputs accumulate over K in 32-wide blocks in a fixed order by TDPBF16PS, whose result
// for one row depends only on that row of A and on B. The weights are packed once (pack_amx)
// into the tile layout B wants: per 16 outputs and 32 inputs, 16 rows of 16 (even, odd) pairs.

namespace amx {

constexpr int TILE_ROWS = 16, TILE_N = 16, TILE_K = 32;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// (N, K) bf16 -> packed (ceil(N/16), ceil(K/32), 16, 16, 2), zero padded.
void pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  int64_t KB = (K + TILE_K - 1) / TILE_K, NB = (N + TILE_N - 1) / TILE_N;
  std::memset(out, 0, sizeof(uint16_t) * NB * KB * TILE_K * TILE_N);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      int64_t nb = n / TILE_N, kb = k / TILE_K, kk = k % TILE_K;
      out[((nb * KB + kb) * (TILE_K / 2) + kk / 2) * (2 * TILE_N) + (n % TILE_N) * 2 + kk % 2] =
          w[n * K + k];
    }
}

// The output blocks [nb0, nb1) for all row tiles of xp (Mp x Kp bf16, zero padded).
static void blocks(const uint16_t* xp, int64_t M, int64_t Mp, const uint16_t* packed,
                   const float* bias, int64_t N, int64_t Kp, float* y, int64_t nb0,
                   int64_t nb1) {
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = TILE_ROWS, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) float c[TILE_ROWS * TILE_N];
  int64_t KB = Kp / TILE_K;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const uint16_t* b = packed + nb * KB * TILE_K * TILE_N;
    int64_t n0 = nb * TILE_N, cols = std::min<int64_t>(TILE_N, N - n0);
    for (int64_t m0 = 0; m0 < Mp; m0 += TILE_ROWS) {
      _tile_zero(0);
      for (int64_t kb = 0; kb < KB; ++kb) {
        _tile_loadd(1, xp + m0 * Kp + kb * TILE_K, Kp * 2);
        _tile_loadd(2, b + kb * TILE_K * TILE_N, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, c, 64);
      int64_t rows = std::min<int64_t>(TILE_ROWS, M - m0);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j)
          y[(m0 + r) * N + n0 + j] = c[r * TILE_N + j] + (bias ? bias[n0 + j] : 0.0f);
    }
  }
  _tile_release();
}

void linear(const uint16_t* xp, int64_t M, const uint16_t* packed, const float* bias,
                   int64_t N, int64_t Kp, float* y) {
  int64_t NB = (N + TILE_N - 1) / TILE_N, Mp = (M + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
  int64_t grain = std::max<int64_t>(1, 32768 / (TILE_N * Kp));
  at::parallel_for(0, NB, grain, [&](int64_t nb0, int64_t nb1) {
    blocks(xp, M, Mp, packed, bias, N, Kp, y, nb0, nb1);
  });
}

}  // namespace amx
