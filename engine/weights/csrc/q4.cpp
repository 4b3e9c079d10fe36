// CPU products with the GGUF's quantised weights kept as stored (Q4_1 projections, Q8_0 LM head), AVX-512.
//
// Why hand-written: torch's int4 CPU kernel (aten._weight_int4pack_mm_for_cpu) rounds activations to bf16 and costs
// ~k times its 1-row time at k rows; torchao's int8-activation CPU kernel (da8w4) is not in its PyPI wheel; torch
// has no Q8_0 kernel. Every output row is computed independently, in the same order whatever the number of rows
// M or threads: a row's result never depends on the batch it is in (exact batching, engine/quant.py).
//
// Weight layout (engine/quant.py packs it): outputs in tiles of 4 rows, each tile one contiguous stream (the
// hardware prefetcher follows one stream per tile instead of 4 rows + scales); groups of 32 weights in pairs
// (g, g + 1), and per pair the tile's 4 rows side by side:
//   Q4: w [N/4, G/2, 4, 32] bytes, byte b = q_g[b] | q_{g+1}[b] << 4 (q in 0..15, w = d*q + m);
//   Q8: w [N/4, G/2, 4, 64] bytes, u = q + 128 in 0..255 (w = d*q = d*u - 128 d, i.e. m = -128 d).
//   Scales fp16 [N/4, G, 4] (d) or [N/4, G, 4, 2] (d, m).
//
//   *_f32: fp32 activations, weights dequantised in registers: the fp32 path's numbers up to summation order.
//          Calls of more rows dequantise each tile once into L1 (f32_unpack_tile) for all of them: the same numbers.
//   q4_bf16, q8_bf16: wide calls (AVX-512 BF16): tiles dequantised to bf16 once per call, bf16 activations (a dense
//          bf16 copy's numbers, from the quantised stream). On AMX-BF16 CPUs the same weights and rows go through
//          tile products (amx.cpp): fp32 sums in another order.
//   int8 activations (per row and 32-group, like llama.cpp's Q8_1; VNNI): wide_i8.cpp, on a 16-output interleave.
#include "q4.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <cstdint>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxGroups = 640;  // K <= 20480 (Qwen2.5-7B's MLP: 18944)
constexpr int64_t kGrain = 64;      // outputs per parallel task
constexpr int kTile = 4;            // outputs per tile (the weight layout's interleave)
constexpr int64_t kAhead = 1024;    // software prefetch distance in a tile's weight stream, bytes

inline void halves_to_float(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// ---- fp32 activations -------------------------------------------------------------------------------------------

// Both fp32 paths below dequantise with these, so a tile's weights are the same numbers in registers and in L1.
template <bool Q8>
inline void prefetch_pair(const uint8_t* wp) {
  _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead + 64), _MM_HINT_T0);
  if constexpr (Q8) {
    _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead + 192), _MM_HINT_T0);
  }
}

// Output j of a tile over the pair of groups (g, g + 1) as 4 vectors of fp32 weights: (g, 0..15), (g, 16..31),
// (g+1, 0..15), (g+1, 16..31). p: the pair's bytes of output j; s: the tile's scales as fp32, [g][j][S].
template <bool Q8>
inline void dequant_pair(const uint8_t* p, const float* s, int64_t g, int j, __m512* v) {
  if constexpr (Q8) {
    const __m512i bias = _mm512_set1_epi32(128);
    const __m512 d0 = _mm512_set1_ps(s[g * kTile + j]), d1 = _mm512_set1_ps(s[(g + 1) * kTile + j]);
    for (int c = 0; c < 4; ++c) {
      const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c)));
      v[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, bias)), c < 2 ? d0 : d1);
    }
  } else {
    const __m512i low = _mm512_set1_epi32(15);
    const float* s0 = s + (g * kTile + j) * 2;
    const float* s1 = s + ((g + 1) * kTile + j) * 2;
    const __m512 d0 = _mm512_set1_ps(s0[0]), m0 = _mm512_set1_ps(s0[1]);
    const __m512 d1 = _mm512_set1_ps(s1[0]), m1 = _mm512_set1_ps(s1[1]);
    for (int c = 0; c < 2; ++c) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c)));
      v[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), d0, m0);
      v[2 + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d1, m1);
    }
  }
}

// A tile's 4 outputs x MB rows; per pair of groups and output, 4 vectors of 16 weights.
template <bool Q8, int MB>
void f32_tile(const float* x, const uint8_t* w, const at::Half* sc, int64_t K, int64_t n0, float* y, int64_t ldy) {
  constexpr int NB = kTile, S = Q8 ? 1 : 2;  // S: fp16 scales per group and row
  const int64_t G = K / kGroup, pair_bytes = Q8 ? 64 : 32;
  const uint8_t* wt = w + (n0 / kTile) * kTile * G / 2 * pair_bytes;
  alignas(64) float s[kTile * S * kMaxGroups];  // [g][j][S]
  halves_to_float(sc + (n0 / kTile) * kTile * G * S, kTile * G * S, s);
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g += 2) {
    const uint8_t* wp = wt + (g / 2) * kTile * pair_bytes;
    prefetch_pair<Q8>(wp);
    __m512 v[NB][4];  // weights of (g, 0..15), (g, 16..31), (g+1, 0..15), (g+1, 16..31)
    for (int j = 0; j < NB; ++j) dequant_pair<Q8>(wp + j * pair_bytes, s, g, j, v[j]);
    for (int i = 0; i < MB; ++i) {
      const float* xr = x + i * K + g * kGroup;
      const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
      const __m512 x2 = _mm512_loadu_ps(xr + 32), x3 = _mm512_loadu_ps(xr + 48);
      for (int j = 0; j < NB; ++j) {
        acc[j][i] = _mm512_fmadd_ps(v[j][0], x0, acc[j][i]);
        acc[j][i] = _mm512_fmadd_ps(v[j][1], x1, acc[j][i]);
        acc[j][i] = _mm512_fmadd_ps(v[j][2], x2, acc[j][i]);
        acc[j][i] = _mm512_fmadd_ps(v[j][3], x3, acc[j][i]);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i) y[i * ldy + n0 + j] = _mm512_reduce_add_ps(acc[j][i]);
}

// Wide calls (more rows than one register chunk): a tile's weights are dequantised once per call into an L1 scratch
// of fp32 [G/2][4 outputs][4][16], with the same instructions as f32_tile, and every chunk of rows multiplies from
// it. Each (output, row) sees the same products in the same order as in f32_tile, so the results are bit-identical
// at every M (exact batching), but the dequantisation is paid once instead of once per 4 rows.
template <bool Q8>
void f32_unpack_tile(const uint8_t* w, const at::Half* sc, int64_t K, int64_t n0, float* buf) {
  constexpr int S = Q8 ? 1 : 2;
  const int64_t G = K / kGroup, pair_bytes = Q8 ? 64 : 32;
  const uint8_t* wt = w + (n0 / kTile) * kTile * G / 2 * pair_bytes;
  alignas(64) float s[kTile * S * kMaxGroups];
  halves_to_float(sc + (n0 / kTile) * kTile * G * S, kTile * G * S, s);
  for (int64_t g = 0; g < G; g += 2) {
    const uint8_t* wp = wt + (g / 2) * kTile * pair_bytes;
    prefetch_pair<Q8>(wp);
    for (int j = 0; j < kTile; ++j) {
      __m512 v[4];
      dequant_pair<Q8>(wp + j * pair_bytes, s, g, j, v);
      for (int c = 0; c < 4; ++c) _mm512_store_ps(buf + ((g / 2) * kTile + j) * 64 + 16 * c, v[c]);
    }
  }
}

template <int MB>
void f32_rows(const float* buf, const float* x, int64_t K, int64_t n0, float* y, int64_t ldy) {
  __m512 acc[kTile][MB];
  for (int j = 0; j < kTile; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / kGroup; g += 2) {
    const float* wp = buf + (g / 2) * kTile * 64;
    for (int c = 0; c < 4; ++c) {
      __m512 v[kTile];
      for (int j = 0; j < kTile; ++j) v[j] = _mm512_load_ps(wp + j * 64 + 16 * c);
      for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_loadu_ps(x + i * K + g * kGroup + 16 * c);
        for (int j = 0; j < kTile; ++j) acc[j][i] = _mm512_fmadd_ps(v[j], xv, acc[j][i]);
      }
    }
  }
  for (int j = 0; j < kTile; ++j)
    for (int i = 0; i < MB; ++i) y[i * ldy + n0 + j] = _mm512_reduce_add_ps(acc[j][i]);
}

// ---- bf16 activations (AVX-512 BF16), for wide calls -------------------------------------------------------------

// A tile's 4 rows are dequantised once per call into an L1 scratch as bf16 (w = d*q + m rounded once, from a 16-entry
// table per group: the same weights as a dense bf16 copy), then every row of x (rounded to bf16) is multiplied with
// vdpbf16ps, 32 multiply-adds per instruction, fp32 accumulation. It streams the 4-bit file instead of a dense bf16
// copy (3.5x fewer bytes) and has no per-group float work in the inner loop.
template <int MB>
__attribute__((target("avx512bf16"))) void bf16_rows(const uint16_t* wb, const uint16_t* xb, int64_t K, int64_t n0,
                                                      float* y, int64_t ldy) {
  __m512 acc[kTile][MB];
  for (int j = 0; j < kTile; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512i w[kTile];
    for (int j = 0; j < kTile; ++j) w[j] = _mm512_loadu_si512(wb + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_loadu_si512(xb + i * K + k);
      for (int j = 0; j < kTile; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], (__m512bh)w[j], (__m512bh)xv);
    }
  }
  for (int j = 0; j < kTile; ++j)
    for (int i = 0; i < MB; ++i) y[i * ldy + n0 + j] = _mm512_reduce_add_ps(acc[j][i]);
}

// Q4 (w, dm): w = d*q + m from a 16-entry table per group. Q8 (u, d): w = d*(u - 128), each weight converted (the
// head is read once per call, so its unpacking is amortised over the call's rows as well).
template <bool Q8>
__attribute__((target("avx512bf16"))) void bf16_unpack_tile(const uint8_t* w, const at::Half* sc, int64_t K, int64_t n0,
                                                             uint16_t* wb) {
  constexpr int S = Q8 ? 1 : 2;
  const int64_t G = K / kGroup, pair_bytes = Q8 ? 64 : 32;
  alignas(64) float s[kTile * S * kMaxGroups];
  halves_to_float(sc + (n0 / kTile) * kTile * G * S, kTile * G * S, s);
  const uint8_t* wt = w + (n0 / kTile) * kTile * (G / 2) * pair_bytes;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i low = _mm256_set1_epi8(15);
  const __m512i bias = _mm512_set1_epi32(128);
  for (int64_t g = 0; g < G; g += 2) {
    for (int j = 0; j < kTile; ++j) {
      const uint8_t* p = wt + ((g / 2) * kTile + j) * pair_bytes;
      if constexpr (Q8) {
        for (int h = 0; h < 2; ++h) {  // bytes 0..31: group g, 32..63: group g + 1
          const __m512 d = _mm512_set1_ps(s[(g + h) * kTile + j]);
          __m512 v[2];
          for (int c = 0; c < 2; ++c) {
            const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * h + 16 * c)));
            v[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, bias)), d);
          }
          _mm512_storeu_si512(wb + j * K + (g + h) * kGroup, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
        }
      } else {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i q[2] = {_mm256_and_si256(b, low), _mm256_and_si256(_mm256_srli_epi16(b, 4), low)};
        for (int h = 0; h < 2; ++h) {
          const float* sg = s + ((g + h) * kTile + j) * 2;
          const __m512 t = _mm512_fmadd_ps(iota, _mm512_set1_ps(sg[0]), _mm512_set1_ps(sg[1]));
          const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(t));
          _mm512_storeu_si512(wb + j * K + (g + h) * kGroup, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q[h]), table));
        }
      }
    }
  }
}

// ---- dispatch ------------------------------------------------------------------------------------------------------

// Rows go in chunks of up to kRows, outputs in tiles of 4: 16 accumulators (register budget), independent chains
// that hide FMA latency. Neither changes the order of one row's sums.
constexpr int64_t kRows = 4;

// tile(MB, m0, n0) for every 4-output block and, inside it, every chunk of up to kRows rows (the block's weights
// stay in L1 across the chunks).
template <typename Tile>
void over_outputs(int64_t M, int64_t N, const Tile& tile) {
  at::parallel_for(0, N / 4, kGrain / 4, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk)
      for (int64_t m0 = 0; m0 < M; m0 += kRows)
        with_rows<kRows>(std::min<int64_t>(kRows, M - m0), [&](auto MB) { tile(MB, m0, blk * kTile); });
  });
}

int64_t check(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& sc, bool q8, const char* what) {
  const int64_t K = q8 ? w.size(1) : w.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), what,
              ": x must be a contiguous fp32 [M, K]");
  TORCH_CHECK(x.size(1) == K, what, ": x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(K % (2 * kGroup) == 0 && K / kGroup <= kMaxGroups, what, ": K = ", K,
              " must be a multiple of 64, at most ", kGroup * kMaxGroups);
  TORCH_CHECK(w.size(0) % 4 == 0, what, ": output features must be a multiple of 4, got ", w.size(0));
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.is_contiguous() && sc.scalar_type() == torch::kHalf &&
                  sc.is_contiguous() && sc.numel() == w.size(0) * (K / kGroup) * (q8 ? 1 : 2),
              what, ": weights must be contiguous uint8 with fp16 scales");
  return K;
}

}  // namespace

torch::Tensor mm_f32(torch::Tensor x, torch::Tensor w, torch::Tensor sc, bool q8) {
  const int64_t K = check(x, w, sc, q8, q8 ? "q8_f32" : "q4_f32"), M = x.size(0), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* sp = sc.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  // Wide calls dequantise each tile once (f32_unpack_tile), then take all rows from L1. Measured per kernel
  // (bench kernels): 1.1-1.3x at 9-32 rows on the projections; on the Q8 head (DRAM-bound, 2 bytes per weight
  // more to unpack) it loses up to 8 rows, so there it starts above 8.
  if (M > (q8 ? 2 * kRows : kRows)) {
    at::parallel_for(0, N / kTile, kGrain / kTile, [&](int64_t b0, int64_t b1) {
      // a tile's weights as fp32: 16 KB at K = 1024 (in L1), 1.1 MB at K = 8960 (L2); on the heap, since a worker
      // thread's stack need not hold the largest
      std::unique_ptr<float, decltype(&std::free)> held(
          static_cast<float*>(std::aligned_alloc(64, kTile * kGroup * (K / kGroup) * sizeof(float))), &std::free);
      float* buf = held.get();
      for (int64_t blk = b0; blk < b1; ++blk) {
        if (q8) f32_unpack_tile<true>(wp, sp, K, blk * kTile, buf);
        else f32_unpack_tile<false>(wp, sp, K, blk * kTile, buf);
        for (int64_t m0 = 0; m0 < M; m0 += kRows)
          with_rows<kRows>(std::min<int64_t>(kRows, M - m0), [&](auto MB) {
            f32_rows<MB.value>(buf, xp + m0 * K, K, blk * kTile, yp + m0 * N, N);
          });
      }
    });
    return y;
  }
  auto tile = [&](auto MB, int64_t m0, int64_t n0) {
    if (q8) f32_tile<true, MB.value>(xp + m0 * K, wp, sp, K, n0, yp + m0 * N, N);
    else f32_tile<false, MB.value>(xp + m0 * K, wp, sp, K, n0, yp + m0 * N, N);
  };
  over_outputs(M, N, tile);
  return y;
}

__attribute__((target("avx512bf16"))) torch::Tensor bf16_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), Mp = (M + 15) / 16 * 16;
  auto xb = torch::empty({Mp, K}, x.options().dtype(torch::kBFloat16));
  const float* xp = x.data_ptr<float>();
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < M * K; i += 32)  // K is a multiple of 32
    _mm512_storeu_si512(xbp + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xp + i + 16), _mm512_loadu_ps(xp + i)));
  std::fill(xbp + M * K, xbp + Mp * K, uint16_t{0});
  return xb;
}

__attribute__((target("avx512bf16"))) torch::Tensor mm_bf16(torch::Tensor x, torch::Tensor w, torch::Tensor sc, bool q8,
                                                            torch::Tensor* rows) {
  const int64_t K = check(x, w, sc, q8, q8 ? "q8_bf16" : "q4_bf16"), M = x.size(0), N = w.size(0);
  auto xb = bf16_rows(x);
  if (rows != nullptr) *rows = xb;
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* sp = sc.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  if (amx_bf16_on()) {  // amx.cpp: the same bf16 weights and rows, fp32 sums in tiles; every row count
    std::unique_ptr<uint16_t[]> xt(new uint16_t[(M + 15) / 16 * 16 * K]);  // every element written, padding rows zero
    amx_bf16_rows(xbp, M, K, xt.get());
    at::parallel_for(0, (N + 31) / 32, kGrain / 32, [&](int64_t b0, int64_t b1) {
      std::vector<uint16_t> wb(32 * K, 0);
      AmxTiles tiles;
      for (int64_t blk = b0; blk < b1; ++blk) {  // 32 outputs: two weight blocks (N is a multiple of 4)
        const int64_t n0 = blk * 32, valid = std::min<int64_t>(32, N - n0);
        for (int64_t j = 0; j < valid / kTile; ++j) {
          if (q8) bf16_unpack_tile<true>(wp, sp, K, n0 + j * kTile, wb.data() + j * kTile * K);
          else bf16_unpack_tile<false>(wp, sp, K, n0 + j * kTile, wb.data() + j * kTile * K);
        }
        const uint16_t keep[2] = {static_cast<uint16_t>((1u << std::min<int64_t>(16, valid)) - 1),
                                  static_cast<uint16_t>((1u << std::max<int64_t>(0, valid - 16)) - 1)};
        amx_bf16_block(wb.data(), valid > 16 ? 2 : 1, xt.get(), M, K, yp + n0, N, keep);
      }
    });
    return y;
  }
  at::parallel_for(0, N / kTile, kGrain / kTile, [&](int64_t b0, int64_t b1) {
    std::vector<uint16_t> wb(kTile * K);
    for (int64_t blk = b0; blk < b1; ++blk) {
      if (q8) bf16_unpack_tile<true>(wp, sp, K, blk * kTile, wb.data());
      else bf16_unpack_tile<false>(wp, sp, K, blk * kTile, wb.data());
      for (int64_t m0 = 0; m0 < M; m0 += kRows)
        with_rows<kRows>(std::min<int64_t>(kRows, M - m0), [&](auto MB) {
          bf16_rows<MB.value>(wb.data(), xbp + m0 * K, K, blk * kTile, yp + m0 * N, N);
        });
    }
  });
  return y;
}

torch::Tensor q4_bf16(torch::Tensor x, torch::Tensor w, torch::Tensor dm) { return mm_bf16(x, w, dm, false); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_bf16", &q4_bf16, "x [M,K] fp32 @ Q4 [N,K]^T -> [M,N] fp32, bf16 activations and weights (AVX-512 BF16)");
  m.def("q8_bf16", [](torch::Tensor x, torch::Tensor w, torch::Tensor d) { return mm_bf16(x, w, d, true); },
        "x [M,K] fp32 @ Q8 [N,K]^T -> [M,N] fp32, bf16 activations and weights (AVX-512 BF16)");
  m.def("q4_i8w", [](torch::Tensor x, torch::Tensor w, torch::Tensor dm) { return mm_i8_wide(x, w, dm, false); },
        "x [M,K] fp32 @ Q4 [N,K]^T -> [M,N] fp32, int8 activations per 32-group, 16 outputs per vector (wide_i8.cpp)");
  m.def("q8_i8w", [](torch::Tensor x, torch::Tensor w, torch::Tensor d) { return mm_i8_wide(x, w, d, true); },
        "x [M,K] fp32 @ Q8 [N,K]^T -> [M,N] fp32, int8 activations per 32-group, 16 outputs per vector (wide_i8.cpp)");
  m.def("i8w_prepack", &i8w_prepack, "tiled Q4 (q8=False) or Q8 weights -> [pk, ps], mm_i8_pre's prepacked copy");
  m.def("q4_i8p", [](torch::Tensor x, torch::Tensor pk, torch::Tensor ps, int64_t n) { return mm_i8_pre(x, pk, ps, n, false); },
        "q4_i8w's numbers on i8w_prepack's copy (no per-call interleave)");
  m.def("q8_i8p", [](torch::Tensor x, torch::Tensor pk, torch::Tensor ps, int64_t n) { return mm_i8_pre(x, pk, ps, n, true); },
        "q8_i8w's numbers on i8w_prepack's copy (no per-call interleave)");
  m.def("amx_bf16_ready", &amx_bf16_ready, "the CPU has AMX-BF16 and this process may use its tiles (asked of the OS once)");
  m.def("amx_bf16_on", &amx_bf16_on, "q4_bf16 / q8_bf16 run on AMX tiles (amx_bf16_ready and not switched off)");
  m.def("set_amx", &set_amx, "AMX tiles on or off for this process's bf16 products (FASTDLLM_AMX)");
  m.def("lora_add", &lora_add, "y += (x A^T) B^T per fused part, rows on their own (lora.cpp)");
  m.def("q4_bf16_lora", &bf16_lora, "q4_bf16(x) (+ bias) + (x A^T) B^T; on AMX x A^T from the product's bf16 x (lora.cpp)");
  m.def("layer_step", &layer_step, "one decoder layer's narrow forward over a KV cache (engine/csrc/layer.cpp)");
  py::class_<LayerStack>(m, "LayerStack", "every decoder layer for layer_step, handed over once (layer.cpp)")
      .def(py::init([](std::vector<torch::Tensor> norm1, std::vector<torch::Tensor> norm2, double eps,
                       std::vector<std::vector<torch::Tensor>> weights,
                       std::vector<std::vector<c10::optional<torch::Tensor>>> lora_a,
                       std::vector<std::vector<std::vector<torch::Tensor>>> lora_b,
                       std::vector<std::vector<std::vector<int64_t>>> slices,
                       std::vector<c10::optional<torch::Tensor>> qkv_bias, bool int8, int64_t heads, int64_t kv_heads) {
             const size_t n = norm1.size();
             TORCH_CHECK(n > 0 && norm2.size() == n && weights.size() == n && lora_a.size() == n && lora_b.size() == n &&
                             slices.size() == n && qkv_bias.size() == n,
                         "LayerStack: one entry per layer in every list");
             return LayerStack{std::move(norm1), std::move(norm2), eps, std::move(weights), std::move(lora_a),
                               std::move(lora_b), std::move(slices), std::move(qkv_bias), int8, heads, kv_heads};
           }))
      .def("forward", &LayerStack::forward, "x through every layer (cache_k / cache_v with the layers first)");
  m.def("q4_f32", [](torch::Tensor x, torch::Tensor w, torch::Tensor dm) { return mm_f32(x, w, dm, false); },
        "x [M,K] fp32 @ Q4 [N,K]^T -> [M,N] fp32, fp32 activations");
  m.def("q8_f32", [](torch::Tensor x, torch::Tensor w, torch::Tensor d) { return mm_f32(x, w, d, true); },
        "x [M,K] fp32 @ Q8 [N,K]^T -> [M,N] fp32, fp32 activations");
}
