// q4.cpp's wide bf16 products (q4_bf16 / q8_bf16) on AMX tiles (Intel Sapphire Rapids and later: AMX-BF16).
//
// Why: on those Xeons vdpbf16ps runs at about a third of the rate of the int8 dot products, so the engine's default
// wide steps (bf16 activations) cost 3-4x the int8 ones (measured: a dual-cache decode 17 against 44 tok/s). A tile
// product (tdpbf16ps) takes 16 outputs x 32 k x 16 rows at once. The roles swap: A = 16 outputs' bf16 weights
// (mm_bf16's dequantised tiles, row-major per output, as they are), B = x's rows in k-pairs (amx_bf16_rows), so
// C = y^T sums the whole of K inside the tile (no per-group work: the scales are in the weights) and is transposed
// once per 16 outputs on the way out. bench/results/amx_bf16/ (and amx_experiment/: int8 tiles, not kept).
//
// Numbers: the same bf16 weights and bf16 rows as the vdpbf16ps kernel, fp32 sums in the tile's order (relative
// differences ~1e-7). Each C element depends only on its own row and output, so a row's numbers do not depend on the
// other rows of the call: every row count runs here once AMX is on (exact batching).
//
// Linux hands a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, kernel 5.16+), once per
// process; a thread loads the tile configuration before its products and releases it after (AmxTiles).
#include "q4.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <mutex>

namespace {

constexpr long kReqXcompPerm = 0x1023;  // arch_prctl: ARCH_REQ_XCOMP_PERM
constexpr long kXtileData = 18;         // XFEATURE_XTILEDATA

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes. 0-3: C (16 outputs x 16 rows fp32: two weight blocks by two 16-row tiles of x);
// 4-5: A (16 outputs x 32 k of bf16 weights); 6-7: B (x's 16 rows as 16 k-pairs).
TileConfig make_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  return c;
}

std::atomic<bool> g_enabled{true};

// CPUID leaf 7 EDX: bit 22 AMX-BF16, bit 24 AMX-TILE; then the OS's permission for the tile state
bool probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

__attribute__((target("amx-tile"))) void load_tiles() {
  static const TileConfig config = make_config();
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// v[o] = row o of a 16 x 16 fp32 block -> v[j] = its column j (unpacks within 128-bit lanes, then lane shuffles)
__attribute__((target("avx512f"))) inline void transpose16(__m512 v[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 4; ++i) {
    v[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    v[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    v[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    v[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_f32x4(v[8 * i + k], v[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_f32x4(v[8 * i + k], v[8 * i + 4 + k], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    v[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    v[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
  }
}

// C tiles of NA 16-output weight blocks (wb [NA * 16][K]) against NB 16-row tiles of x (xt, [NB][K / 2][16][2]), into
// c [2][2][16][16] (block a, x tile b at (2a + b) * 256). At 2 x 2 every tile loaded serves two products. PREFETCH:
// the x tiles of a later k-step are fetched into L1 first; at many rows (xt in L2) tile loads from L2 otherwise left
// the tile unit idle (bench/results/amx_bf16/README.md: 0.79-0.89x the time at 128-512 rows).
template <int NA, int NB, bool PREFETCH>
__attribute__((target("amx-tile,amx-bf16"))) void bf16_tiles(const uint16_t* wb, const uint16_t* xt, int64_t K,
                                                             float* c) {
  constexpr int64_t kAhead = 32;  // k: one step ahead
  const int64_t P = K / 2;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NA > 1) _tile_zero(2);
  if constexpr (NA > 1 && NB > 1) _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    if constexpr (PREFETCH)
      if (k + kAhead < K)
        for (int l = 0; l < 16; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(xt + (k + kAhead) * 16) + 64 * l, _MM_HINT_T0);
          if constexpr (NB > 1) _mm_prefetch(reinterpret_cast<const char*>(xt + (P + (k + kAhead) / 2) * 32) + 64 * l, _MM_HINT_T0);
        }
    _tile_loadd(4, wb + k, 2 * K);
    _tile_loadd(6, xt + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) {
      _tile_loadd(7, xt + (P + k / 2) * 32, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NA > 1) {
      _tile_loadd(5, wb + 16 * K + k, 2 * K);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NB > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NA > 1) _tile_stored(2, c + 512, 64);
  if constexpr (NA > 1 && NB > 1) _tile_stored(3, c + 768, 64);
}

}  // namespace

bool amx_bf16_ready() {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] { ok = probe(); });
  return ok;
}

bool amx_bf16_on() { return g_enabled.load(std::memory_order_relaxed) && amx_bf16_ready(); }

void set_amx(bool on) { g_enabled.store(on, std::memory_order_relaxed); }

AmxTiles::AmxTiles() { load_tiles(); }

AmxTiles::~AmxTiles() { release_tiles(); }

// 16 rows x 16 k-pairs at a time, as one 16 x 16 dword transpose (rows past M written as zeros: the caller need
// not clear xt). The
// scalar loop before wrote every k-pair to its own 64-byte line, a row at a time: at 512 rows of K = 1536 that took
// half of the down projection's time (bench/results/layer_elementwise/, "x's rows in k-pairs").
__attribute__((target("avx512f"))) void amx_bf16_rows(const uint16_t* xb, int64_t M, int64_t K, uint16_t* xt) {
  const uint32_t* src = reinterpret_cast<const uint32_t*>(xb);  // a k-pair = one dword
  uint32_t* dst = reinterpret_cast<uint32_t*>(xt);
  const int64_t P = K / 2;  // a multiple of 16 (K of 32)
  for (int64_t r0 = 0; r0 < M; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, M - r0);
    for (int64_t p0 = 0; p0 < P; p0 += 16) {
      __m512 v[16];
      for (int i = 0; i < 16; ++i)
        v[i] = i < rows ? _mm512_castsi512_ps(_mm512_loadu_si512(src + (r0 + i) * P + p0)) : _mm512_setzero_ps();
      transpose16(v);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + ((r0 / 16) * P + p0 + j) * 16, _mm512_castps_si512(v[j]));
    }
  }
}

__attribute__((target("avx512f"))) void amx_bf16_block(const uint16_t* wb, int na, const uint16_t* xt, int64_t M,
                                                       int64_t K, float* y, int64_t ldy, const uint16_t* keep) {
  alignas(64) float c[4 * 256];
  const int64_t T = (M + 15) / 16, P = K / 2;
  for (int64_t t0 = 0; t0 < T; t0 += 2) {
    const int64_t nb = std::min<int64_t>(2, T - t0);
    const uint16_t* xs = xt + t0 * P * 32;
    if (T <= 2) {  // up to 32 rows (a row alone, a block): xt stays in L1; two by two measured no better there
      for (int a = 0; a < na; ++a)
        nb == 1 ? bf16_tiles<1, 1, false>(wb + a * 16 * K, xs, K, c + a * 512)
                : bf16_tiles<1, 2, false>(wb + a * 16 * K, xs, K, c + a * 512);
    } else if (na == 1) {
      nb == 1 ? bf16_tiles<1, 1, true>(wb, xs, K, c) : bf16_tiles<1, 2, true>(wb, xs, K, c);
    } else {
      nb == 1 ? bf16_tiles<2, 1, true>(wb, xs, K, c) : bf16_tiles<2, 2, true>(wb, xs, K, c);
    }
    // row r of y = column r of C: each 16 x 16 C tile transposed in registers (gathering each column instead cost
    // 1-10 % of the product: bench/results/layer_elementwise/, "The tile product's epilogue")
    for (int b = 0; b < nb; ++b) {
      const int64_t valid = std::min<int64_t>(16, M - (t0 + b) * 16);
      for (int a = 0; a < na; ++a) {
        __m512 v[16];
        for (int o = 0; o < 16; ++o) v[o] = _mm512_load_ps(c + (a * 2 + b) * 256 + o * 16);
        transpose16(v);
        float* out = y + (t0 + b) * 16 * ldy + a * 16;
        for (int64_t j = 0; j < valid; ++j) _mm512_mask_storeu_ps(out + j * ldy, keep[a], v[j]);
      }
    }
  }
}

// The LoRA's products on tiles (lora.cpp bf16_lora): y [M, N] (+)= x [Mp, K] W, W one of lora.py's bf16 panel stacks
// ([ceil(N / 32)][K / 2][32][2]: a k-pair row is 128 bytes, half of it one tile row). Here the roles are the usual
// ones: A = 16 rows of x (bf16, row-major, row stride ldx), B = 16 k-pairs of 16 outputs, so C holds y's rows as
// they are (no transpose); each C element sums its own row over K (exact batching). C goes through a small buffer so
// that rows past M and outputs past N are never written.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void amx_bf16_panels(const uint16_t* x, int64_t ldx, int64_t M,
                                                                          int64_t K, const uint16_t* w, int64_t N,
                                                                          float* y, int64_t ldy, bool accumulate) {
  const int64_t T = (M + 15) / 16, C = (N + 31) / 32;
  at::parallel_for(0, T * C, 1, [&](int64_t i0, int64_t i1) {
    AmxTiles tiles;
    alignas(64) float c[2][16][16];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / C, p = i % C;
      const uint16_t* xs = x + t * 16 * ldx;
      const uint16_t* wp = w + p * K * 32;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, xs + k, 2 * ldx);
        _tile_loadd(6, wp + k * 32, 128);       // k-pairs k / 2 .. + 16, outputs 0 .. 16 of the panel
        _tile_loadd(7, wp + k * 32 + 32, 128);  // outputs 16 .. 32
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      for (int j = 0; j < 2; ++j) {
        const int64_t n0 = p * 32 + j * 16, left = std::min<int64_t>(16, N - n0);
        if (left <= 0) break;
        const __mmask16 keep = static_cast<__mmask16>((1u << left) - 1);
        for (int64_t r = 0; r < std::min<int64_t>(16, M - t * 16); ++r) {
          float* out = y + (t * 16 + r) * ldy + n0;
          __m512 v = _mm512_load_ps(c[j][r]);
          if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, out), v);
          _mm512_mask_storeu_ps(out, keep, v);
        }
      }
    }
  });
}
