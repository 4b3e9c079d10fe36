// One decoder layer's narrow forward (the AR step, dual-cache sub-block steps) in one call: RMSNorm, q|k|v with
// our 4-bit kernel (+ the dLLM's LoRA), RoPE, K/V written to the cache, attention over the cached keys, o_proj,
// residual, RMSNorm, gate|up, SiLU x up, down_proj, residual.
//
// Why: on this CPU an eager layer is ~80 small torch ops (~1-10 us each: dispatch, allocation, a decomposed
// RMSNorm, SDPA's setup), which cost more than the layer's 4-bit products at one token. Every row (b, t) is
// computed on its own, in the same order whatever the batch: attention visits only the keys the mask allows, so
// a row's numbers do not depend on how long other rows are (exact batching without whole key quanta).
#include "q4.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
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

// y = x W^T (+ x A^T B^T per fused part, the dLLM's LoRA: the same ATen products as engine/quant.py's LoRA)
torch::Tensor project(const torch::Tensor& x, const std::vector<torch::Tensor>& wt, int p, bool int8,
                      const c10::optional<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                      const std::vector<int64_t>& slices) {
  const torch::Tensor& w = wt[3 * p];
  const torch::Tensor& sc = wt[3 * p + 1];
  const torch::Tensor& mt = wt[3 * p + 2];
  torch::Tensor y = int8 ? mm_i8(x, w, sc, mt, false) : mm_f32(x, w, sc, false);
  if (a.has_value()) {
    const torch::Tensor h = at::mm(x, *a);
    for (size_t s = 0; s < b.size(); ++s) {
      const int64_t r0 = slices[4 * s], r1 = slices[4 * s + 1], o0 = slices[4 * s + 2], o1 = slices[4 * s + 3];
      y.narrow(1, o0, o1 - o0).addmm_(h.narrow(1, r0, r1 - r0), b[s]);
    }
  }
  return y;
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

torch::Tensor layer_step(torch::Tensor x, torch::Tensor norm1, torch::Tensor norm2, double eps,
                         std::vector<torch::Tensor> weights, std::vector<c10::optional<torch::Tensor>> lora_a,
                         std::vector<std::vector<torch::Tensor>> lora_b, std::vector<std::vector<int64_t>> lora_slices,
                         bool int8, int64_t heads, int64_t kv_heads, torch::Tensor cos, torch::Tensor sin,
                         torch::Tensor cache_k, torch::Tensor cache_v, torch::Tensor pos, torch::Tensor mask) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "layer_step: x must be fp32 [B, T, H]");
  TORCH_CHECK(weights.size() == 12 && lora_a.size() == 4 && lora_b.size() == 4 && lora_slices.size() == 4,
              "layer_step: 4 projections (q|k|v, o, gate|up, down)");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T, D = cos.size(1);
  const int64_t n = mask.size(2), group = heads / kv_heads;
  TORCH_CHECK(D % 16 == 0 && heads % kv_heads == 0 && cos.size(0) == M && sin.size(0) == M, "layer_step: rope tables [B*T, D]");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.size(0) == B && mask.size(1) == T,
              "layer_step: mask must be bool [B, T, keys]");
  TORCH_CHECK(pos.scalar_type() == torch::kLong && pos.is_contiguous() && pos.numel() == M, "layer_step: pos [B, T]");
  TORCH_CHECK(cache_k.stride(3) == 1 && cache_v.stride(3) == 1 && cache_k.size(3) == D && cache_k.size(2) >= n,
              "layer_step: cache [B, kv_heads, len, D]");
  const torch::Tensor x2 = x.view({M, H});

  // attention half
  torch::Tensor qkv = project(rms_norm(x2, norm1, eps), weights, 0, int8, lora_a[0], lora_b[0], lora_slices[0]);
  const int64_t QK = (heads + kv_heads) * D, W = qkv.size(1);
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* kc = cache_k.data_ptr<float>();
  float* vc = cache_v.data_ptr<float>();
  const int64_t kb = cache_k.stride(0), kh = cache_k.stride(1), kl = cache_k.stride(2);
  const int64_t vb = cache_v.stride(0), vh = cache_v.stride(1), vl = cache_v.stride(2);
  std::vector<float> tmp(D);
  for (int64_t m = 0; m < M; ++m) {
    float* r = qp + m * W;
    for (int64_t c = 0; c < QK; c += D) {  // RoPE: x cos + roll(x, D/2) sin (sin's first half negated)
      for (int64_t d = 0; d < D; ++d) tmp[d] = r[c + d];
      for (int64_t d = 0; d < D; ++d) r[c + d] = tmp[d] * cp[m * D + d] + tmp[(d + D / 2) % D] * sp[m * D + d];
    }
    const int64_t b = m / T, p = pp[m];
    TORCH_CHECK(p >= 0 && p < cache_k.size(2), "layer_step: position ", p, " outside the cache");
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(kc + b * kb + h * kh + p * kl, r + heads * D + h * D, D * sizeof(float));
      std::memcpy(vc + b * vb + h * vh + p * vl, r + QK + h * D, D * sizeof(float));
    }
  }
  auto att = torch::empty({M, heads * D}, x.options());
  float* ap = att.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, M * heads, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(n);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / heads, h = i % heads, b = m / T, g = h / group;
      const float* q = qp + m * W + h * D;
      const bool* vis = mp + m * n;
      const float* K = kc + b * kb + g * kh;
      const float* V = vc + b * vb + g * vh;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j)
        if (vis[j]) { s[j] = dot(q, K + j * kl, D) * scale; mx = std::max(mx, s[j]); }
      float* o = ap + m * heads * D + h * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
      if (mx == -std::numeric_limits<float>::infinity()) continue;  // no visible key: zeros
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j)
        if (vis[j]) {
          const float e = std::exp(s[j] - mx);
          sum += e;
          const __m512 ev = _mm512_set1_ps(e);
          for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(o + d, _mm512_fmadd_ps(ev, _mm512_loadu_ps(V + j * vl + d), _mm512_loadu_ps(o + d)));
        }
      const __m512 inv = _mm512_set1_ps(1.0f / sum);
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
    }
  });
  torch::Tensor h1 = x2 + project(att, weights, 1, int8, lora_a[1], lora_b[1], lora_slices[1]);

  // MLP half
  torch::Tensor gu = project(rms_norm(h1, norm2, eps), weights, 2, int8, lora_a[2], lora_b[2], lora_slices[2]);
  const int64_t I = gu.size(1) / 2;
  torch::Tensor act = at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
  h1 += project(act, weights, 3, int8, lora_a[3], lora_b[3], lora_slices[3]);
  return h1.view({B, T, H});
}
