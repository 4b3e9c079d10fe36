// Products with int8 activations (AVX-512 VNNI) on llama.cpp's interleaved layout, built per call: the wide calls
// of FASTDLLM_WIDE_ACTIVATIONS=int8 and every call of FASTDLLM_ACTIVATIONS=int8.
//
// Why: at 2-33 rows a 4-bit product is compute-bound on this CPU. The bf16 path (q4.cpp q4_bf16) spends 16
// vdpbf16ps per 512 multiply-adds and dequantises every weight to bf16 per call; the int8 kernel this replaced
// spent a float convert, multiply and FMA per 64 multiply-adds, because each (output, row) owned a vector whose lanes
// were reduced at the end. Here one vpdpbusd covers 16 outputs x 4 k (the layout of llama.cpp's AVX-512 repacked
// Q4 blocks): per 32-group, row and 16 outputs, 8 vpdpbusd (512 multiply-adds) and one scale FMA (+ one for the
// weights' minimum), with no horizontal sums. The interleave is built per call from the file's tiled layout (one
// 8x8 qword transpose per 16 outputs and pair of groups, into an L2 scratch), so the weights stay stored once; the
// next block's weights are prefetched meanwhile. At 1 row it costs what the old kernel did, from 2 rows less.
//
// Numbers: activations quantised per row and 32-group to int8 (d_x = amax / 127, like llama.cpp's Q8_1); per
// group sum_k q_w q_x exactly in int32, then y += (d_w d_x) * dot + m_w * (d_x sum q_x). Every row is computed on
// its own, groups in order, whatever the number of rows or threads (exact batching).
#include "q4.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <memory>

namespace {

constexpr int64_t kGroup = 32;
constexpr int kTile = 4;     // outputs per tile of the stored layout (q4.cpp)
constexpr int kBlock = 16;   // outputs per vector here
// rows per register chunk: up to 9 float + 9 int32 accumulators; M rows go in ceil(M / 9) passes of equal size
// (9 = the dual cache's sub-block step in one pass, not 8 + a 1-row pass that reloads every weight for one row)
constexpr int kRowsMax = 9;

// Rows quantised per 32-group: q int8 [M, K]; d [M, G] = d_x; s [M, G] = d_x * sum(q_x).
struct RowsI8 {
  torch::Tensor q, d, s;
};

RowsI8 quantize_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  RowsI8 r{torch::empty({M, K}, x.options().dtype(torch::kChar)), torch::empty({M, G}, x.options()),
           torch::empty({M, G}, x.options())};
  const float* xp = x.data_ptr<float>();
  int8_t* q = r.q.data_ptr<int8_t>();
  float* d = r.d.data_ptr<float>();
  float* s = r.s.data_ptr<float>();
  for (int64_t i = 0; i < M * G; ++i) {
    const float* p = xp + i * kGroup;
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float dx = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(dx > 0 ? 1.0f / dx : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup + 16), _mm512_cvtsepi32_epi8(qb));
    d[i] = dx;
    s[i] = dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
  return r;
}

// z[i] (i = 0..7): dwords 0-7 = chunks 0..7 (4 bytes each) of output 2i, dwords 8-15 = the same of output 2i + 1.
// t[c] (c = 0..7): dword o = chunk c of output o (o = 0..15). A dword shuffle, then an 8x8 qword transpose.
inline void transpose_chunks(const __m512i* z, __m512i* t) {
  const __m512i pairs = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  __m512i a[8], b[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm512_permutexvar_epi32(pairs, z[i]);  // qword c = (2i, 2i+1) chunk c
  for (int i = 0; i < 8; i += 2) {  // qwords: (a_i c, a_i+1 c) for even c, then odd c
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 1]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 1]);
  }
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int base = 0; base < 8; base += 4)
    for (int e = 0; e < 2; ++e) {  // e = 0: chunks 0/4 and 2/6; e = 1: 1/5 and 3/7
      const __m512i x = b[base + e], y = b[base + 2 + e];
      a[base + e] = _mm512_permutex2var_epi64(x, lo, y);      // 4 outputs' pairs: chunk e | chunk e + 4
      a[base + 2 + e] = _mm512_permutex2var_epi64(x, hi, y);  // chunk e + 2 | chunk e + 6
    }
  // a[0]: chunks 0 | 4 of outputs 0-7; a[4]: the same of outputs 8-15 (a[1]: 1 | 5, a[2]: 2 | 6, a[3]: 3 | 7)
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i64x2(a[c], a[4 + c], 0x44);
    t[c + 4] = _mm512_shuffle_i64x2(a[c], a[4 + c], 0xEE);
  }
}

// Outputs [n0, n0 + 16) (only `valid` of them real) into buf [G][8 chunks][16 outputs][4 bytes] as unsigned bytes
// (Q4: q in 0..15; Q8: u = q + 128), and their scales into dw [G][16] and mw [G][16] (Q4: d, m; Q8: d, -128 d).
// Packed (the prepacked copy, Q4 only): the nibble pairs as they are, [G / 2][8 chunks][16][4 bytes], low nibble =
// group 2p, high = 2p + 1 (split in rows_pre's loop).
template <bool Q8, bool Packed = false>
void interleave_block(const uint8_t* w, const at::Half* sc, int64_t G, int64_t n0, int valid, uint8_t* buf, float* dw,
                      float* mw) {
  constexpr int S = Q8 ? 1 : 2;
  const int64_t pair_bytes = Q8 ? 64 : 32, tile_bytes = (G / 2) * kTile * pair_bytes;
  const int tiles = valid / kTile;
  const uint8_t* wt = w + (n0 / kTile) * tile_bytes;
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t p = 0; p < G / 2; ++p) {
    for (int h = 0; h < (Q8 ? 2 : 1); ++h) {
      __m512i z[8], t[8];
      for (int i = 0; i < 8; ++i) {  // outputs 2i, 2i + 1: tile i / 2, outputs 2 (i % 2) and 2 (i % 2) + 1 in it
        if (i / 2 >= tiles) {
          z[i] = _mm512_setzero_si512();
          continue;
        }
        const uint8_t* src = wt + (i / 2) * tile_bytes + p * kTile * pair_bytes + 2 * (i % 2) * pair_bytes;
        if constexpr (Q8) {  // bytes 32h..32h+31 of each output: group 2p + h
          z[i] = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * h))),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + pair_bytes + 32 * h)), 1);
        } else {  // both outputs' 32 bytes, each byte = q_2p (low nibble) | q_2p+1 (high nibble)
          z[i] = _mm512_loadu_si512(src);
        }
      }
      transpose_chunks(z, t);
      #pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        if constexpr (Q8) {
          _mm512_store_si512(buf + ((2 * p + h) * 8 + c) * 64, t[c]);
        } else if constexpr (Packed) {
          _mm512_storeu_si512(buf + (p * 8 + c) * 64, t[c]);
        } else {
          _mm512_store_si512(buf + ((2 * p) * 8 + c) * 64, _mm512_and_si512(t[c], low));
          _mm512_store_si512(buf + ((2 * p + 1) * 8 + c) * 64, _mm512_and_si512(_mm512_srli_epi16(t[c], 4), low));
        }
      }
    }
  }
  // scales: per group, each tile's 4 outputs x S halves side by side ([N/4, G, 4, S]); missing tiles read as zero
  const uint16_t* st = reinterpret_cast<const uint16_t*>(sc) + (n0 / kTile) * G * kTile * S;
  const __mmask8 tiles_in = static_cast<__mmask8>((1u << tiles) - 1);
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (Q8) {  // 4 tiles x 4 halves -> d of outputs 0..15
      const __m256i h = _mm256_mmask_i64gather_epi64(_mm256_setzero_si256(), tiles_in,
          _mm256_setr_epi64x(0, G * kTile, 2 * G * kTile, 3 * G * kTile), reinterpret_cast<const long long*>(st + g * kTile), 2);
      const __m512 d = _mm512_cvtph_ps(h);
      _mm512_store_ps(dw + g * kBlock, d);
      _mm512_store_ps(mw + g * kBlock, _mm512_mul_ps(d, _mm512_set1_ps(-128.0f)));
    } else {  // 4 tiles x (d, m) x 4 -> d and m of outputs 0..15
      __m128i t[4];
      for (int i = 0; i < 4; ++i)
        t[i] = i < tiles ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(st + (i * G + g) * kTile * 2)) : _mm_setzero_si128();
      const __m512 a = _mm512_cvtph_ps(_mm256_set_m128i(t[1], t[0])), b = _mm512_cvtph_ps(_mm256_set_m128i(t[3], t[2]));
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      _mm512_store_ps(dw + g * kBlock, _mm512_permutex2var_ps(a, even, b));
      _mm512_store_ps(mw + g * kBlock, _mm512_permutex2var_ps(a, odd, b));
    }
  }
  (void)tiles_in;  // read by the Q8 branch only
}

// y[r, n0 .. n0 + valid) for RB rows from the interleaved block. `pf` (or null): `pf_bytes` of the next block's
// stored weights, prefetched into L2 a few lines per group, so the DRAM stream overlaps the arithmetic (a burst of
// prefetches at once overflows the miss buffers and is partly dropped).
template <int RB>
void rows_i8(const uint8_t* buf, const float* dw, const float* mw, const int8_t* xq, const float* dx, const float* sx,
             int64_t K, int64_t G, float* y, int64_t ldy, __mmask16 keep, const char* pf, int64_t pf_bytes) {
  const int64_t pf_step = pf ? ((pf_bytes / G + 63) / 64) * 64 : 0;  // whole lines per group
  __m512 acc[RB];
  #pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = g * pf_step; b < std::min((g + 1) * pf_step, pf_bytes); b += 64) _mm_prefetch(pf + b, _MM_HINT_T1);
    const uint8_t* wg = buf + g * 8 * 64;
    __m512i dot[RB];
    #pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) dot[r] = _mm512_setzero_si512();
    #pragma GCC unroll 16
    for (int c = 0; c < 8; ++c) {
      const __m512i wv = _mm512_load_si512(wg + c * 64);
      #pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) {
        int32_t xw;
        __builtin_memcpy(&xw, xq + r * K + g * kGroup + 4 * c, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], wv, _mm512_set1_epi32(xw));
      }
    }
    const __m512 d = _mm512_load_ps(dw + g * kBlock), m = _mm512_load_ps(mw + g * kBlock);
    #pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * G + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * G + g]), acc[r]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

// rows_i8 on the prepacked copy (i8w_prepack): the weights read where they lie (no per-call interleave), Q4 nibbles
// split per chunk (one shift and one and, shared by the rows), scales converted from fp16 per group. The same
// products in the same order as rows_i8 on the per-call interleave: bit-identical.
template <int RB, bool Q8>
void rows_pre(const uint8_t* pk, const uint16_t* ps, const int8_t* xq, const float* dx, const float* sx, int64_t K,
              int64_t G, float* y, int64_t ldy, __mmask16 keep, const char* pf, int64_t pf_bytes) {
  const int64_t pf_step = pf ? ((pf_bytes / G + 63) / 64) * 64 : 0;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[RB];
  #pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = g * pf_step; b < std::min((g + 1) * pf_step, pf_bytes); b += 64) _mm_prefetch(pf + b, _MM_HINT_T1);
    const uint8_t* wg = Q8 ? pk + g * 8 * 64 : pk + (g / 2) * 8 * 64;
    const __m128i shift = _mm_cvtsi32_si128(Q8 ? 0 : 4 * static_cast<int>(g & 1));
    __m512i dot[RB];
    #pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) dot[r] = _mm512_setzero_si512();
    #pragma GCC unroll 16
    for (int c = 0; c < 8; ++c) {
      __m512i wv = _mm512_loadu_si512(wg + c * 64);
      if constexpr (!Q8) wv = _mm512_and_si512(_mm512_srl_epi16(wv, shift), low);
      #pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) {
        int32_t xw;
        __builtin_memcpy(&xw, xq + r * K + g * kGroup + 4 * c, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], wv, _mm512_set1_epi32(xw));
      }
    }
    const uint16_t* sg = ps + g * (Q8 ? 1 : 2) * kBlock;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg)));
    const __m512 m = Q8 ? _mm512_mul_ps(d, _mm512_set1_ps(-128.0f))
                        : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + kBlock)));
    #pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * G + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * G + g]), acc[r]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

// One block's interleave scratch: weights [G][8][64] bytes (16 K bytes: 78 KB at K = 4864, L2), then dw and mw
// [G][16] floats.
struct Scratch {
  std::unique_ptr<uint8_t, decltype(&std::free)> held;
  uint8_t* buf;
  float *dw, *mw;
  explicit Scratch(int64_t G)
      : held(static_cast<uint8_t*>(std::aligned_alloc(64, G * (8 * 64 + 2 * kBlock * sizeof(float)))), &std::free),
        buf(held.get()), dw(reinterpret_cast<float*>(buf + G * 8 * 64)), mw(dw + G * kBlock) {}
};

inline __mmask16 keep_mask(int valid) {
  return valid == kBlock ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
}

}  // namespace

torch::Tensor mm_i8_wide(torch::Tensor x, torch::Tensor w, torch::Tensor sc, bool q8) {
  const char* what = q8 ? "q8_i8w" : "q4_i8w";
  const int64_t K = q8 ? w.size(1) : w.size(1) * 2, N = w.size(0), M = x.size(0), G = K / kGroup;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), what,
              ": x must be a contiguous fp32 [M, K]");
  TORCH_CHECK(x.size(1) == K, what, ": x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(K % (2 * kGroup) == 0, what, ": K = ", K, " must be a multiple of 64");
  TORCH_CHECK(N % kTile == 0, what, ": output features must be a multiple of 4, got ", N);
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.is_contiguous() && sc.scalar_type() == torch::kHalf &&
                  sc.is_contiguous() && sc.numel() == N * G * (q8 ? 1 : 2),
              what, ": weights must be contiguous uint8 with fp16 scales");
  const RowsI8 rx = quantize_rows(x);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* xq = rx.q.data_ptr<int8_t>();
  const float* dx = rx.d.data_ptr<float>();
  const float* sx = rx.s.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* sp = sc.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    Scratch s(G);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kBlock;
      const int valid = static_cast<int>(std::min<int64_t>(kBlock, N - n0));
      if (q8) interleave_block<true>(wp, sp, G, n0, valid, s.buf, s.dw, s.mw);
      else interleave_block<false>(wp, sp, G, n0, valid, s.buf, s.dw, s.mw);
      // the next block's stored tiles (one contiguous run) are prefetched while this block's first rows run
      const int64_t tile_bytes = (G / 2) * kTile * (q8 ? 64 : 32);
      const char* pf = blk + 1 < blocks ? reinterpret_cast<const char*>(wp + (n0 + kBlock) / kTile * tile_bytes) : nullptr;
      const int64_t pf_bytes = pf ? (std::min<int64_t>(kBlock, N - n0 - kBlock) / kTile) * tile_bytes : 0;
      for_passes<kRowsMax>(M, [&](int64_t m0, auto RB) {
        rows_i8<RB.value>(s.buf, s.dw, s.mw, xq + m0 * K, dx + m0 * G, sx + m0 * G, K, G, yp + m0 * N + n0, N,
                          keep_mask(valid), m0 == 0 ? pf : nullptr, pf_bytes);
      });
    }
  });
  return y;
}

// The prepacked copy of a tiled Q4 / Q8 weight for mm_i8_pre: pk [blocks of 16 outputs][G / 2 (Q4) or G (Q8)][8][64]
// bytes (the same bytes as the file's), ps [blocks][G][2 (Q4: d, m) or 1 (Q8: d)][16] fp16 (the file's scales).
std::vector<torch::Tensor> i8w_prepack(torch::Tensor w, torch::Tensor sc, bool q8) {
  const int64_t K = q8 ? w.size(1) : w.size(1) * 2, N = w.size(0), G = K / kGroup, S = q8 ? 1 : 2;
  TORCH_CHECK(K % (2 * kGroup) == 0 && N % kTile == 0, "i8w_prepack: K must be a multiple of 64, N of 4");
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.is_contiguous() && sc.scalar_type() == torch::kHalf &&
                  sc.is_contiguous() && sc.numel() == N * G * S,
              "i8w_prepack: weights must be contiguous uint8 with fp16 scales");
  const int64_t blocks = (N + kBlock - 1) / kBlock, wbytes = G * 8 * 64 / (q8 ? 1 : 2);
  auto pk = torch::empty({blocks, wbytes}, w.options());
  auto ps = torch::empty({blocks, G * S * kBlock}, sc.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* sp = sc.data_ptr<at::Half>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    Scratch s(G);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kBlock;
      const int valid = static_cast<int>(std::min<int64_t>(kBlock, N - n0));
      uint8_t* out = pk.data_ptr<uint8_t>() + blk * wbytes;
      if (q8) {
        interleave_block<true>(wp, sp, G, n0, valid, out, s.dw, s.mw);
      } else {
        interleave_block<false, true>(wp, sp, G, n0, valid, out, s.dw, s.mw);
      }
      uint16_t* so = reinterpret_cast<uint16_t*>(ps.data_ptr<at::Half>()) + blk * G * S * kBlock;
      for (int64_t g = 0; g < G; ++g) {  // fp32 copies of fp16 values: back to fp16 exactly
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(so + g * S * kBlock),
                            _mm512_cvtps_ph(_mm512_load_ps(s.dw + g * kBlock), _MM_FROUND_TO_NEAREST_INT));
        if (!q8)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(so + g * S * kBlock + kBlock),
                              _mm512_cvtps_ph(_mm512_load_ps(s.mw + g * kBlock), _MM_FROUND_TO_NEAREST_INT));
      }
    }
  });
  return {pk, ps};
}

// x [M, K] fp32 @ W^T -> [M, N] fp32 on i8w_prepack's copy: mm_i8_wide's numbers without its per-call interleave.
torch::Tensor mm_i8_pre(torch::Tensor x, torch::Tensor pk, torch::Tensor ps, int64_t N, bool q8) {
  const char* what = q8 ? "q8_i8p" : "q4_i8p";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), what,
              ": x must be a contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup, blocks = (N + kBlock - 1) / kBlock;
  const int64_t wbytes = G * 8 * 64 / (q8 ? 1 : 2), S = q8 ? 1 : 2;
  TORCH_CHECK(K % (2 * kGroup) == 0, what, ": K = ", K, " must be a multiple of 64");
  TORCH_CHECK(pk.scalar_type() == torch::kByte && pk.is_contiguous() && pk.numel() == blocks * wbytes &&
                  ps.scalar_type() == torch::kHalf && ps.is_contiguous() && ps.numel() == blocks * G * S * kBlock,
              what, ": the prepacked weights do not match x's ", K, " features and ", N, " outputs");
  const RowsI8 rx = quantize_rows(x);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* xq = rx.q.data_ptr<int8_t>();
  const float* dx = rx.d.data_ptr<float>();
  const float* sx = rx.s.data_ptr<float>();
  const uint8_t* wp = pk.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(ps.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kBlock;
      const __mmask16 keep = keep_mask(static_cast<int>(std::min<int64_t>(kBlock, N - n0)));
      const uint8_t* w = wp + blk * wbytes;
      const uint16_t* s = sp + blk * G * S * kBlock;
      const char* pf = blk + 1 < blocks ? reinterpret_cast<const char*>(w + wbytes) : nullptr;
      for_passes<kRowsMax>(M, [&](int64_t m0, auto RB) {
        const int8_t* q = xq + m0 * K;
        const float *d = dx + m0 * G, *e = sx + m0 * G;
        float* out = yp + m0 * N + n0;
        const char* p = m0 == 0 ? pf : nullptr;
        if (q8) rows_pre<RB.value, true>(w, s, q, d, e, K, G, out, N, keep, p, wbytes);
        else rows_pre<RB.value, false>(w, s, q, d, e, K, G, out, N, keep, p, wbytes);
      });
    }
  });
  return y;
}
