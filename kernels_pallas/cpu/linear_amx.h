// linear.cc's float32 matmul on the tile unit of CPUs with AMX (Intel Sapphire Rapids and later), at
// float32's accuracy.
//
// A float32 is exactly the sum of three bfloat16: hi, mid and lo, 8 significand bits each (Split). So
// x @ w is the sum of nine products of parts, of which the six largest are kept (x_hi w_hi, x_hi w_mid,
// x_hi w_lo, x_mid w_hi, x_mid w_mid, x_lo w_hi): the three left out are below 2^-23 of each product,
// float32's own rounding. TDPBF16PS multiplies bfloat16 pairs exactly and sums in float32, so the
// result is a float32 matmul's to within a few ulps, as another order of its sums would be
// (tests/kernels/test_cpu_linear.py holds both kernels to the float64 product). A core's tile unit
// does the six products faster than its AVX-512 FMAs do one, once rows are many enough to share each
// split weight (linear.cc: kAmxMinRows): SmolLM2's matmuls 1.4 to 1.6 times as fast from 128 rows
// up on a 2-core Xeon (family 6, model 167; scripts/bench_matmul_cpu.py --fma).
//
// The six products are one bfloat16 matmul over a K six times as long, blocked as a plain one: tiles
// of 16 x 16 sums, 2 x 2 of them (4 chains of TDPBF16PS that overlap), fed by two tiles of x and two of
// w, which reach the unit fast only from L1 and only from 64-byte aligned rows. x is split once a
// call, shared out over the threads, into [row pair][k chunk][part][tile][16 rows][32 k] bfloat16: a
// row pair's chunk is 6 KB read in order. Each work item's weights (kTilePanels float32 panels) are
// split as the item starts into a per-thread scratch, in the pairs layout TDPBF16PS reads, which the
// row pairs then share, a few items at a time: the weights stay float32 in memory, read once, and no
// second copy of the model is kept.

#ifndef PAGED_JAX_CPU_LINEAR_AMX_H_
#define PAGED_JAX_CPU_LINEAR_AMX_H_

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BW__)
#define PAGED_JAX_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <thread>

#include "common.h"

namespace paged_jax::amx {

constexpr int kDepth = 32;  // k per tile: 16 pairs of bfloat16, a 64-byte row
constexpr int kTile = 16;   // rows of x, and columns of w, per tile
constexpr int kPair = 2 * kTile;
constexpr int kParts = 3;  // hi, mid, lo
constexpr int kProducts = 6;
constexpr int kXPart[kProducts] = {0, 0, 0, 1, 1, 2}, kWPart[kProducts] = {0, 1, 2, 0, 1, 0};
constexpr int64_t kTileWords = kTile * kDepth;
constexpr int64_t kGroupBytes = 512 << 10;  // split weights kept in L2 at once (Linear)
constexpr int kMaxGroup = 8;                 // items a group at most
constexpr int kItemPanels = 2;               // 16-column panels a work item: linear.cc's kTilePanels

// Off: the FMA kernel at every size (kernel.py: use_amx, PAGED_JAX_CPU_AMX=0), for comparing the two.
inline std::atomic<bool> on{true};

// Linux lends a process the tile registers' state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); where it refuses, the FMA kernel runs.
inline bool Usable() {
  static const bool usable = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return usable;
}

// Every tile 16 rows of 64 bytes: 0-3 the sums, 4-5 x's two row tiles, 6-7 w's two panels. Per thread.
inline void Configure() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = kTile;
  _tile_loadconfig(&config);
}

// A growing per-thread buffer of 64-byte aligned bfloat16 (`which` tells a thread's buffers apart).
inline uint16_t* Scratch(int which, int64_t words) {
  struct Buffer {
    std::unique_ptr<uint16_t[], decltype(&std::free)> data{nullptr, &std::free};
    int64_t words = 0;
  };
  thread_local Buffer buffers[2];
  Buffer& buffer = buffers[which];
  if (buffer.words < words) {
    buffer.data.reset(static_cast<uint16_t*>(std::aligned_alloc(64, (words * 2 + 63) / 64 * 64)));
    buffer.words = words;
  }
  return buffer.data.get();
}

// The three bfloat16 parts of 16 floats, as float32 bit patterns whose low halves are zero: hi is v
// cut to 8 significand bits, v - hi is exact, and so on down, so hi + mid + lo == v.
inline void Split(__m512 v, __m512i parts[kParts]) {
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  parts[0] = _mm512_and_si512(_mm512_castps_si512(v), high);
  __m512 rest = _mm512_sub_ps(v, _mm512_castsi512_ps(parts[0]));
  asm("" : "+v"(rest));  // under -ffast-math, (v - hi) - mid could become v - (hi + mid): not exact
  parts[1] = _mm512_and_si512(_mm512_castps_si512(rest), high);
  parts[2] = _mm512_castps_si512(_mm512_sub_ps(rest, _mm512_castsi512_ps(parts[1])));
}

// Row pair q of x [M, K] -> its [k chunk][part][tile][16][32] of xs; zeros past M and K.
inline void SplitRows(const float* x, int64_t M, int64_t K, int64_t Kt, uint16_t* xs, int64_t q) {
  static const __m512i pick = [] {  // the high halves of two vectors' 32-bit words: words 1, 3, ..., 63
    uint16_t odd[32];
    for (int i = 0; i < 32; ++i) odd[i] = (uint16_t)(2 * i + 1);
    return _mm512_loadu_si512(odd);
  }();
  const int64_t chunks = Kt / kDepth;
  const auto mask = [&](int64_t m, int64_t from) -> __mmask16 {
    return m >= M || from >= K ? 0 : K - from >= 16 ? 0xFFFF : (1u << (K - from)) - 1;
  };
  for (int64_t m = q * kPair; m < (q + 1) * kPair; ++m) {
    const float* row = x + std::min(m, M - 1) * K;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = c * kDepth;
      __m512i lo[kParts], hi[kParts];
      Split(_mm512_maskz_loadu_ps(mask(m, k), row + std::min(k, K)), lo);
      Split(_mm512_maskz_loadu_ps(mask(m, k + 16), row + std::min(k + 16, K)), hi);
      uint16_t* dst = xs + ((q * chunks + c) * kParts * 2 + (m % kPair) / kTile) * kTileWords + (m % kTile) * kDepth;
      for (int p = 0; p < kParts; ++p)
        _mm512_store_si512(dst + p * 2 * kTileWords, _mm512_permutex2var_epi16(lo[p], pick, hi[p]));
    }
  }
}

// np float32 panels [K][16], K * 16 apart -> ws [k chunk][part][panel][16 pairs of k][16 columns x 2]:
// row r of a tile holds, per column, k = 2r and 2r + 1 side by side, as TDPBF16PS reads w.
inline void SplitPanels(const float* w, int np, int64_t K, int64_t Kt, uint16_t* ws) {
  for (int64_t c = 0; c < Kt / kDepth; ++c)
    for (int j = 0; j < np; ++j)
      for (int r = 0; r < kDepth / 2; ++r) {
        const int64_t k = c * kDepth + 2 * r;
        const float* panel = w + j * K * kTile;
        __m512i even[kParts], odd[kParts];
        Split(k < K ? _mm512_loadu_ps(panel + k * kTile) : _mm512_setzero_ps(), even);
        Split(k + 1 < K ? _mm512_loadu_ps(panel + (k + 1) * kTile) : _mm512_setzero_ps(), odd);
        for (int p = 0; p < kParts; ++p)
          _mm512_store_si512(ws + ((c * kParts + p) * np + j) * kTileWords + r * kDepth,
                             _mm512_or_si512(_mm512_srli_epi32(even[p], 16), odd[p]));
      }
}

// sums [TR * 16][NP * 16] = row pair q of xs (its first TR tiles) @ the item's split weights ws.
template <int TR, int NP>
void Tiles(const uint16_t* xs, int64_t Kt, int64_t q, const uint16_t* ws, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t chunks = Kt / kDepth;
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* x = xs + (q * chunks + c) * kParts * 2 * kTileWords;
    const uint16_t* w = ws + c * kParts * NP * kTileWords;
#pragma GCC unroll 6
    for (int s = 0; s < kProducts; ++s) {
      // Each load goes to a tile the previous product has done with: tiles are not renamed. x's part
      // stays for the products in a row that use it (3 of x's 6 loads a chunk saved).
      const uint16_t* xa = x + kXPart[s] * 2 * kTileWords;
      const uint16_t* wb = w + kWPart[s] * NP * kTileWords;
      const bool new_x = s == 0 || kXPart[s] != kXPart[s - 1];
      if (new_x) _tile_loadd(4, xa, 64);
      _tile_loadd(6, wb, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NP == 2) {
        _tile_loadd(7, wb + kTileWords, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if constexpr (TR == 2) {
        if (new_x) _tile_loadd(5, xa + kTileWords, 64);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (NP == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  constexpr int64_t stride = NP * kTile * sizeof(float);
  _tile_stored(0, sums, stride);
  if constexpr (NP == 2) _tile_stored(1, sums + kTile, stride);
  if constexpr (TR == 2) _tile_stored(2, sums + kTile * NP * kTile, stride);
  if constexpr (TR == 2 && NP == 2) _tile_stored(3, sums + kTile * NP * kTile + kTile, stride);
}

// x [M, K] @ w (P float32 panels [K][16]), in work items of kItemPanels panels shared out over threads
// as linear.cc's FMA kernel does, each thread handing its tiles of the product to a sink of its own,
// new_sink() (linear.cc: Store, which writes out [M, N], or Argmax). False, having done nothing, where
// the OS refuses AMX.
template <typename NewSink>
bool Linear(xla::ffi::ThreadPool& pool, const float* x, const float* w, int64_t M, int64_t K, int64_t P, int64_t N,
            NewSink& new_sink) {
  if (!on.load() || !Usable()) return false;
  const int64_t pairs = (M + kPair - 1) / kPair, Kt = (K + kDepth - 1) / kDepth * kDepth;
  const int64_t items = (P + kItemPanels - 1) / kItemPanels;
  uint16_t* xs = Scratch(0, pairs * kPair * kParts * Kt);  // the caller's: the others write it too
  std::atomic<int64_t> next_pair{0}, split_pairs{0};
  ItemRuns runs(items, Sharers(pool, items, M));
  auto work = [&] {
    // First the rows, split by whichever threads have come; then every thread waits for all of them.
    for (int64_t q; (q = next_pair.fetch_add(1)) < pairs; split_pairs.fetch_add(1, std::memory_order_release))
      SplitRows(x, M, K, Kt, xs, q);
    while (split_pairs.load(std::memory_order_acquire) < pairs) std::this_thread::yield();
    auto sink = new_sink();
    Configure();
    // Items go in groups whose split weights stay in L2 while every row pair passes them, each pair's
    // rows then read from L2 once a group rather than once an item.
    const int64_t item_words = Kt * kParts * kItemPanels * kTile;
    const int64_t group = std::clamp<int64_t>(kGroupBytes / (2 * item_words), 1, kMaxGroup);
    uint16_t* ws = Scratch(1, group * item_words);
    alignas(64) float sums[kPair * kItemPanels * kTile];
    int64_t end = 0, first[kMaxGroup];
    for (int64_t i = runs.Next(-1, &end); i < items;) {
      int64_t g = 0;
      for (; g < group && i < items; ++g, i = runs.Next(i, &end)) {
        first[g] = i * kItemPanels;
        SplitPanels(w + first[g] * K * kTile, (int)std::min<int64_t>(kItemPanels, P - first[g]), K, Kt, ws + g * item_words);
      }
      for (int64_t q = 0; q < pairs; ++q)
        for (int64_t j = 0; j < g; ++j) {
          const int64_t p = first[j], n = p * kTile, rows = std::min<int64_t>(kPair, M - q * kPair);
          const int np = (int)std::min<int64_t>(kItemPanels, P - p);
          const uint16_t* wj = ws + j * item_words;
          if (rows > kTile)
            np == 2 ? Tiles<2, 2>(xs, Kt, q, wj, sums) : Tiles<2, 1>(xs, Kt, q, wj, sums);
          else
            np == 2 ? Tiles<1, 2>(xs, Kt, q, wj, sums) : Tiles<1, 1>(xs, Kt, q, wj, sums);
          const int64_t cols = std::min<int64_t>(np * kTile, N - n);
          sink.Written(q * kPair, n, sums, np * kTile, rows, cols);
        }
    }
    _tile_release();
  };
  RunShared(pool, items, work, M);
  return true;
}

}  // namespace paged_jax::amx

#endif
#endif  // PAGED_JAX_CPU_LINEAR_AMX_H_
