// out = x @ w for the CPU, float32, with w packed once into column panels: an XLA FFI custom call; and
// the greedy head, each row's argmax of x @ w without writing x @ w (ArgmaxLinearF32, below).
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
#include <bit>
#include <climits>
#include <cstdint>
#include <mutex>
#include <vector>

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

// Where one thread's tiles of the product go: a tile [rows, cols] at row m, column n is written at
// Buffer(m, n, &ld) (its rows ld apart), or elsewhere by the tile unit (linear_amx.h), and then handed
// to Written.
class Store {  // the matmul's: straight into out [M, N]
 public:
  Store(float* out, int64_t N) : out_(out), N_(N) {}
  float* Buffer(int64_t m, int64_t n, int64_t* ld) const {
    *ld = N_;
    return out_ + m * N_ + n;
  }
  void Written(int64_t m, int64_t n, const float* tile, int64_t ld, int64_t rows, int64_t cols) const {
    float* to = out_ + m * N_ + n;
    if (tile != to)
      for (int64_t r = 0; r < rows; ++r) std::copy_n(tile + r * ld, cols, to + r * N_);
  }

 private:
  float* out_;
  int64_t N_;
};

// A row's largest value so far and its column (-1: none yet). Values compare as int32 keys in the
// floats' order, with -0 and +0 one value and every NaN above +inf, as jnp.argmax orders them; integer
// compares, because -ffast-math lets the compiler assume that a float is never NaN.
struct Best {
  int32_t key = 0, column = -1;
};
inline int32_t Key(float v) {
  const int32_t bits = std::bit_cast<int32_t>(v), magnitude = bits & 0x7FFFFFFF;
  return magnitude > 0x7F800000 ? INT32_MAX : bits < 0 ? -magnitude : magnitude;
}
// Key of kLanes floats at once.
typedef int32_t KeyVec __attribute__((vector_size(kLanes * sizeof(int32_t))));
inline KeyVec Keys(const float* p) {
  const KeyVec bits = (KeyVec)Load(p), sign = bits >> 31, magnitude = bits & 0x7FFFFFFF;
  const KeyVec nan = magnitude > 0x7F800000;  // all ones where NaN
  return (nan & INT32_MAX) | (~nan & ((magnitude ^ sign) - sign));
}
// Ties go to the first column, as jnp.argmax's, whatever order the threads saw them in.
inline bool Beats(int32_t key, int32_t column, const Best& best) {
  return best.column < 0 || key > best.key || (key == best.key && column < best.column);
}

// Each row's Best over all the threads' tiles.
struct Argmax {
  std::mutex mu;
  std::vector<Best> best;
};

// One thread's sink for the greedy head: per row, kLanes running bests (lane l: columns = l mod kLanes)
// kept with vector compares and blends, reduced into the shared Argmax as the thread leaves. At depth 64
// a horizontal maximum per row and tile cost 45% of the matmul (perf, 256 rows of 8,192).
class ArgmaxTiles {
 public:
  explicit ArgmaxTiles(Argmax& shared) : shared_(shared), lanes_(shared.best.size()) {
    for (int l = 0; l < kLanes; ++l) lane_[l] = l;
  }
  ArgmaxTiles(const ArgmaxTiles&) = delete;
  ~ArgmaxTiles() {
    std::lock_guard<std::mutex> lock(shared_.mu);
    for (size_t m = 0; m < lanes_.size(); ++m)
      for (int l = 0; l < kLanes; ++l)
        if (lanes_[m].column[l] >= 0 && Beats(lanes_[m].key[l], lanes_[m].column[l], shared_.best[m]))
          shared_.best[m] = {lanes_[m].key[l], lanes_[m].column[l]};
  }
  float* Buffer(int64_t, int64_t, int64_t* ld) {
    *ld = kTilePanels * kPanel;
    return tile_;
  }
  // The tile's rows are ld >= cols rounded up to kPanel apart, so whole vectors may be read; lanes
  // past cols are masked out.
  void Written(int64_t m, int64_t n, const float* tile, int64_t ld, int64_t rows, int64_t cols) {
    for (int64_t c0 = 0; c0 < cols; c0 += kLanes) {
      const KeyVec column = (KeyVec{} + (int32_t)(n + c0)) + lane_;
      const KeyVec valid = column < (int32_t)(n + cols);
      for (int64_t r = 0; r < rows; ++r) {
        Lanes& best = lanes_[m + r];
        const KeyVec keys = (Keys(tile + r * ld + c0) & valid) | (~valid & INT32_MIN);  // INT32_MIN: below every key
        // Ties to the first column, whichever order the tiles came in.
        const KeyVec wins = (keys > best.key) | ((keys == best.key) & (column < best.column));
        best.key = wins ? keys : best.key;
        best.column = wins ? column : best.column;
      }
    }
  }

 private:
  struct Lanes {  // no column yet: key INT32_MIN, which no value's key is, and column -1
    KeyVec key = KeyVec{} + INT32_MIN, column = KeyVec{} - 1;
  };
  Argmax& shared_;
  std::vector<Lanes> lanes_;
  KeyVec lane_;  // 0, 1, .., kLanes - 1
  alignas(64) float tile_[kRows * kTilePanels * kPanel];  // the FMA kernel's tiles
};

// x [M, K] @ the P panels at w (N columns), each thread's tiles handed to its new_sink().
template <typename NewSink>
void Product(ffi::ThreadPool& pool, const float* xs, const float* ws, int64_t M, int64_t K, int64_t P, int64_t N,
             NewSink& new_sink) {
#if PAGED_JAX_AMX
  static_assert(paged_jax::amx::kItemPanels == kTilePanels, "both kernels share the work items' width");
  if (M >= kAmxMinRows && paged_jax::amx::Linear(pool, xs, ws, M, K, P, N, new_sink)) return;
#endif
  const int64_t items = (P + kTilePanels - 1) / kTilePanels;
  const int64_t tiles = (M + kRows - 1) / kRows;
  paged_jax::ItemRuns runs(items, paged_jax::Sharers(pool, items, M));
  auto work = [&] {
    auto sink = new_sink();
    int64_t end = 0;
    for (int64_t i = runs.Next(-1, &end), after; i < items; i = after) {
      after = runs.Next(i, &end);
      const int64_t p = i * kTilePanels, n = p * kPanel;
      const float* wi = ws + p * K * kPanel;  // these panels stay in cache while every row passes
      const float* wa = ws + after * kTilePanels * K * kPanel;
      const bool prefetch = after < items && M >= paged_jax::kPrefetchRows;
      const int pa = prefetch ? (int)std::min<int64_t>(kTilePanels, P - after * kTilePanels) : 0;
      const bool whole = P - p >= kTilePanels;  // else an odd last panel
      const int64_t cols = std::min<int64_t>(N - n, (whole ? kTilePanels : 1) * kPanel);
      for (int64_t t = 0, m = 0, rows; t < tiles; ++t, m += rows) {
        rows = M / tiles + (t < M % tiles);
        const paged_jax::TilePrefetch next(wa, pa, K, t, tiles);  // a panel's line: one k's kPanel floats
        int64_t ld;
        float* o = sink.Buffer(m, n, &ld);
        if (whole)
          TileRows<kTilePanels>((int)rows, xs + m * K, K, wi, K, o, ld, N - n, next);
        else
          TileRows<1>((int)rows, xs + m * K, K, wi, K, o, ld, N - n, next);
        sink.Written(m, n, o, ld, rows, cols);
      }
    }
  };
  paged_jax::RunShared(pool, items, work, M);
}

// Whether x [M, K], packed w [P, K, 16] and N columns agree.
bool Agree(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, int64_t N) {
  return wd[1] == xd[1] && wd[2] == kPanel && (N + kPanel - 1) / kPanel == wd[0];
}

ffi::Error LinearF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), od = out->dimensions();
  if (!Agree(xd, w.dimensions(), od[1]) || od[0] != xd[0])
    return ffi::Error::InvalidArgument("linear: x [M, K], packed w [ceil(N / 16), K, 16] and out [M, N] disagree");
  const int64_t N = od[1];
  const int64_t M = paged_jax::ComputedRows(rows, xd[0], out->typed_data(), N);
  if (M == 0) return ffi::Error::Success();
  auto new_sink = [&] { return Store(out->typed_data(), N); };
  Product(pool, x.typed_data(), w.typed_data(), M, xd[1], w.dimensions()[0], N, new_sink);
  return ffi::Error::Success();
}

// The greedy head: tokens[m] = argmax over the n columns of (x @ w)[m], the first column of a row's
// largest value, without writing the product: each value is the matmul's own (the same tiles, the same
// sums in the same order), compared in L1 as its tile is done. Rows past `rows` get 0, the argmax of
// the matmul's zeros there.
ffi::Error ArgmaxLinearF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::Buffer<ffi::S32> rows, int64_t n, ffi::ResultBuffer<ffi::S32> tokens) {
  const auto xd = x.dimensions();
  if (!Agree(xd, w.dimensions(), n) || tokens->dimensions()[0] != xd[0] || n < 1 || n > INT32_MAX)
    return ffi::Error::InvalidArgument(
        "argmax_linear: x [M, K], packed w [ceil(n / 16), K, 16] and tokens [M] disagree");
  const int64_t M = std::clamp<int64_t>(rows.element_count() > 0 ? rows.typed_data()[0] : xd[0], 0, xd[0]);
  int32_t* out = tokens->typed_data();
  std::fill(out + M, out + xd[0], 0);
  if (M == 0) return ffi::Error::Success();
  Argmax shared;
  shared.best.resize(M);
  auto new_sink = [&] { return ArgmaxTiles(shared); };
  Product(pool, x.typed_data(), w.typed_data(), M, xd[1], w.dimensions()[0], n, new_sink);
  for (int64_t m = 0; m < M; ++m) out[m] = shared.best[m].column;
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
XLA_FFI_DEFINE_HANDLER_SYMBOL(ArgmaxLinearCpuF32, ArgmaxLinearF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::Buffer<ffi::S32>>());

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
