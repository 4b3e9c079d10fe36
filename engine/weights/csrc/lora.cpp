// The dLLM's LoRA delta, y += (x A^T) B^T per fused part, as rows of outer products (AVX-512).
//
// Why: at 1-32 rows these are tiny products (rank 32; 7 per layer, 210 per forward on the bundled model) that ATen
// runs at a 20-30 us floor each, ~8 ms of a 9-wide forward; and the weights, stored as bf16 in the adapter file, were
// widened to fp32, doubling what a 1-token forward streams. Here the weights stay as exact as the file (bf16 when
// bf16 holds them exactly, else fp32), are widened in registers, and every row is summed over k in order on its
// own: a row's delta does not depend on the rows beside it (exact batching, which ATen's GEMMs did not give).
#include "q4.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int kCols = 32;  // outputs per register chunk (2 vectors)
constexpr int kRows = 8;   // rows per register chunk: 16 accumulators, 2 weight vectors widened per k for 16 FMAs

template <typename W>
inline __m512 load16(const W* p, __mmask16 k) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm512_maskz_loadu_ps(k, p);
  } else {  // bf16: the high half of an fp32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
  }
}

// y[m, n0 .. n0 + 64) += sum_k x[m, k] w[k, n] for RB rows; NV = vectors of the chunk, `last` masks the final one.
template <typename W, int RB, int NV>
void rows_chunk(const float* x, int64_t ldx, const W* w, int64_t K, int64_t N, int64_t n0, float* y, int64_t ldy,
                __mmask16 last) {
  __m512 acc[RB][NV];
  #pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
    #pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_maskz_loadu_ps(v == NV - 1 ? last : 0xffff, y + r * ldy + n0 + 16 * v);
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NV];
    #pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) wv[v] = load16(w + k * N + n0 + 16 * v, v == NV - 1 ? last : 0xffff);
    #pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      #pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
    #pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm512_mask_storeu_ps(y + r * ldy + n0 + 16 * v, v == NV - 1 ? last : 0xffff, acc[r][v]);
}

template <typename W, int RB>
void rows_block(const float* x, int64_t ldx, const W* w, int64_t K, int64_t N, int64_t n0, float* y, int64_t ldy) {
  const int64_t left = std::min<int64_t>(kCols, N - n0);
  const int nv = static_cast<int>((left + 15) / 16);
  const int tail = static_cast<int>(left - 16 * (nv - 1));
  const __mmask16 last = tail == 16 ? 0xffff : static_cast<__mmask16>((1u << tail) - 1);
  if (nv == 1) rows_chunk<W, RB, 1>(x, ldx, w, K, N, n0, y, ldy, last);
  else rows_chunk<W, RB, 2>(x, ldx, w, K, N, n0, y, ldy, last);
}

// y [M, N] (row stride ldy) += x [M, K] (row stride ldx) @ w [K, N] (contiguous, fp32 or bf16).
void add_product(const float* x, int64_t ldx, const torch::Tensor& w, int64_t M, float* y, int64_t ldy) {
  const int64_t K = w.size(0), N = w.size(1), chunks = (N + kCols - 1) / kCols;
  auto run = [&](auto tag) {
    using W = decltype(tag);
    const W* wp = reinterpret_cast<const W*>(w.data_ptr());
    at::parallel_for(0, chunks, 16, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t m0 = 0; m0 < M; m0 += kRows) {
          const float* xm = x + m0 * ldx;
          float* ym = y + m0 * ldy;
          switch (std::min<int64_t>(kRows, M - m0)) {
            case 1: rows_block<W, 1>(xm, ldx, wp, K, N, c * kCols, ym, ldy); break;
            case 2: rows_block<W, 2>(xm, ldx, wp, K, N, c * kCols, ym, ldy); break;
            case 3: rows_block<W, 3>(xm, ldx, wp, K, N, c * kCols, ym, ldy); break;
            case 4: rows_block<W, 4>(xm, ldx, wp, K, N, c * kCols, ym, ldy); break;
            case 5: rows_block<W, 5>(xm, ldx, wp, K, N, c * kCols, ym, ldy); break;
            case 6: rows_block<W, 6>(xm, ldx, wp, K, N, c * kCols, ym, ldy); break;
            case 7: rows_block<W, 7>(xm, ldx, wp, K, N, c * kCols, ym, ldy); break;
            default: rows_block<W, 8>(xm, ldx, wp, K, N, c * kCols, ym, ldy); break;
          }
        }
    });
  };
  if (w.scalar_type() == torch::kFloat) run(float{});
  else run(uint16_t{});
}

void check_weight(const torch::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == torch::kFloat || w.scalar_type() == torch::kBFloat16),
              "lora_add: ", what, " must be a contiguous fp32 or bf16 matrix");
}

}  // namespace

torch::Tensor lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor a_t, std::vector<torch::Tensor> b,
                       std::vector<int64_t> slices) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "lora_add: x must be a contiguous fp32 [M, K]");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kFloat && y.stride(1) == 1 && y.size(0) == x.size(0),
              "lora_add: y must be fp32 [M, N] with unit column stride and x's rows");
  check_weight(a_t, "A^T");
  TORCH_CHECK(a_t.size(0) == x.size(1), "lora_add: A^T has ", a_t.size(0), " inputs, x ", x.size(1));
  TORCH_CHECK(slices.size() == 4 * b.size(), "lora_add: 4 slice bounds per B");
  const int64_t M = x.size(0), R = a_t.size(1);
  auto h = torch::zeros({M, R}, x.options());
  add_product(x.data_ptr<float>(), x.size(1), a_t, M, h.data_ptr<float>(), R);
  for (size_t s = 0; s < b.size(); ++s) {
    const int64_t r0 = slices[4 * s], r1 = slices[4 * s + 1], o0 = slices[4 * s + 2], o1 = slices[4 * s + 3];
    check_weight(b[s], "B^T");
    TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= R && b[s].size(0) == r1 - r0 && 0 <= o0 && o1 <= y.size(1) &&
                    b[s].size(1) == o1 - o0,
                "lora_add: slice ", s, " does not fit (rank ", r0, "..", r1, " of ", R, ", outputs ", o0, "..", o1, ")");
    add_product(h.data_ptr<float>() + r0, R, b[s], M, y.data_ptr<float>() + o0, y.stride(0));
  }
  return y;
}
