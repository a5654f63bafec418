// A LoRA delta for a step, each row by its own slot's adapter: one XLA FFI custom call after the base
// matmul (linear.cc, or any other that gives float32), adding x @ A @ B to its output in place.
//
// A decode step's rows name different adapters. Multiplying every row by every slot's A and keeping
// each row's own with a one-hot mask cost an XLA op per fused projection (some 120 a step), and every
// slot's B rows then met that mask's zeros: max_loras times the arithmetic of the delta. Here each
// slot's rows are gathered and multiplied by that slot's A and B alone. Kernels of their own, apart
// from linear.cc: a second caller of its tiles changed how the compiler inlined them into the base
// matmul, and the base matmul must stay the code it is without adapters.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using paged_jax::kLanes;
using paged_jax::Load;
using paged_jax::Vec;

constexpr int kPanel = 16;  // columns per packed panel (packing.py), whatever the vector width
constexpr int kVecsPerPanel = kPanel / kLanes;
constexpr int kRows = kLanes == 16 ? 12 : 6;  // a tile's rows: its accumulators fit the vector registers
// The rows of one slot an A panel multiplies in one work item: a prefill's hundreds of rows of one slot
// in several items, so that its few panels still share out over threads.
constexpr int64_t kChunk = 4 * kRows;
// How many 64-byte lines ahead of its reads a kernel prefetches the adapters' weights. Each work item
// is a short stretch (an A panel of 36 KB, a B panel of 1 KB at rank 16) that the hardware prefetcher
// only picks up once begun. Side by side with none in one process (SmolLM2's 30 layers of projections
// at 16 rows over 4 slots, kernels only, two loaded runs on the Xeon 6/207), 64 lines took the delta
// from 1.33-1.35x to 1.18x the base matmuls' time in median.
constexpr int64_t kAhead = 64;

// tile(m, n) for rows [from, to) in tiles of n <= kRows rows, of equal height (as linear.cc's).
template <typename Tile>
void RowTiles(int64_t from, int64_t to, Tile tile) {
  const int64_t tiles = (to - from + kRows - 1) / kRows;
  for (int64_t t = 0, m = from, n; t < tiles; ++t, m += n) {
    n = (to - from) / tiles + (t < (to - from) % tiles);
    tile(m, (int)n);
  }
}

// outs[m][0:n_valid] = (or += where kAdd) x[m * ldx:][:depth] @ the [depth, kPanel] panel at w, for MR
// rows: an A panel (depth K, into h) and a B panel (depth r, onto out) alike.
template <int MR, bool kAdd>
void PanelTile(const float* x, int64_t ldx, int64_t depth, const float* w, float* const* outs, int64_t n_valid) {
  Vec acc[MR][kVecsPerPanel] = {};
  for (int64_t k = 0; k < depth; ++k) {
    if constexpr (!kAdd)  // not into a next panel: a slot no row names
      __builtin_prefetch(w + std::min(k + kAhead, depth - 1) * kPanel);
    Vec wv[kVecsPerPanel];
    for (int j = 0; j < kVecsPerPanel; ++j) wv[j] = Load(w + k * kPanel + j * kLanes);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < kVecsPerPanel; ++j) acc[m][j] += x[m * ldx + k] * wv[j];
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kVecsPerPanel; ++j)
      if (!kAdd)
        paged_jax::Store(outs[m] + j * kLanes, acc[m][j]);
      else if ((j + 1) * kLanes <= n_valid)
        paged_jax::Store(outs[m] + j * kLanes, Load(outs[m] + j * kLanes) + acc[m][j]);
      else  // the padding columns of the last panel are not out's
        for (int l = 0; j * kLanes + l < n_valid; ++l) outs[m][j * kLanes + l] += acc[m][j][l];
}

// PanelTile<rows, kAdd> for a run-time rows in [1, kRows].
template <bool kAdd, int MR = 1>
void PanelTileRows(int rows, const float* x, int64_t ldx, int64_t depth, const float* w, float* const* outs,
              int64_t n_valid) {
  if constexpr (MR <= kRows) {
    if (rows == MR) return PanelTile<MR, kAdd>(x, ldx, depth, w, outs, n_valid);
    PanelTileRows<kAdd, MR + 1>(rows, x, ldx, depth, w, outs, n_valid);
  }
}

// Scratch that outlives a call: the calling thread's, grown to the largest step, so that a step's 120
// calls allocate nothing.
struct Scratch {
  std::vector<int64_t> picked, first, chunks;
  std::vector<float> x, h;
};

// out = base plus each row's own slot's delta: for s = slot[m] >= 0, h = x[m] @ A_s, then out[m, 16 p:][:16]
// += h[group[p] * r:][:r] @ b[p, s]. base, out [M, N] f32 (one buffer: aliased); x [M, K] f32; a [S, Pa, K,
// 16] f32 (slot s's A [K, parts * r], part-major, in panels: packing.py's pack_columns); b [ceil(N / 16), S,
// r, 16] f32; group [P] int32, (group[p] + 1) * r <= Pa * 16; slot [M] int32 in [-1, S). Rows past `rows`
// are base's. Both products in one call after the base matmul, where there were two per projection (x @ A
// before it, h @ B after), each with its fork and join and allocations, and a zeroed h scattered
// between them: side by side in one process (SmolLM2's projections at 16 rows over 4 slots, loaded
// Xeon 6/207), this call with its prefetching cut the delta by a fifth to a third. The rows are taken in slot order and each slot's
// panels multiply its rows alone, so no slot's A or B meets another's rows, and a slot no row names is
// never read. Work items: first (slot, row chunk, A panel), then, once every thread is past those,
// (B panel, slot), in b's order, which the prefetchers follow.
ffi::Error LoraF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> base, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> a,
                   ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::S32> group, ffi::Buffer<ffi::S32> slot,
                   ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out) {
  const auto od = base.dimensions(), xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  if (od.size() != 2 || xd.size() != 2 || ad.size() != 4 || bd.size() != 4 || xd[0] != od[0] || ad[2] != xd[1] ||
      ad[3] != kPanel || bd[0] != (od[1] + kPanel - 1) / kPanel || bd[1] != ad[0] || bd[3] != kPanel ||
      group.element_count() != bd[0] || slot.element_count() != od[0] || out->dimensions()[0] != od[0] ||
      out->dimensions()[1] != od[1])
    return ffi::Error::InvalidArgument(
        "lora: base [M, N], x [M, K], a [S, Pa, K, 16], b [ceil(N / 16), S, r, 16], group [P] and slot [M] disagree");
  const int64_t N = od[1], K = xd[1], S = ad[0], Pa = ad[1], P = bd[0], r = bd[2], width = Pa * kPanel;
  const int32_t *slots = slot.typed_data(), *groups = group.typed_data();
  for (int64_t p = 0; p < P; ++p)
    if (groups[p] < 0 || (groups[p] + 1) * r > width) return ffi::Error::InvalidArgument("lora: a group out of range");
  for (int64_t m = 0; m < od[0]; ++m)
    if (slots[m] < -1 || slots[m] >= S) return ffi::Error::InvalidArgument("lora: a slot out of range");
  float* outs = out->typed_data();
  if (outs != base.typed_data()) std::copy_n(base.typed_data(), od[0] * N, outs);
  const int64_t M = std::clamp<int64_t>(rows.element_count() > 0 ? rows.typed_data()[0] : od[0], 0, od[0]);
  // The rows in slot order, slot s's picked[first[s]:first[s + 1]], in chunks of kChunk: chunk c is
  // slot s's if chunks[s] <= c < chunks[s + 1]. x's rows gathered alike; h [picked, Pa * 16] their x @ A.
  static thread_local Scratch scratch;
  auto& [picked, first, chunks, xg, h] = scratch;
  picked.clear(), first.assign(S + 1, 0), chunks.assign(S + 1, 0);
  for (int32_t s = 0; s < S; ++s) {
    for (int64_t m = 0; m < M; ++m)
      if (slots[m] == s) picked.push_back(m);
    first[s + 1] = (int64_t)picked.size();
    chunks[s + 1] = chunks[s] + (first[s + 1] - first[s] + kChunk - 1) / kChunk;
  }
  const int64_t count = (int64_t)picked.size();
  if (count == 0) return ffi::Error::Success();
  if ((int64_t)xg.size() < count * K) xg.resize(count * K);
  if ((int64_t)h.size() < count * width) h.resize(count * width);
  for (int64_t i = 0; i < count; ++i) std::copy_n(x.typed_data() + picked[i] * K, K, xg.data() + i * K);
  const int64_t shrinks = chunks[S] * Pa, expands = P * S, items = std::max(shrinks, expands);
  const int64_t sharers = paged_jax::Sharers(pool, items, M);
  paged_jax::ItemRuns shrink_runs(shrinks, sharers), expand_runs(expands, sharers);
  std::atomic<int64_t> shrunk{0};
  auto work = [&] {
    int64_t end = 0, done = 0;
    for (int64_t i = shrink_runs.Next(-1, &end); i < shrinks; i = shrink_runs.Next(i, &end), ++done) {
      const int64_t c = i / Pa, p = i % Pa, s = std::upper_bound(chunks.begin(), chunks.end(), c) - chunks.begin() - 1;
      const int64_t from = first[s] + (c - chunks[s]) * kChunk, to = std::min(first[s + 1], from + kChunk);
      RowTiles(from, to, [&](int64_t m, int n) {
        float* row_h[kRows];
        for (int j = 0; j < n; ++j) row_h[j] = h.data() + (m + j) * width + p * kPanel;
        PanelTileRows<false>(n, xg.data() + m * K, K, K, a.typed_data() + (s * Pa + p) * K * kPanel, row_h, kPanel);
      });
    }
    // Every A panel before any B panel: a thread waits only for items others have taken, never for a
    // thread that has not started, which may never come.
    shrunk.fetch_add(done);
    while (shrunk.load() < shrinks) std::this_thread::yield();
    end = 0;
    for (int64_t i = expand_runs.Next(-1, &end); i < expands; i = expand_runs.Next(i, &end)) {
      const int64_t p = i / S, s = i % S;
      if (const int64_t next = i + kAhead / r; next < expands && first[next % S + 1] > first[next % S])
        for (int64_t l = 0; l < r; ++l) __builtin_prefetch(b.typed_data() + (next * r + l) * kPanel);
      RowTiles(first[s], first[s + 1], [&](int64_t m, int n) {
        float* row_out[kRows];
        for (int j = 0; j < n; ++j) row_out[j] = outs + picked[m + j] * N + p * kPanel;
        PanelTileRows<true>(n, h.data() + m * width + groups[p] * r, width, r, b.typed_data() + i * r * kPanel, row_out,
                       N - p * kPanel);
      });
    }
  };
  paged_jax::RunShared(pool, items, work, M);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraCpuF32, LoraF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
