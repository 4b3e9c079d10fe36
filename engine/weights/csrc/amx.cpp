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

// Every tile 16 rows x 64 bytes. 0-2: C (16 outputs x 16 rows fp32, one per 16-row tile of x); 3-5: B (x's 16 rows
// as 16 k-pairs); 6: A (16 outputs x 32 k of bf16 weights).
TileConfig make_config() {
  TileConfig c;
  for (int t = 0; t < 7; ++t) c.rows[t] = 16, c.colsb[t] = 64;
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

// C tiles of NT 16-row tiles of x (xt, [NT][K / 2][16][2]) against the block's weights wb [16][K], into c [NT][16][16]
template <int NT>
__attribute__((target("amx-tile,amx-bf16"))) void bf16_tiles(const uint16_t* wb, const uint16_t* xt, int64_t K,
                                                             float* c) {
  const int64_t P = K / 2;
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NT > 2) _tile_zero(2);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(6, wb + k, 2 * K);
    _tile_loadd(3, xt + (0 * P + k / 2) * 32, 64);
    _tile_dpbf16ps(0, 6, 3);
    if constexpr (NT > 1) {
      _tile_loadd(4, xt + (1 * P + k / 2) * 32, 64);
      _tile_dpbf16ps(1, 6, 4);
    }
    if constexpr (NT > 2) {
      _tile_loadd(5, xt + (2 * P + k / 2) * 32, 64);
      _tile_dpbf16ps(2, 6, 5);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NT > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NT > 2) _tile_stored(2, c + 512, 64);
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

void amx_bf16_rows(const uint16_t* xb, int64_t M, int64_t K, uint16_t* xt) {
  const uint32_t* src = reinterpret_cast<const uint32_t*>(xb);  // a k-pair = one dword
  uint32_t* dst = reinterpret_cast<uint32_t*>(xt);
  const int64_t P = K / 2;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t p = 0; p < P; ++p) dst[((r / 16) * P + p) * 16 + r % 16] = src[r * P + p];
}

__attribute__((target("avx512f"))) void amx_bf16_block(const uint16_t* wb, const uint16_t* xt, int64_t M, int64_t K,
                                                       float* y, int64_t ldy, uint16_t keep) {
  alignas(64) float c[3 * 256];
  const int64_t T = (M + 15) / 16, P = K / 2;
  const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(16));
  for (int64_t t0 = 0; t0 < T; t0 += 3) {
    const int64_t nt = std::min<int64_t>(3, T - t0);
    const uint16_t* xs = xt + t0 * P * 32;
    if (nt == 1) bf16_tiles<1>(wb, xs, K, c);
    else if (nt == 2) bf16_tiles<2>(wb, xs, K, c);
    else bf16_tiles<3>(wb, xs, K, c);
    for (int64_t r = t0 * 16; r < std::min<int64_t>(M, (t0 + nt) * 16); ++r) {  // row r of y = column r of C
      const int64_t i = r - t0 * 16;
      const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32(i % 16)), c + (i / 16) * 256, 4);
      _mm512_mask_storeu_ps(y + r * ldy, keep, v);
    }
  }
}
