// The AMX micro-kernels (src/kernels/cpu/amx.h) on CPUs without AMX, for tests only: this file
// compiles src/kernels/cpu/amx_tiles.cc itself with its six tile instructions (ldtilecfg,
// tilerelease, tileloadd, tilestored, tilezero, tdpbf16ps) replaced by a plain C++ model of
// them, and its AVX-512 code (the scale pass, pack_probs, the rescale) running natively. The
// test binary that links it (tests/amx_emulated/) resolves qkv::amx's functions here before it
// reaches libqkv_attention.a, so the archive's amx.o and amx_tiles.o are never pulled in and
// the flash kernel's AMX path runs end to end: its staging, packing, deferred scale and key ends
// on any CPU with AVX512-BF16 (Zen 4 included), under ASan and TSan too.
//
// The model follows the Intel SDM's pseudo-code: a tile is `rows` rows of `colsb` bytes from
// the configuration, loads and stores touch exactly those bytes (so ASan sees what the
// hardware would read), tdpbf16ps adds each bf16 pair's two products in order in f32 with
// round-to-nearest-even, bf16 subnormal inputs read as zero and subnormal results flush to
// zero. What the hardware would fault on (a tile used with no configuration loaded, shapes that
// do not chain, a bad configuration) aborts with a message: a test that crashes fails.
// Its rounding is one reading of the SDM, not measured against a chip: this binary checks the
// path's logic against the reference within DESIGN.md's bf16 tolerance, not the hardware's bits.
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/bf16_dot.h"

namespace qkv::amx::emulated {
namespace {

constexpr int kTiles = 8;
constexpr int kMaxRows = 16;
constexpr int kMaxColsb = 64;

// One thread's tile state, as the hardware keeps it per logical CPU (XTILECFG, XTILEDATA).
struct TileState {
  bool configured = false;
  int rows[kTiles] = {};
  int colsb[kTiles] = {};
  alignas(64) unsigned char data[kTiles][kMaxRows][kMaxColsb] = {};
};

thread_local TileState t_state;

[[noreturn]] void Fault(const char* what, int tile) {
  std::fprintf(stderr, "qkv AMX emulator: %s (tile %d): the hardware would fault here\n", what,
               tile);
  std::abort();
}

// A configured tile's index, checked.
int Tile(int t) {
  if (!t_state.configured) Fault("tile instruction with no tile configuration loaded", t);
  if (t < 0 || t >= kTiles || t_state.rows[t] == 0 || t_state.colsb[t] == 0) {
    Fault("tile not configured", t);
  }
  return t;
}

// bf16 bits to f32 with denormals read as zero (the SDM's make_fp32 under DAZ).
float Bf16ToF32(std::uint16_t bits) {
  if ((bits & 0x7f80u) == 0) bits &= 0x8000u;
  const std::uint32_t word = static_cast<std::uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &word, sizeof(x));
  return x;
}

float FlushDenormal(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
}

}  // namespace

void LoadConfig(const void* config) {
  unsigned char bytes[64];
  std::memcpy(bytes, config, sizeof(bytes));
  if (bytes[0] != 1) Fault("palette other than 1", -1);
  if (bytes[1] != 0) Fault("start_row not 0", -1);
  for (int i = 2; i < 16; ++i) {
    if (bytes[i] != 0) Fault("reserved configuration byte not 0", -1);
  }
  for (int t = 0; t < 16; ++t) {
    std::uint16_t colsb;
    std::memcpy(&colsb, bytes + 16 + 2 * t, sizeof(colsb));
    const int rows = bytes[48 + t];
    if (t >= kTiles) {
      if (colsb != 0 || rows != 0) Fault("tiles past 8 configured", t);
      continue;
    }
    if (rows > kMaxRows || colsb > kMaxColsb || colsb % 4 != 0) Fault("tile shape", t);
    if ((rows == 0) != (colsb == 0)) Fault("tile with rows but no bytes, or bytes but no rows", t);
    t_state.rows[t] = rows;
    t_state.colsb[t] = colsb;
  }
  t_state.configured = true;
  std::memset(t_state.data, 0, sizeof(t_state.data));  // ldtilecfg zeroes the tile data
}

void Release() { t_state = TileState{}; }

void Load(int dst, const void* base, long stride) {
  const int t = Tile(dst);
  std::memset(t_state.data[t], 0, sizeof(t_state.data[t]));
  for (int r = 0; r < t_state.rows[t]; ++r) {
    std::memcpy(t_state.data[t][r], static_cast<const unsigned char*>(base) + r * stride,
                t_state.colsb[t]);
  }
}

void Store(int src, void* base, long stride) {
  const int t = Tile(src);
  for (int r = 0; r < t_state.rows[t]; ++r) {
    std::memcpy(static_cast<unsigned char*>(base) + r * stride, t_state.data[t][r],
                t_state.colsb[t]);
  }
}

void Zero(int dst) {
  const int t = Tile(dst);
  std::memset(t_state.data[t], 0, sizeof(t_state.data[t]));
}

// C[m][n] += sum over k of A[m] pair k . B[k] pair n (M = C's rows, N = C's colsb / 4,
// K = A's colsb / 4 = B's rows).
void DotBf16(int dst, int src1, int src2) {
  const int c = Tile(dst), a = Tile(src1), b = Tile(src2);
  if (c == a || c == b || a == b) Fault("tdpbf16ps with a tile used twice", dst);
  const int m_rows = t_state.rows[c], n_cols = t_state.colsb[c] / 4;
  const int k_pairs = t_state.colsb[a] / 4;
  if (t_state.rows[a] != m_rows || t_state.colsb[b] != t_state.colsb[c] ||
      t_state.rows[b] != k_pairs) {
    Fault("tdpbf16ps shapes do not chain", dst);
  }
  for (int m = 0; m < m_rows; ++m) {
    float acc[kMaxColsb / 4];
    std::memcpy(acc, t_state.data[c][m], sizeof(acc));
    for (int k = 0; k < k_pairs; ++k) {
      std::uint16_t a_pair[2], b_row[kMaxColsb / 2];
      std::memcpy(a_pair, t_state.data[a][m] + 4 * k, sizeof(a_pair));
      std::memcpy(b_row, t_state.data[b][k], sizeof(b_row));
      const float a0 = Bf16ToF32(a_pair[0]), a1 = Bf16ToF32(a_pair[1]);
      for (int n = 0; n < n_cols; ++n) {
        acc[n] = FlushDenormal(acc[n] + a0 * Bf16ToF32(b_row[2 * n]));
        acc[n] = FlushDenormal(acc[n] + a1 * Bf16ToF32(b_row[2 * n + 1]));
      }
    }
    std::memcpy(t_state.data[c][m], acc, sizeof(acc));
  }
}

}  // namespace qkv::amx::emulated

// amx_tiles.cc's tile instructions, routed to the model above (its other intrinsics stay).
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) ::qkv::amx::emulated::LoadConfig(config)
#define _tile_release() ::qkv::amx::emulated::Release()
#define _tile_loadd(dst, base, stride) ::qkv::amx::emulated::Load(dst, base, stride)
#define _tile_stored(src, base, stride) ::qkv::amx::emulated::Store(src, base, stride)
#define _tile_zero(dst) ::qkv::amx::emulated::Zero(dst)
#define _tile_dpbf16ps(dst, src1, src2) ::qkv::amx::emulated::DotBf16(dst, src1, src2)

#include "kernels/cpu/amx_tiles.cc"

// amx.cc's two functions: "available" here means the CPU runs amx_tiles.cc's AVX-512 code.
namespace qkv::amx {
namespace {
std::atomic<bool> g_enabled{true};
}  // namespace

bool available() { return bf16dot::cpu_supported() && g_enabled.load(std::memory_order_relaxed); }

void set_enabled(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }

}  // namespace qkv::amx
