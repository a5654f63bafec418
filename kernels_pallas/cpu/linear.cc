// out = x @ w for the CPU, float32, with w packed once into column panels: an XLA FFI custom call.
//
// XLA's CPU dot (Eigen) repacks its weight operand into cache-sized blocks on every call. A decode
// step multiplies a few rows by every weight of the model, so that repacking reads and writes each
// weight again, every step: a 16-row step spent about as long in matmuls as a 64-row one. Here the
// weight is packed once, when the model is loaded, into panels of kPanel columns, [panels][K][kPanel]
// (kernels_pallas/cpu/kernel.py: pack_columns), which the kernel streams exactly once per call, each
// panel through registers for every row of x.
//
// The micro-kernel keeps a tile of up to kRows rows by kTilePanels panels of out in vector registers
// and walks K: per k, one broadcast of x per row and one load of w per vector, an FMA per pair
// (AVX-512: a 12 x 32 tile in 24 of 32 registers; AVX2: 6 x 16 in 12 of 16). The rows are split
// into tiles of equal height (16 rows: 6 + 5 + 5, not 6 + 6 + 4) because a tile of few rows costs
// about as much per k as a full one: its few accumulators wait on the FMA latency.
//
// Work items are kTilePanels panels each, shared out over threads in runs of consecutive items
// (common.h: ItemRuns). For decode-sized M the first row tile of an item would wait on memory and the
// later ones compute from cache, leaving memory idle; instead each thread claims its next item before
// working on this one, and every row tile software-prefetches its share of the next item's panels, a
// line every few k, so that memory streams at an even rate under the FMAs (scripts/bench_matmul_cpu.py,
// 16 rows: 39 -> 30 ms on the machine of the time; without the prefetch, in runs, 16.6 against 10.7
// ms on the 2-core AMD EPYC).

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "linear_amx.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using paged_jax::kLanes;
using paged_jax::Load;
using paged_jax::Vec;

constexpr int kPanel = 16;  // columns per packed panel: the packed format, whatever the vector width
// A tile of out in registers: AVX-512 has 32 vector registers, AVX2 16.
constexpr int kRows = kLanes == 16 ? 12 : 6, kTilePanels = kLanes == 16 ? 2 : 1;
constexpr int kVecsPerPanel = kPanel / kLanes;
// From this many rows, the tile unit where the CPU has one (linear_amx.h). Below, each split weight is
// shared by too few rows to pay for its split: on the Xeon of linear_amx.h, 32 rows took 47 ms
// against the FMA kernel's 36, 48 rows 51-55 against 47-49, 64 rows 56-64 against 57-66, 128 rows
// 78-81 against 102-107 (bench_matmul_cpu.py --fma, 30 layers).
constexpr int64_t kAmxMinRows = 64;

// out[0:MR, 0:n_valid] = x[0:MR, :] @ the NP panels at w; rows of x are ldx apart, of out ldo apart.
// Meanwhile prefetches its share of the next item.
template <int MR, int NP>
void Tile(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo, int64_t n_valid,
          paged_jax::TilePrefetch next) {
  constexpr int V = NP * kVecsPerPanel;
  Vec acc[MR][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    next.Step(k);
    Vec wv[V];
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j)
      wv[j] = Load(w + (j / kVecsPerPanel) * K * kPanel + k * kPanel + (j % kVecsPerPanel) * kLanes);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const float xs = x[m * ldx + k];
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[m][j] += xs * wv[j];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < V; ++j) {
      float* dst = out + m * ldo + j * kLanes;
      if ((j + 1) * kLanes <= n_valid)
        paged_jax::Store(dst, acc[m][j]);
      else  // the padding columns of the last panel are never stored
        for (int l = 0; j * kLanes + l < n_valid; ++l) dst[l] = acc[m][j][l];
    }
}

// Tile<rows, NP> for a run-time rows in [1, kRows].
template <int NP, int MR = 1>
void TileRows(int rows, const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
              int64_t n_valid, paged_jax::TilePrefetch next) {
  if constexpr (MR <= kRows) {
    if (rows == MR) return Tile<MR, NP>(x, ldx, w, K, out, ldo, n_valid, next);
    TileRows<NP, MR + 1>(rows, x, ldx, w, K, out, ldo, n_valid, next);
  }
}

ffi::Error LinearF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  const int64_t K = xd[1], P = wd[0], N = od[1];
  if (wd[1] != K || wd[2] != kPanel || od[0] != xd[0] || (N + kPanel - 1) / kPanel != P)
    return ffi::Error::InvalidArgument("linear: x [M, K], packed w [ceil(N / 16), K, 16] and out [M, N] disagree");
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  float* outs = out->typed_data();
  const int64_t M = paged_jax::ComputedRows(rows, xd[0], outs, N);
  if (M == 0) return ffi::Error::Success();
#if PAGED_JAX_AMX
  static_assert(paged_jax::amx::kItemPanels == kTilePanels, "both kernels share the work items' width");
  if (M >= kAmxMinRows && paged_jax::amx::Linear(pool, xs, ws, outs, M, K, P, N))
    return ffi::Error::Success();
#endif
  const int64_t items = (P + kTilePanels - 1) / kTilePanels;
  const int64_t tiles = (M + kRows - 1) / kRows;
  paged_jax::ItemRuns runs(items, paged_jax::Sharers(pool, items, M));
  auto work = [&] {
    int64_t end = 0;
    for (int64_t i = runs.Next(-1, &end), after; i < items; i = after) {
      after = runs.Next(i, &end);
      const int64_t p = i * kTilePanels, n = p * kPanel;
      const float* wi = ws + p * K * kPanel;  // these panels stay in cache while every row passes
      const float* wa = ws + after * kTilePanels * K * kPanel;
      const bool prefetch = after < items && M >= paged_jax::kPrefetchRows;
      const int pa = prefetch ? (int)std::min<int64_t>(kTilePanels, P - after * kTilePanels) : 0;
      for (int64_t t = 0, m = 0, rows; t < tiles; ++t, m += rows) {
        rows = M / tiles + (t < M % tiles);
        const paged_jax::TilePrefetch next(wa, pa, K, t, tiles);  // a panel's line: one k's kPanel floats
        if (P - p >= kTilePanels)
          TileRows<kTilePanels>((int)rows, xs + m * K, K, wi, K, outs + m * N + n, N, N - n, next);
        else  // an odd last panel
          TileRows<1>((int)rows, xs + m * K, K, wi, K, outs + m * N + n, N, N - n, next);
      }
    }
  };
  paged_jax::RunShared(pool, items, work, M);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearCpuF32, LinearF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether the tile kernel runs where it can (linear_amx.h); whether it can: 1 if this build has it and
// the OS lends the tile unit.
extern "C" void PagedJaxCpuAmx(int on) {
#if PAGED_JAX_AMX
  paged_jax::amx::on.store(on != 0);
#endif
}
extern "C" int PagedJaxCpuAmxUsable() {
#if PAGED_JAX_AMX
  return paged_jax::amx::Usable();
#else
  return 0;
#endif
}
