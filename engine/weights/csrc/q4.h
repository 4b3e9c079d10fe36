// Shared declarations of our CPU kernels (q4.cpp: quantised products; layer.cpp: one decoder layer's step).
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <type_traits>
#include <vector>

// fn(std::integral_constant<int, rb>) for rb in 1 .. Max (anything else: Max): a row count the register blocking
// needs as a compile-time constant
template <int Max, int N = 1, typename Fn>
inline void with_rows(int64_t rb, const Fn& fn) {
  if constexpr (N == Max) {
    fn(std::integral_constant<int, N>{});
  } else if (rb == N) {
    fn(std::integral_constant<int, N>{});
  } else {
    with_rows<Max, N + 1>(rb, fn);
  }
}

// M rows in ceil(M / Max) register passes of equal size (9 rows at Max 12 in one pass, not 8 + 1, which would stream
// the weights again for one row): fn(first row, rows as a compile-time constant)
template <int Max, typename Fn>
inline void for_passes(int64_t M, const Fn& fn) {
  const int64_t passes = (M + Max - 1) / Max;
  for (int64_t i = 0, m0 = 0, rb = 0; i < passes; ++i, m0 += rb)
    with_rows<Max>(rb = (M - m0 + passes - i - 1) / (passes - i), [&](auto RB) { fn(m0, RB); });
}

// x [M, K] fp32 @ W^T -> [M, N] fp32; W Q4 (w, dm) or Q8 (w, d) in q4.cpp's tiled layout.
torch::Tensor mm_f32(torch::Tensor x, torch::Tensor w, torch::Tensor sc, bool q8);
torch::Tensor q4_bf16(torch::Tensor x, torch::Tensor w, torch::Tensor dm);  // needs AVX-512 BF16
// x [M, K] fp32 -> its bf16 rows [ceil(M / 16) * 16, K] (round to nearest even; zero past M: whole tiles), K % 32 == 0
torch::Tensor bf16_rows(const torch::Tensor& x);
// q4_bf16 (q8 false) / q8_bf16; *rows (if given): the product's bf16_rows(x), for the LoRA delta beside it (lora.cpp)
torch::Tensor mm_bf16(torch::Tensor x, torch::Tensor w, torch::Tensor sc, bool q8, torch::Tensor* rows = nullptr);
// int8 activations per row and 32-group on an interleave built per call (wide_i8.cpp)
torch::Tensor mm_i8_wide(torch::Tensor x, torch::Tensor w, torch::Tensor sc, bool q8);
// the same products on a copy prepacked once into that interleave (i8w_prepack -> pk, ps)
std::vector<torch::Tensor> i8w_prepack(torch::Tensor w, torch::Tensor sc, bool q8);
torch::Tensor mm_i8_pre(torch::Tensor x, torch::Tensor pk, torch::Tensor ps, int64_t N, bool q8);
// q4_bf16 / q8_bf16 on AMX tiles (amx.cpp), for every row count once on
bool amx_bf16_ready();  // the CPU has AMX-BF16 and the OS gave this process the tile state (asked once)
bool amx_bf16_on();     // amx_bf16_ready() and not switched off (set_amx; FASTDLLM_AMX=0)
void set_amx(bool on);
struct AmxTiles {       // the tile configuration, loaded in this thread for this object's lifetime
  AmxTiles();
  ~AmxTiles();
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};
// x's bf16 rows xb [M, K] -> xt [ceil(M / 16)][K / 2][16][2], every element written (rows past M as zeros)
void amx_bf16_rows(const uint16_t* xb, int64_t M, int64_t K, uint16_t* xt);
// y[M, na * 16 outputs] (row stride ldy; keep[a] masks block a's outputs past N) from the bf16 weights of na (1 or 2)
// 16-output blocks, wb [na * 16][K]
void amx_bf16_block(const uint16_t* wb, int na, const uint16_t* xt, int64_t M, int64_t K, float* y, int64_t ldy,
                    const uint16_t* keep);
// y [M, N] (row stride ldy; += when accumulate) = x [M, K] W on tiles; x bf16 rows (stride ldx; rows up to the next
// multiple of 16 are read), W lora.py's bf16 panels [ceil(N / 32)][K / 2][32][2], K a multiple of 32 (lora.cpp)
void amx_bf16_panels(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y,
                     int64_t ldy, bool accumulate);
// y += (x A^T) B^T per fused part (lora.cpp); a_t and b[s] in 32-output panels (engine/weights/lora.py panels), fp32
// or bf16; slices (r0, r1, o0, o1); fp32 FMAs
torch::Tensor lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor a_t, std::vector<torch::Tensor> b,
                       std::vector<int64_t> slices);
// y = q4_bf16(x) (+ bias) + the LoRA delta; on AMX tiles with a bf16 A the delta takes the product's own bf16 rows
// of x (x and h enter it in bf16), elsewhere lora_add
torch::Tensor bf16_lora(torch::Tensor x, torch::Tensor w, torch::Tensor dm, const c10::optional<torch::Tensor>& bias,
                        torch::Tensor a_t, std::vector<torch::Tensor> b, std::vector<int64_t> slices);

torch::Tensor layer_step(const torch::Tensor& x, const torch::Tensor& norm1, const torch::Tensor& norm2, double eps,
                         const std::vector<torch::Tensor>& weights, const std::vector<c10::optional<torch::Tensor>>& lora_a,
                         const std::vector<std::vector<torch::Tensor>>& lora_b,
                         const std::vector<std::vector<int64_t>>& lora_slices, bool int8, int64_t wide, int64_t heads,
                         int64_t kv_heads, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& cache_k,
                         const torch::Tensor& cache_v, const torch::Tensor& pos, const torch::Tensor& mask,
                         const c10::optional<torch::Tensor>& qkv_bias, const c10::optional<torch::Tensor>& cache_rows);

// Every decoder layer of a model for layer_step, handed over once (at load): a forward is then one call from Python
// instead of one per layer, each of which converted ~30 tensors.
struct LayerStack {
  std::vector<torch::Tensor> norm1, norm2;
  double eps;
  std::vector<std::vector<torch::Tensor>> weights;
  std::vector<std::vector<c10::optional<torch::Tensor>>> lora_a;
  std::vector<std::vector<std::vector<torch::Tensor>>> lora_b;
  std::vector<std::vector<std::vector<int64_t>>> slices;
  std::vector<c10::optional<torch::Tensor>> qkv_bias;
  bool int8;
  int64_t heads, kv_heads;
  // x through every layer; cache_k / cache_v [layers, B, kv_heads, len, D]; the rest as layer_step's
  torch::Tensor forward(torch::Tensor x, int64_t wide, const torch::Tensor& cache_k, const torch::Tensor& cache_v,
                        const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& pos,
                        const torch::Tensor& mask, const c10::optional<torch::Tensor>& cache_rows) const;
};
