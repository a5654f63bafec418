// A LoRA delta's first product for a few-row step, each row by its own slot's A: an XLA FFI custom call.
//
// A decode step's rows name different adapters. Multiplying every row by every slot's A and keeping
// each row's own with a one-hot mask cost an XLA op per fused projection (some 120 a step) and
// max_loras times the arithmetic. Here each slot's rows are gathered and multiplied by that slot's A
// alone, and the result is written straight into the layout linear.cc's linear_add takes (each row's
// activations at its slot's place, zeros elsewhere). Its own small kernel, apart from linear.cc: a
// second caller of linear.cc's tiles changed how the compiler inlined them into the base matmul.

#include <algorithm>
#include <cstdint>
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

// out[0:MR, 0:kPanel] = x[0:MR, :] @ the panel at w ([K, kPanel]); rows of x K apart, of out ldo apart.
template <int MR>
void Panel(const float* x, int64_t K, const float* w, float* out, int64_t ldo) {
  Vec acc[MR][kVecsPerPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[kVecsPerPanel];
    for (int j = 0; j < kVecsPerPanel; ++j) wv[j] = Load(w + k * kPanel + j * kLanes);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < kVecsPerPanel; ++j) acc[m][j] += x[m * K + k] * wv[j];
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kVecsPerPanel; ++j) paged_jax::Store(out + m * ldo + j * kLanes, acc[m][j]);
}

// Panel<rows> for a run-time rows in [1, kRows].
template <int MR = 1>
void PanelRows(int rows, const float* x, int64_t K, const float* w, float* out, int64_t ldo) {
  if constexpr (MR <= kRows) {
    if (rows == MR) return Panel<MR>(x, K, w, out, ldo);
    PanelRows<MR + 1>(rows, x, K, w, out, ldo);
  }
}

// h[m, g, s * r:][:r] = (x[m] @ A_s)[g * r:][:r] for s = slot[m] >= 0, zeros elsewhere: x [M, K] f32,
// a [S, Pa, K, 16] f32 (slot s's A [K, G * r], part-major, in panels: packing.py's pack_columns), slot [M]
// int32 in [-1, S), h [M, G, S * r] f32 (G * r <= Pa * 16). A work item is one slot's panel, shared out
// over threads like linear.cc's; a slot no row names is never read. Rows past `rows`: zeros.
ffi::Error LoraShrinkF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> a,
                         ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> h) {
  const auto xd = x.dimensions(), ad = a.dimensions(), hd = h->dimensions();
  if (xd.size() != 2 || ad.size() != 4 || hd.size() != 3 || ad[2] != xd[1] || ad[3] != kPanel || hd[0] != xd[0] ||
      ad[0] == 0 || hd[2] % ad[0] != 0 || hd[1] * (hd[2] / ad[0]) > ad[1] * kPanel || slot.element_count() != xd[0])
    return ffi::Error::InvalidArgument(
        "lora_shrink: x [M, K], a [S, Pa, K, 16], slot [M] and h [M, G, S * r] (G * r <= Pa * 16) disagree");
  const int64_t K = xd[1], S = ad[0], Pa = ad[1], G = hd[1], r = hd[2] / S, width = Pa * kPanel;
  const int32_t* slots = slot.typed_data();
  for (int64_t m = 0; m < xd[0]; ++m)
    if (slots[m] < -1 || slots[m] >= S) return ffi::Error::InvalidArgument("lora_shrink: a slot out of range");
  float* hs = h->typed_data();
  std::fill(hs, hs + hd[0] * G * S * r, 0.0f);
  const int64_t M = paged_jax::ComputedRows(rows, xd[0], hs, G * S * r);
  // The rows in slot order: slot s's are picked[first[s]:first[s + 1]], their rows of x gathered alike.
  std::vector<int64_t> picked, first(S + 1, 0);
  for (int32_t s = 0; s < S; ++s, first[s] = (int64_t)picked.size())
    for (int64_t m = 0; m < M; ++m)
      if (slots[m] == s) picked.push_back(m);
  if (picked.empty()) return ffi::Error::Success();
  std::vector<float> xg(picked.size() * K), part(picked.size() * width);
  for (size_t i = 0; i < picked.size(); ++i) std::copy_n(x.typed_data() + picked[i] * K, K, xg.data() + i * K);
  const int64_t items = S * Pa;
  paged_jax::ItemRuns runs(items, paged_jax::Sharers(pool, items, M));
  auto work = [&] {
    int64_t end = 0;
    for (int64_t i = runs.Next(-1, &end); i < items; i = runs.Next(i, &end)) {
      const int64_t s = i / Pa, p = i % Pa, count = first[s + 1] - first[s], tiles = (count + kRows - 1) / kRows;
      for (int64_t t = 0, m = first[s], n; t < tiles; ++t, m += n) {  // tiles of equal height, as linear.cc's
        n = count / tiles + (t < count % tiles);
        PanelRows((int)n, xg.data() + m * K, K, a.typed_data() + i * K * kPanel, part.data() + m * width + p * kPanel,
                  width);
      }
    }
  };
  paged_jax::RunShared(pool, items, work, M);
  for (int32_t s = 0; s < S; ++s)
    for (int64_t i = first[s]; i < first[s + 1]; ++i)
      for (int64_t g = 0; g < G; ++g)
        std::copy_n(part.data() + i * width + g * r, r, hs + (picked[i] * G + g) * S * r + s * r);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraShrinkCpuF32, LoraShrinkF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
