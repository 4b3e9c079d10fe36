// The dLLM's LoRA delta, y += (x A^T) B^T per fused part, as rows of outer products (AVX-512).
//
// Why: at 1-32 rows these are tiny products (rank 32; 7 per layer, 210 per forward on the bundled model) that ATen
// runs at a 20-30 us floor each, ~8 ms of a 9-wide forward; and the weights, stored as bf16 in the adapter file, were
// widened to fp32, doubling what a 1-token forward streams. Here the weights stay as exact as the file (bf16 when
// bf16 holds them exactly, else fp32), are widened in registers, and every row is summed over k in order on its
// own: a row's delta does not depend on the rows beside it (exact batching, which ATen's GEMMs did not give).
// The weights lie in panels of 32 outputs ([N / 32, K, 32], engine/weights/lora.py `panels`), so each panel is one
// sequential stream: in the [K, N] layout a 32-output chunk read 64 bytes of every K-row, which the hardware prefetcher
// did not follow (B's rows are 1-6 KB apart): a 1-token forward's LoRA streamed at half the 4-bit products' rate.
#include "q4.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int kCols = 32;     // outputs per panel (2 vectors)
constexpr int kRowsMax = 12;  // rows per register pass: 24 accumulators, 2 weight vectors widened per k for 24 FMAs

// y[m, 0 .. 32) (masks m0, m1: the panel's real outputs) += sum_k x[m, k] p[k, 0 .. 32) for RB rows; p one panel
// (fp32: [K][32]; bf16: [K / 2][32][2], each k-pair's two weights side by side in a dword), read front to back: one
// sequential stream, which the hardware prefetcher keeps ahead of the FMAs. Sums in k order, fp32 activations.
template <typename W, int RB>
void panel_rows(const float* x, int64_t ldx, const W* p, int64_t K, float* y, int64_t ldy, __mmask16 m0, __mmask16 m1) {
  __m512 acc[RB][2];
  #pragma GCC unroll 12
  for (int r = 0; r < RB; ++r) {
    acc[r][0] = _mm512_maskz_loadu_ps(m0, y + r * ldy);
    acc[r][1] = _mm512_maskz_loadu_ps(m1, y + r * ldy + 16);
  }
  auto fma_k = [&](int64_t k, __m512 w0, __m512 w1) {
    #pragma GCC unroll 12
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  };
  if constexpr (std::is_same_v<W, float>) {
    for (int64_t k = 0; k < K; ++k) fma_k(k, _mm512_loadu_ps(p + k * kCols), _mm512_loadu_ps(p + k * kCols + 16));
  } else {  // a bf16 is the high half of an fp32: k's weights = dword << 16, k + 1's = dword & 0xffff0000
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t k = 0; k < K; k += 2) {
      const __m512i a = _mm512_loadu_si512(p + k * kCols), b = _mm512_loadu_si512(p + k * kCols + 32);
      fma_k(k, _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
      fma_k(k + 1, _mm512_castsi512_ps(_mm512_and_si512(a, high)), _mm512_castsi512_ps(_mm512_and_si512(b, high)));
    }
  }
  #pragma GCC unroll 12
  for (int r = 0; r < RB; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[r][1]);
  }
}

// y [M, N] (row stride ldy) += x [M, K] (row stride ldx) @ w, w as panels [ceil(N / 32), K, 32] (fp32 or bf16,
// zero past N): each panel is read once for up to 12 rows; M rows in ceil(M / 12) passes of equal size (9 rows in
// one pass, not 8 + a 1-row pass that streams the panel again for one row).
void add_product(const float* x, int64_t ldx, const torch::Tensor& w, int64_t N, int64_t M, float* y, int64_t ldy) {
  const int64_t chunks = w.size(0), K = w.size(1);
  auto run = [&](auto tag) {
    using W = decltype(tag);
    const W* wp = reinterpret_cast<const W*>(w.data_ptr());
    at::parallel_for(0, chunks, 16, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t n0 = c * kCols, left = std::min<int64_t>(kCols, N - n0);
        const __mmask16 m0 = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
        const __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
        for_passes<kRowsMax>(M, [&](int64_t r0, auto RB) {
          panel_rows<W, RB.value>(x + r0 * ldx, ldx, wp + c * K * kCols, K, y + r0 * ldy + n0, ldy, m0, m1);
        });
      }
    });
  };
  if (w.scalar_type() == torch::kFloat) run(float{});
  else run(uint16_t{});
}

void check_weight(const torch::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kCols && w.is_contiguous() &&
                  (w.scalar_type() == torch::kFloat || (w.scalar_type() == torch::kBFloat16 && w.size(1) % 2 == 0)),
              "lora_add: ", what, " must be contiguous fp32 or bf16 panels [N / 32, K, 32] (engine/weights/lora.py panels)");
}

// y += h B^T per slice (h [M, R] fp32, x A^T for every part; slices (r0, r1, o0, o1) per B). hb: h in bf16 rows
// [ceil(M / 16) * 16, R] (AMX: the slices whose B is bf16 with whole 32-rank k-steps run on tiles), or undefined.
void add_b(torch::Tensor& y, const torch::Tensor& h, const torch::Tensor& hb, const std::vector<torch::Tensor>& b,
           const std::vector<int64_t>& slices) {
  const int64_t R = h.size(1), M = h.size(0);
  TORCH_CHECK(slices.size() == 4 * b.size(), "lora_add: 4 slice bounds per B");
  for (size_t s = 0; s < b.size(); ++s) {
    const int64_t r0 = slices[4 * s], r1 = slices[4 * s + 1], o0 = slices[4 * s + 2], o1 = slices[4 * s + 3];
    check_weight(b[s], "B^T");
    TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= R && b[s].size(1) == r1 - r0 && 0 <= o0 && o0 <= o1 && o1 <= y.size(1) &&
                    b[s].size(0) == (o1 - o0 + kCols - 1) / kCols,
                "lora_add: slice ", s, " does not fit (rank ", r0, "..", r1, " of ", R, ", outputs ", o0, "..", o1, ")");
    if (hb.defined() && b[s].scalar_type() == torch::kBFloat16 && (r1 - r0) % 32 == 0)
      amx_bf16_panels(reinterpret_cast<const uint16_t*>(hb.data_ptr<at::BFloat16>()) + r0, R, M, r1 - r0,
                      reinterpret_cast<const uint16_t*>(b[s].data_ptr<at::BFloat16>()), o1 - o0,
                      y.data_ptr<float>() + o0, y.stride(0), true);
    else
      add_product(h.data_ptr<float>() + r0, R, b[s], o1 - o0, M, y.data_ptr<float>() + o0, y.stride(0));
  }
}

void check_y(const torch::Tensor& y, int64_t M) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kFloat && y.stride(1) == 1 && y.size(0) == M,
              "lora_add: y must be fp32 [M, N] with unit column stride and x's rows");
}

// On tiles (AMX, A bf16): h = xb A^T from x's bf16 rows xb (bf16_rows), then h B^T from h's bf16 rows where B is
// bf16 with whole 32-rank steps (the rest on the panels from fp32 h). Both products take the rows as the tile's A
// operand and the panels as its B, so C is the output's rows as they are.
void add_on_tiles(torch::Tensor& y, const torch::Tensor& xb, int64_t M, const torch::Tensor& a_t,
                  const std::vector<torch::Tensor>& b, const std::vector<int64_t>& slices) {
  const int64_t K = xb.size(1), R = a_t.size(0) * kCols;
  auto h = torch::empty({M, R}, y.options());
  amx_bf16_panels(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), K, M, K,
                  reinterpret_cast<const uint16_t*>(a_t.data_ptr<at::BFloat16>()), R, h.data_ptr<float>(), R, false);
  add_b(y, h, bf16_rows(h), b, slices);
}

}  // namespace

torch::Tensor lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor a_t, std::vector<torch::Tensor> b,
                       std::vector<int64_t> slices) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "lora_add: x must be a contiguous fp32 [M, K]");
  check_y(y, x.size(0));
  check_weight(a_t, "A^T");
  TORCH_CHECK(a_t.size(1) == x.size(1), "lora_add: A^T has ", a_t.size(1), " inputs, x ", x.size(1));
  const int64_t M = x.size(0), R = a_t.size(0) * kCols;  // h's columns: the ranks, zero-padded to whole panels
  auto h = torch::zeros({M, R}, x.options());
  add_product(x.data_ptr<float>(), x.size(1), a_t, R, M, h.data_ptr<float>(), R);
  add_b(y, h, torch::Tensor(), b, slices);
  return y;
}

// Why tiles: the fp32 FMAs of the delta ran at about half the time of the 4-bit products beside them on AMX tiles (a
// 16-row block decode: 4.5 s against 9.6 s). Putting them on tiles with the weights as the tile's A operand did not
// pay (each call laid x out in k-pair tiles and transposed every output tile: bench/results/amx_bf16/lora_tiles/);
// with the product's own bf16 rows of x as A it does (bench/results/lora_amx/). x and h then enter in bf16, as x does
// the product. lora_add alone (fp32 and int8 products) keeps the fp32 panels: there it measured no faster.
torch::Tensor bf16_lora(torch::Tensor x, torch::Tensor w, torch::Tensor dm, const c10::optional<torch::Tensor>& bias,
                        torch::Tensor a_t, std::vector<torch::Tensor> b, std::vector<int64_t> slices) {
  check_weight(a_t, "A^T");
  TORCH_CHECK(a_t.size(1) == x.size(1), "lora_add: A^T has ", a_t.size(1), " inputs, x ", x.size(1));
  torch::Tensor rows;
  torch::Tensor y = mm_bf16(x, w, dm, false, &rows);
  if (bias.has_value()) y = y + *bias;
  check_y(y, x.size(0));
  if (amx_bf16_on() && a_t.scalar_type() == torch::kBFloat16) add_on_tiles(y, rows, x.size(0), a_t, b, slices);
  else lora_add(y, x, a_t, b, slices);
  return y;
}
