// One decoder layer's cached forward of up to a block (the AR step, dual-cache sub-block steps, block steps) in one call: RMSNorm, q|k|v with
// our 4-bit kernel (+ the dLLM's LoRA), RoPE, K/V written to the cache, attention over the cached keys, o_proj,
// residual, RMSNorm, gate|up, SiLU x up, down_proj, residual. `wide` (from engine/quant.py's switch point) runs the
// products with bf16 activations (1: q4_bf16) or int8 ones (2: wide_i8.cpp), as the eager layers' wide calls do.
//
// Why: on this CPU an eager layer is ~80 small torch ops (~1-10 us each: dispatch, allocation, a decomposed
// RMSNorm, SDPA's setup), which cost more than the layer's 4-bit products at one token. Every row (b, t) is
// computed on its own, in the same order whatever the batch: attention visits only the keys the mask allows, so
// a row's numbers do not depend on how long other rows are (exact batching without whole key quanta).
#include "q4.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const int64_t M = x.size(0), H = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * H;
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= H; i += 16) {
      const __m512 v = _mm512_loadu_ps(r + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = _mm512_reduce_add_ps(acc);
    for (; i < H; ++i) ss += r[i] * r[i];
    const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    const __m512 s = _mm512_set1_ps(rstd);
    for (i = 0; i + 16 <= H; i += 16)
      _mm512_storeu_ps(op + m * H + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(r + i), s), _mm512_loadu_ps(wp + i)));
    for (; i < H; ++i) op[m * H + i] = r[i] * rstd * wp[i];
  }
  return out;
}

// y = x W^T (+ bias) (+ x A^T B^T per fused part, the dLLM's LoRA: lora.cpp, as engine/weights/int4.py's Int4Linear)
torch::Tensor project(const torch::Tensor& x, const std::vector<torch::Tensor>& wt, int p, bool int8, int64_t wide,
                      const c10::optional<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                      const std::vector<int64_t>& slices, const c10::optional<torch::Tensor>& bias = c10::nullopt) {
  const torch::Tensor& w = wt[2 * p];
  const torch::Tensor& sc = wt[2 * p + 1];
  // int8 activations: on the prepacked copy when the layer has one (weights 8..15: pk, ps per projection)
  const bool pre = wt.size() == 16;
  if (wide == 1 && a.has_value()) return bf16_lora(x, w, sc, bias, *a, b, slices);  // lora.cpp: one bf16 x for both
  torch::Tensor y = wide == 1 ? q4_bf16(x, w, sc)
                    : wide == 2 || int8 ? (pre ? mm_i8_pre(x, wt[8 + 2 * p], wt[9 + 2 * p], w.size(0), false)
                                               : mm_i8_wide(x, w, sc, false))
                                        : mm_f32(x, w, sc, false);
  if (bias.has_value()) y = y + *bias;
  if (a.has_value()) lora_add(y, x.contiguous(), *a, b, slices);
  return y;
}

// exp(x) for x <= 0 (softmax after subtracting the max), Cephes' single-precision polynomial: ~1 ulp.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// a * c + b * s as the scalar loop was compiled (-ffp-contract=fast: one product fused into the add), so the
// vectorised RoPE gives the same bits as before (checked against the scalar build)
inline __m512 rope_lane(__m512 a, __m512 c, __m512 b, __m512 s) {
  return _mm512_fmadd_ps(a, c, _mm512_mul_ps(b, s));
}

// lane i of the result = the sum of v[i]'s 16 lanes (a transpose-and-add tree: ~45 shuffles/adds for 16 sums)
inline __m512 sum16(const __m512* v) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// Attention of the queries of one kv head: its `group` query heads at positions [t0, t1) of one sequence. Each
// query's numbers are those of a row-by-row softmax(q K^T * scale) V over the keys its mask allows (scores 16 keys
// at a time, the same sums in the same order whatever the other queries). Every 16-key tile of K, and every row of
// V, is read once for all of them while it is in L1 (not once per query from L2), and a whole tile's 16 sums and
// the value accumulators have compile-time shapes so they stay in registers (a per-row loop spilled them to the
// stack): a 32-wide forward over 1k cached keys went from 176 to 133 ms.
template <int C>  // C = D / 16 vectors per head row
void attend_group(const float* qkv, int64_t W, int64_t qcol, int group, int64_t t0, int64_t t1, const float* K,
                  int64_t kl, const float* V, int64_t vl, const bool* mask, int64_t n, float scale,
                  float* s, float* inv, float* out, int64_t ow) {  // s: [Q][n rounded to 16], inv: [Q] (scratch)
  constexpr int64_t D = 16 * C;
  const int64_t Q = (t1 - t0) * group, np = (n + 15) / 16 * 16;
  const __m512 neg = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto qrow = [&](int64_t i) { return qkv + (t0 + i / group) * W + qcol + (i % group) * D; };
  auto vis = [&](int64_t i) { return mask + (t0 + i / group) * n; };
  for (int64_t j0 = 0; j0 < n; j0 += 16) {  // scores
    const int64_t cnt = std::min<int64_t>(16, n - j0);
    const __mmask16 in = cnt == 16 ? 0xffff : static_cast<__mmask16>((1u << cnt) - 1);
    for (int64_t i = 0; i < Q; ++i) {
      const __mmask16 ok = _mm_mask_cmpneq_epi8_mask(in, _mm_maskz_loadu_epi8(in, vis(i) + j0), _mm_setzero_si128());
      __m512 sc = neg;
      if (ok != 0) {
        const float* q = qrow(i);
        __m512 qv[C], acc[16];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
        if (cnt == 16) {  // a whole tile: constant trip counts keep the 16 sums in registers
          for (int j = 0; j < 16; ++j) {
            acc[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(K + (j0 + j) * kl));
            for (int c = 1; c < C; ++c) acc[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(K + (j0 + j) * kl + 16 * c), acc[j]);
          }
        } else {
          for (int j = 0; j < 16; ++j) {
            acc[j] = _mm512_setzero_ps();
            if (j < cnt)
              for (int c = 0; c < C; ++c) acc[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(K + (j0 + j) * kl + 16 * c), acc[j]);
          }
        }
        sc = _mm512_mask_mov_ps(neg, ok, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
      }
      _mm512_storeu_ps(s + i * np + j0, sc);
    }
  }
  for (int64_t i = 0; i < Q; ++i) {  // softmax numerators in place, 1 / their sum (0: no visible key, zeros out)
    float* si = s + i * np;
    __m512 mx = neg;
    for (int64_t j0 = 0; j0 < n; j0 += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(si + j0));
    const float m = _mm512_reduce_max_ps(mx);
    if (m == -std::numeric_limits<float>::infinity()) {
      std::fill(si, si + np, 0.0f);
      inv[i] = 0.0f;
      continue;
    }
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const __m512 sc = _mm512_loadu_ps(si + j0);
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sc, neg, _CMP_NEQ_OQ), exp_ps(_mm512_sub_ps(sc, mv)));
      _mm512_storeu_ps(si + j0, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[i] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  constexpr int QB = C <= 4 ? 6 : 3;  // queries per pass over V: QB * C accumulators + C rows of V in registers
  for (int64_t i0 = 0; i0 < Q; i0 += QB) {
    const int64_t qb = std::min<int64_t>(QB, Q - i0);
    auto pass = [&](auto nq) {  // nq: a compile-time query count, so the accumulators stay in registers
      constexpr int NQ = decltype(nq)::value;
      __m512 o[NQ][C];
      for (int i = 0; i < NQ; ++i)
        for (int c = 0; c < C; ++c) o[i][c] = _mm512_setzero_ps();
      const float* si = s + i0 * np;
      for (int64_t j = 0; j < n; ++j) {
        __m512 v[C];
        for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(V + j * vl + 16 * c);
        for (int i = 0; i < NQ; ++i) {
          const float e = si[i * np + j];
          if (e == 0.0f) continue;  // masked or underflowed: adds nothing (and never reads what V holds there)
          const __m512 ev = _mm512_set1_ps(e);
          for (int c = 0; c < C; ++c) o[i][c] = _mm512_fmadd_ps(ev, v[c], o[i][c]);
        }
      }
      for (int i = 0; i < NQ; ++i) {
        const int64_t q = i0 + i;
        float* dst = out + (t0 + q / group) * ow + (q % group) * D;
        const __m512 iv = _mm512_set1_ps(inv[q]);
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(o[i][c], iv));
      }
    };
    switch (qb) {
      case 1: pass(std::integral_constant<int, 1>{}); break;
      case 2: pass(std::integral_constant<int, 2>{}); break;
      case 3: pass(std::integral_constant<int, 3>{}); break;
      case 4: if constexpr (QB >= 4) pass(std::integral_constant<int, 4>{}); break;
      case 5: if constexpr (QB >= 5) pass(std::integral_constant<int, 5>{}); break;
      default: if constexpr (QB >= 6) pass(std::integral_constant<int, 6>{}); break;
    }
  }
}

}  // namespace

torch::Tensor layer_step(const torch::Tensor& x, const torch::Tensor& norm1, const torch::Tensor& norm2, double eps,
                         const std::vector<torch::Tensor>& weights, const std::vector<c10::optional<torch::Tensor>>& lora_a,
                         const std::vector<std::vector<torch::Tensor>>& lora_b,
                         const std::vector<std::vector<int64_t>>& lora_slices, bool int8, int64_t wide, int64_t heads,
                         int64_t kv_heads, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& cache_k,
                         const torch::Tensor& cache_v, const torch::Tensor& pos, const torch::Tensor& mask,
                         const c10::optional<torch::Tensor>& qkv_bias, const c10::optional<torch::Tensor>& cache_rows) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "layer_step: x must be fp32 [B, T, H]");
  TORCH_CHECK((weights.size() == 8 || weights.size() == 16) && lora_a.size() == 4 && lora_b.size() == 4 &&
                  lora_slices.size() == 4,
              "layer_step: 4 projections (q|k|v, o, gate|up, down): (w, dm) each, then (pk, ps) each if prepacked");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T, D = cos.size(1);
  const int64_t n = mask.size(2), group = heads / kv_heads;
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 128 && heads % kv_heads == 0 && cos.size(0) == M && sin.size(0) == M,
              "layer_step: head dim a multiple of 16 up to 128, rope tables [B*T, D]");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.size(0) == B && mask.size(1) == T,
              "layer_step: mask must be bool [B, T, keys]");
  TORCH_CHECK(pos.scalar_type() == torch::kLong && pos.is_contiguous() && pos.numel() == M, "layer_step: pos [B, T]");
  TORCH_CHECK(cache_k.stride(3) == 1 && cache_v.stride(3) == 1 && cache_k.size(3) == D && cache_k.size(2) >= n,
              "layer_step: cache [B, kv_heads, len, D]");
  // row b of x reads and writes cache row rows[b] (a part of a batch: no copy of its K/V); default b
  TORCH_CHECK(!cache_rows.has_value() || (cache_rows->scalar_type() == torch::kLong && cache_rows->is_contiguous() &&
                                          cache_rows->numel() == B),
              "layer_step: cache_rows must be int64 [B]");
  std::vector<int64_t> crow(B);
  for (int64_t b = 0; b < B; ++b) {
    crow[b] = cache_rows.has_value() ? cache_rows->data_ptr<int64_t>()[b] : b;
    TORCH_CHECK(crow[b] >= 0 && crow[b] < cache_k.size(0) && crow[b] < cache_v.size(0), "layer_step: cache row ", crow[b],
                " outside the cache");
  }
  const torch::Tensor x2 = x.view({M, H});

  // attention half
  TORCH_CHECK(!qkv_bias.has_value() || (qkv_bias->scalar_type() == torch::kFloat && qkv_bias->dim() == 1),
              "layer_step: qkv_bias must be fp32 [q|k|v outputs]");
  torch::Tensor qkv = project(rms_norm(x2, norm1, eps), weights, 0, int8, wide, lora_a[0], lora_b[0], lora_slices[0],
                              qkv_bias);
  const int64_t QK = (heads + kv_heads) * D, W = qkv.size(1);
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* kc = cache_k.data_ptr<float>();
  float* vc = cache_v.data_ptr<float>();
  const int64_t kb = cache_k.stride(0), kh = cache_k.stride(1), kl = cache_k.stride(2);
  const int64_t vb = cache_v.stride(0), vh = cache_v.stride(1), vl = cache_v.stride(2);
  const int64_t half = D / 2;
  for (int64_t m = 0; m < M; ++m) {
    float* r = qp + m * W;
    const float* cm = cp + m * D;
    const float* sm = sp + m * D;
    for (int64_t c = 0; c < QK; c += D)  // RoPE: x cos + roll(x, D/2) sin (sin's first half negated), 16 lanes a time
      for (int64_t d = 0; d < half; d += 16) {
        const __mmask16 in = half - d >= 16 ? 0xffff : static_cast<__mmask16>((1u << (half - d)) - 1);
        const __m512 lo = _mm512_maskz_loadu_ps(in, r + c + d), hi = _mm512_maskz_loadu_ps(in, r + c + half + d);
        _mm512_mask_storeu_ps(r + c + d, in, rope_lane(lo, _mm512_maskz_loadu_ps(in, cm + d), hi, _mm512_maskz_loadu_ps(in, sm + d)));
        _mm512_mask_storeu_ps(r + c + half + d, in,
                              rope_lane(hi, _mm512_maskz_loadu_ps(in, cm + half + d), lo, _mm512_maskz_loadu_ps(in, sm + half + d)));
      }
    const int64_t b = m / T, p = pp[m];
    TORCH_CHECK(p >= 0 && p < cache_k.size(2), "layer_step: position ", p, " outside the cache");
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(kc + crow[b] * kb + h * kh + p * kl, r + heads * D + h * D, D * sizeof(float));
      std::memcpy(vc + crow[b] * vb + h * vh + p * vl, r + QK + h * D, D * sizeof(float));
    }
  }
  auto att = torch::empty({M, heads * D}, x.options());
  float* ap = att.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // tasks: (sequence, kv head, up to kAttnRows positions), each the queries of the kv head's `group` query heads
  constexpr int64_t kAttnRows = 8;
  const int64_t chunks = (T + kAttnRows - 1) / kAttnRows;
  at::parallel_for(0, B * kv_heads * chunks, 1, [&](int64_t i0, int64_t i1) {
    const int64_t qmax = std::min<int64_t>(T, kAttnRows) * group;  // one scratch per task: scores, then 1/sums
    std::vector<float> s(qmax * ((n + 15) / 16 * 16) + qmax);
    float* inv = s.data() + qmax * ((n + 15) / 16 * 16);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (kv_heads * chunks), g = i / chunks % kv_heads, t0 = i % chunks * kAttnRows;
      const int64_t t1 = std::min(T, t0 + kAttnRows);
      const float* q = qp + b * T * W;
      const float* kk = kc + crow[b] * kb + g * kh;
      const float* vv = vc + crow[b] * vb + g * vh;
      const bool* mk = mp + b * T * n;
      float* o = ap + b * T * heads * D + g * group * D;
      auto run = [&](auto c) {
        attend_group<decltype(c)::value>(q, W, g * group * D, group, t0, t1, kk, kl, vv, vl, mk, n, scale, s.data(), inv,
                                         o, heads * D);
      };
      switch (D / 16) {  // D is a multiple of 16 up to 128 (checked above)
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 5: run(std::integral_constant<int, 5>{}); break;
        case 6: run(std::integral_constant<int, 6>{}); break;
        case 7: run(std::integral_constant<int, 7>{}); break;
        default: run(std::integral_constant<int, 8>{}); break;
      }
    }
  });
  torch::Tensor h1 = x2 + project(att, weights, 1, int8, wide, lora_a[1], lora_b[1], lora_slices[1]);

  // MLP half
  torch::Tensor gu = project(rms_norm(h1, norm2, eps), weights, 2, int8, wide, lora_a[2], lora_b[2], lora_slices[2]);
  const int64_t I = gu.size(1) / 2;
  // silu(gate) * up with the product in place: one allocation instead of two, ATen's numbers bit for bit
  torch::Tensor act = at::silu(gu.narrow(1, 0, I));
  act.mul_(gu.narrow(1, I, I));
  h1 += project(act, weights, 3, int8, wide, lora_a[3], lora_b[3], lora_slices[3]);
  return h1.view({B, T, H});
}

torch::Tensor LayerStack::forward(torch::Tensor x, int64_t wide, const torch::Tensor& cache_k,
                                  const torch::Tensor& cache_v, const torch::Tensor& cos, const torch::Tensor& sin,
                                  const torch::Tensor& pos, const torch::Tensor& mask,
                                  const c10::optional<torch::Tensor>& cache_rows) const {
  const int64_t layers = static_cast<int64_t>(norm1.size());
  TORCH_CHECK(cache_k.dim() == 5 && cache_v.dim() == 5 && cache_k.size(0) == layers && cache_v.size(0) == layers,
              "LayerStack: cache_k / cache_v must be [", layers, " layers, B, kv_heads, len, D]");
  for (int64_t i = 0; i < layers; ++i)
    x = layer_step(x, norm1[i], norm2[i], eps, weights[i], lora_a[i], lora_b[i], slices[i], int8, wide, heads, kv_heads,
                   cos, sin, cache_k[i], cache_v[i], pos, mask, qkv_bias[i], cache_rows);
  return x;
}
