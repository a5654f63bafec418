// A LoRA delta for a step of few rows, each row by its own slot's adapter: two XLA FFI custom calls
// around the base matmul (linear.cc), x @ A (LoraShrinkF32) before it and + h @ B (LoraExpandF32) after.
//
// A decode step's rows name different adapters. Multiplying every row by every slot's A and keeping
// each row's own with a one-hot mask cost an XLA op per fused projection (some 120 a step), and every
// slot's B rows then met that mask's zeros inside linear.cc's tiles: max_loras times the arithmetic of
// the delta. Here each slot's rows are gathered and multiplied by that slot's A and B alone. Kernels of
// their own, apart from linear.cc: a second caller of its tiles changed how the compiler inlined them
// into the base matmul, and the base matmul must stay the code it is without adapters.

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

// h[m, g, s * r:][:r] = (x[m] @ A_s)[g * r:][:r] for s = slot[m] >= 0, zeros elsewhere (the layout XLA's
// form of the delta takes too, lora_packed.Addend.added_to): x [M, K] f32,
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

// outs[m][0:n_valid] += h[m * ldh:][:r] @ the [r, kPanel] rows at w, for MR rows.
template <int MR>
void Expand(const float* h, int64_t ldh, int64_t r, const float* w, float* const* outs, int64_t n_valid) {
  Vec acc[MR][kVecsPerPanel] = {};
  for (int64_t k = 0; k < r; ++k) {
    Vec wv[kVecsPerPanel];
    for (int j = 0; j < kVecsPerPanel; ++j) wv[j] = Load(w + k * kPanel + j * kLanes);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < kVecsPerPanel; ++j) acc[m][j] += h[m * ldh + k] * wv[j];
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kVecsPerPanel; ++j)
      if ((j + 1) * kLanes <= n_valid)
        paged_jax::Store(outs[m] + j * kLanes, Load(outs[m] + j * kLanes) + acc[m][j]);
      else  // the padding columns of the last panel are not out's
        for (int l = 0; j * kLanes + l < n_valid; ++l) outs[m][j * kLanes + l] += acc[m][j][l];
}

// Expand<rows> for a run-time rows in [1, kRows].
template <int MR = 1>
void ExpandRows(int rows, const float* h, int64_t ldh, int64_t r, const float* w, float* const* outs,
                int64_t n_valid) {
  if constexpr (MR <= kRows) {
    if (rows == MR) return Expand<MR>(h, ldh, r, w, outs, n_valid);
    ExpandRows<MR + 1>(rows, h, ldh, r, w, outs, n_valid);
  }
}

// out = base plus each row's own slot's B product: out[m, 16 p:][:16] += h[m, group[p], s * r:][:r] @
// b[p, s] for s = slot[m] >= 0. base, out [M, N] f32 (one buffer: aliased); h [M, G, S * r] f32 (as
// LoraShrinkF32 gives it); b [ceil(N / 16), S, r, 16] f32; group [P] int32 in [0, G); slot [M] int32 in
// [-1, S). Rows past `rows` are base's. A work item is one slot's panel, which only that slot's rows
// multiply: no other slot's zeros, as a one-hot h against every slot's B would.
ffi::Error LoraExpandF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> base, ffi::Buffer<ffi::F32> h,
                         ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::S32> group, ffi::Buffer<ffi::S32> slot,
                         ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out) {
  const auto od = base.dimensions(), hd = h.dimensions(), bd = b.dimensions(), rd = out->dimensions();
  if (od.size() != 2 || hd.size() != 3 || bd.size() != 4 || hd[0] != od[0] || bd[0] != (od[1] + kPanel - 1) / kPanel ||
      hd[2] != bd[1] * bd[2] || bd[3] != kPanel || group.element_count() != bd[0] || slot.element_count() != od[0] ||
      rd[0] != od[0] || rd[1] != od[1])
    return ffi::Error::InvalidArgument(
        "lora_expand: base [M, N], h [M, G, S * r], b [ceil(N / 16), S, r, 16], group [P] and slot [M] disagree");
  const int64_t N = od[1], G = hd[1], P = bd[0], S = bd[1], r = bd[2];
  const int32_t *slots = slot.typed_data(), *groups = group.typed_data();
  for (int64_t p = 0; p < P; ++p)
    if (groups[p] < 0 || groups[p] >= G) return ffi::Error::InvalidArgument("lora_expand: a group out of range");
  for (int64_t m = 0; m < od[0]; ++m)
    if (slots[m] < -1 || slots[m] >= S) return ffi::Error::InvalidArgument("lora_expand: a slot out of range");
  float* outs = out->typed_data();
  if (outs != base.typed_data()) std::copy_n(base.typed_data(), od[0] * N, outs);
  const int64_t M = std::clamp<int64_t>(rows.element_count() > 0 ? rows.typed_data()[0] : od[0], 0, od[0]);
  // As in LoraShrinkF32: the rows in slot order, each row's own activations gathered [G, r].
  std::vector<int64_t> picked, first(S + 1, 0);
  for (int32_t s = 0; s < S; ++s, first[s] = (int64_t)picked.size())
    for (int64_t m = 0; m < M; ++m)
      if (slots[m] == s) picked.push_back(m);
  if (picked.empty()) return ffi::Error::Success();
  std::vector<float> hg(picked.size() * G * r);
  for (size_t i = 0; i < picked.size(); ++i)
    for (int64_t g = 0; g < G; ++g)
      std::copy_n(h.typed_data() + (picked[i] * G + g) * S * r + slots[picked[i]] * r, r, hg.data() + (i * G + g) * r);
  const int64_t items = S * P;
  paged_jax::ItemRuns runs(items, paged_jax::Sharers(pool, items, M));
  auto work = [&] {
    int64_t end = 0;
    for (int64_t i = runs.Next(-1, &end); i < items; i = runs.Next(i, &end)) {
      // Item i is b's i-th [r, 16] block: the items' runs read b in order, which the prefetchers follow.
      const int64_t s = i % S, p = i / S, count = first[s + 1] - first[s], tiles = (count + kRows - 1) / kRows;
      const float* w = b.typed_data() + i * r * kPanel;
      for (int64_t t = 0, m = first[s], n; t < tiles; ++t, m += n) {
        n = count / tiles + (t < count % tiles);
        float* row_out[kRows];
        for (int64_t j = 0; j < n; ++j) row_out[j] = outs + picked[m + j] * N + p * kPanel;
        ExpandRows((int)n, hg.data() + (m * G + groups[p]) * r, G * r, r, w, row_out, N - p * kPanel);
      }
    }
  };
  paged_jax::RunShared(pool, items, work, M);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(LoraExpandCpuF32, LoraExpandF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
