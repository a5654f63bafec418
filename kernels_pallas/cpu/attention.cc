// Paged attention for the CPU as an XLA FFI custom call: the same maths as reference.py, in float32,
// over float32 or bfloat16 pages (a bfloat16 row is widened to float32 in registers as it is read:
// common.h's Load and ToFloat; every function below takes the page element type KV).
//
// XLA's CPU backend gathers pages into contiguous copies and runs many tiny batched matmuls; this
// kernel instead streams each sequence's pages once through the cache, flash-attention style: the
// query rows of a work item (the query heads of one KV head, for one decode token or a tile of new
// tokens) meet the K/V a chunk at a time, with an online softmax, so K/V are read once per item and
// never copied, and causally masked chunks are never computed. Decode rows take AttendDecode (one
// pass over K then V per page, every query head of the group at once), the rest AttendRows (two
// register-tiled matmuls per chunk). Work items (sequence, KV head, query tile) are shared out over
// XLA's intra-op thread pool.
//
// The page layout (kernels_pallas/layout.py) reaches the kernel as two strides, in elements: between
// consecutive slots of a page and between consecutive KV heads. Token-major pages have slot stride
// num_kv_heads * head_dim and head stride head_dim; head-major pages the reverse order, head_dim and
// block_size * head_dim, so a (block, KV head) tile is contiguous. Every read is a row of head_dim.
//
// A sliding window (attribute sliding_window > 0: a query at position p sees keys at positions
// > p - sliding_window) moves where each work item starts reading: no key, K or V, before the first
// visible one of the item's earliest query is read, so pages the window has left behind may hold anything.
// A soft cap (attribute soft_cap > 0, Gemma 2's) bounds each scaled score s to soft_cap * tanh(s / soft_cap)
// before the softmax.

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Below any real score, and finite: the kernel is built with -ffast-math (vectorised exp), which
// assumes no infinities. exp(kNoScore - m) is 0.
constexpr float kNoScore = -1e30f;

// exp of a score far below the running max is subnormal, and subnormal arithmetic is slow on x86:
// flush such values to zero while this thread works for the kernel, then restore the caller's mode
// (never process-wide, which is what linking with -ffast-math would do).
class FlushDenormals {
 public:
#if defined(__SSE2__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

using IntVec = int32_t __attribute__((vector_size(sizeof(paged_jax::Vec))));

// exp(x) for x <= 0, within a few ulp; below -87.3 about 1e-38 rather than 0, nothing beside a
// softmax sum of at least 1. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-5 polynomial
// for exp(r), and 2^n made in the exponent bits.
inline paged_jax::Vec ExpNonPositive(paged_jax::Vec x) {
  using paged_jax::Vec;
  x = x < -87.3f ? Vec{} - 87.3f : x;
  const IntVec n = __builtin_convertvector(x * 1.44269504f - 0.5f, IntVec);  // round(x / ln2): x <= 0
  const Vec nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // ln2 in two parts, the first exact in n * it
  Vec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return (p * r * r + r + 1.0f) * (Vec)((n + 127) << 23);  // times 2^n, as a bit pattern
}

// first, first + 1, ..., first + kLanes - 1: the positions a vector's lanes stand for, for masks.
inline paged_jax::Vec LanePositions(int first) {
  paged_jax::Vec lanes;
  for (int l = 0; l < paged_jax::kLanes; ++l) lanes[l] = (float)l;
  return lanes + (float)first;
}

inline float Max(paged_jax::Vec v) {
  float m = v[0];
  for (int l = 1; l < paged_jax::kLanes; ++l) m = std::max(m, v[l]);
  return m;
}

// rows[i][j] <-> rows[j][i] for a kLanes x kLanes block in registers: log2(kLanes) stages, each
// swapping the off-diagonal half-blocks of every pair of rows h apart, two shuffles a pair.
inline void Transpose(paged_jax::Vec (&rows)[paged_jax::kLanes]) {
  constexpr int L = paged_jax::kLanes;
  [&]<int... I>(std::integer_sequence<int, I...> lanes) {
    auto stage = [&]<int h>(std::integral_constant<int, h>) {
      for (int i = 0; i < L; ++i) {
        if (i & h) continue;
        const paged_jax::Vec a = rows[i], b = rows[i + h];
        rows[i] = __builtin_shufflevector(a, b, (I & h ? L + I - h : I)...);
        rows[i + h] = __builtin_shufflevector(a, b, (I & h ? L + I : I + h)...);
      }
    };
    [&]<int... S>(std::integer_sequence<int, S...>) {
      (stage(std::integral_constant<int, ((L >> 1) >> S)>()), ...);
    }(std::make_integer_sequence<int, std::countr_zero(unsigned(L))>());
  }(std::make_integer_sequence<int, L>());
}

struct Shapes {
  int64_t num_tokens, num_heads, head_dim, num_blocks, block_size, num_kv_heads, num_seqs, max_blocks;
  int64_t slot_stride, head_stride;  // elements between a page's consecutive slots / KV heads
  int64_t window;  // sliding window, 0 for none
  float soft_cap;  // 0 for none
};

// s, a row of n scaled scores, soft-capped where the call asks for it.
inline void SoftCap(const Shapes& sh, float* s, int n) {
  if (sh.soft_cap <= 0.0f) return;
  for (int t = 0; t < n; ++t) s[t] = sh.soft_cap * std::tanh(s[t] / sh.soft_cap);
}

// The first key position a query at position `pos` sees.
inline int FirstVisible(const Shapes& sh, int pos) {
  return sh.window > 0 ? std::max<int>(0, pos - (int)sh.window + 1) : 0;
}

struct WorkItem {
  int seq, kv_head, first, last;  // new tokens [first, last) of sequence seq
};

// Rows of several new tokens (a prefill chunk), and the decode rows AttendDecode does not take: a work
// item is up to kRowsPerItem rows, (token i, query head g) for consecutive new tokens of one sequence
// and the G query heads of one KV head, scaled q in qrows [rows][D]. Keys come kChunk positions at a
// time, with an online softmax, as two small matmuls on register tiles:
// - scores s [rows][kChunk] = qrows @ kt, kt being the chunk's K transposed to [D][kChunk] once for
//   all rows (kLanes x kLanes blocks through registers), so a tile of kTileRows rows x 2 vectors of
//   positions needs no horizontal sums;
// - the online softmax on vectors of positions (ExpNonPositive);
// - acc [rows][D] += p @ V, read in place, a tile of kTileRows rows x 2 vectors of head_dim.
// Rows are in causal order, so the tiles that see none of a chunk are skipped: no work on masked
// scores beyond the diagonal's own tiles.
constexpr int kRowsPerItem = 96;  // acc, qrows and s of an item stay in L2
constexpr int kChunk = 64;  // key positions per softmax step: a multiple of 2 * kLanes
// Rows x 2 vectors: 24 of 32 AVX-512 registers, 12 of 16 AVX2.
constexpr int kTileRows = paged_jax::kLanes == 16 ? 12 : 6;

// s[m][0:2L] = sum_d q[m][d] * kt[d][0:2L] for the kTileRows rows at q (D apart) into s (kChunk apart).
void ScoreTile(const float* q, const float* kt, int64_t D, float* s) {
  using paged_jax::Load;
  using paged_jax::Vec;
  constexpr int L = paged_jax::kLanes;
  Vec acc[kTileRows][2] = {};
  for (int64_t d = 0; d < D; ++d) {
    const Vec k0 = Load(kt + d * kChunk), k1 = Load(kt + d * kChunk + L);
#pragma GCC unroll 12
    for (int m = 0; m < kTileRows; ++m) {
      const float qs = q[m * D + d];
      acc[m][0] += qs * k0;
      acc[m][1] += qs * k1;
    }
  }
  for (int m = 0; m < kTileRows; ++m)
    paged_jax::Store(s + m * kChunk, acc[m][0]), paged_jax::Store(s + m * kChunk + L, acc[m][1]);
}

// acc[m][0:NV*L] += sum_t p[m][t] * v[t][0:NV*L] for the kTileRows rows at p (kChunk apart) and acc
// (D apart), over n positions whose V rows (offset to this tile's dims) are at v[t].
template <int NV, typename KV>
void ValueTile(const float* p, const KV* const* v, int64_t offset, int n, float* acc, int64_t D) {
  using paged_jax::Load;
  using paged_jax::Vec;
  constexpr int L = paged_jax::kLanes;
  Vec c[kTileRows][NV];
  for (int m = 0; m < kTileRows; ++m)
    for (int j = 0; j < NV; ++j) c[m][j] = Load(acc + m * D + j * L);
  for (int t = 0; t < n; ++t) {
    Vec vt[NV];
    for (int j = 0; j < NV; ++j) vt[j] = Load(v[t] + offset + j * L);
#pragma GCC unroll 12
    for (int m = 0; m < kTileRows; ++m) {
      const float ps = p[m * kChunk + t];
      for (int j = 0; j < NV; ++j) c[m][j] += ps * vt[j];
    }
  }
  for (int m = 0; m < kTileRows; ++m)
    for (int j = 0; j < NV; ++j) paged_jax::Store(acc + m * D + j * L, c[m][j]);
}

template <typename KV>
void AttendRows(const Shapes& sh, const float* q, const KV* k_pages, const KV* v_pages, const int32_t* table,
                int seq_len, int q_start, int q_len, const WorkItem& w, float scale, float* out) {
  using paged_jax::Vec;
  constexpr int L = paged_jax::kLanes;
  const int64_t D = sh.head_dim, G = sh.num_heads / sh.num_kv_heads, BS = sh.block_size, ss = sh.slot_stride;
  const int64_t block_stride = BS * sh.num_kv_heads * D;
  const int rows = (w.last - w.first) * G;
  const int padded = (rows + kTileRows - 1) / kTileRows * kTileRows;  // padding rows: q = 0, never stored
  std::vector<float> qrows(padded * D, 0.0f), acc(padded * D, 0.0f), s(padded * kChunk), kt(D * kChunk);
  std::vector<float> m(padded, kNoScore), l(padded, 0.0f);
  std::vector<int> limit(padded), from(padded);  // the last and first positions each row sees, ascending
  for (int r = 0; r < padded; ++r) {
    const int i = w.first + std::min(r, rows - 1) / G;
    limit[r] = seq_len - q_len + i;
    from[r] = FirstVisible(sh, limit[r]);
    if (r >= rows) continue;
    const float* src = q + ((q_start + i) * sh.num_heads + w.kv_head * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) qrows[r * D + d] = src[d] * scale;
  }
  const KV* k_rows[kChunk];
  const KV* v_rows[kChunk];
  for (int c0 = from[0]; c0 <= limit[padded - 1]; c0 += kChunk) {
    // Only written slots are read (the rest may hold NaN); kt's columns past n are zero.
    const int n = std::min(kChunk, limit[padded - 1] + 1 - c0);
    for (int t = 0; t < n; ++t) {
      const int pos = c0 + t;
      const int64_t base = (int64_t)table[pos / BS] * block_stride + w.kv_head * sh.head_stride + pos % BS * ss;
      k_rows[t] = k_pages + base, v_rows[t] = v_pages + base;
    }
    if (D % L == 0) {  // kLanes x kLanes blocks through registers
      for (int t0 = 0; t0 < kChunk; t0 += L)
        for (int64_t d0 = 0; d0 < D; d0 += L) {
          Vec block[L];
          for (int t = 0; t < L; ++t) block[t] = t0 + t < n ? paged_jax::Load(k_rows[t0 + t] + d0) : Vec{};
          Transpose(block);
          for (int d = 0; d < L; ++d) paged_jax::Store(&kt[(d0 + d) * kChunk + t0], block[d]);
        }
    } else {
      for (int t = 0; t < n; ++t)
        for (int64_t d = 0; d < D; ++d) kt[d * kChunk + t] = paged_jax::ToFloat(k_rows[t][d]);
      for (int64_t d = 0; d < D; ++d) std::fill(&kt[d * kChunk + n], &kt[d * kChunk + kChunk], 0.0f);
    }
    for (int r0 = 0; r0 < padded; r0 += kTileRows) {
      if (limit[r0 + kTileRows - 1] < c0 || from[r0] >= c0 + n) continue;  // the tile sees none of this chunk
      float* st = &s[r0 * kChunk];
      for (int c = 0; c < n; c += 2 * L) ScoreTile(&qrows[r0 * D], &kt[c], D, st + c);
      for (int r = r0; r < r0 + kTileRows; ++r) {  // the online softmax over the positions row r sees
        float* sr = &s[r * kChunk];
        SoftCap(sh, sr, n);
        const float seen = (float)std::clamp(limit[r] - c0 + 1, 0, n), first = (float)(from[r] - c0);
        Vec chunk_max = Vec{} + kNoScore;
        for (int t0 = 0; t0 < n; t0 += L) {
          const Vec lanes = LanePositions(t0);
          const Vec masked = (lanes < seen) & (lanes >= first) ? paged_jax::Load(sr + t0) : Vec{} + kNoScore;
          chunk_max = chunk_max > masked ? chunk_max : masked;
        }
        const float m_new = std::max(m[r], Max(chunk_max)), alpha = std::exp(m[r] - m_new);
        Vec sum{};
        for (int t0 = 0; t0 < n; t0 += L) {  // past n: scores of kt's zero columns, never read
          const Vec e = ExpNonPositive(paged_jax::Load(sr + t0) - m_new);
          const Vec lanes = LanePositions(t0);
          const Vec kept = (lanes < seen) & (lanes >= first) ? e : Vec{};
          paged_jax::Store(sr + t0, kept);
          sum += kept;
        }
        l[r] = l[r] * alpha + paged_jax::Sum(sum);
        m[r] = m_new;
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= alpha;
      }
      float* at = &acc[r0 * D];
      int64_t d0 = 0;
      for (; d0 + 2 * L <= D; d0 += 2 * L) ValueTile<2>(st, v_rows, d0, n, at + d0, D);
      if (d0 + L <= D) ValueTile<1>(st, v_rows, d0, n, at + d0, D), d0 += L;
      for (int r = 0; r < kTileRows; ++r)  // head_dim past the last vector
        for (int t = 0; t < n; ++t)
          for (int64_t d = d0; d < D; ++d) at[r * D + d] += st[r * kChunk + t] * paged_jax::ToFloat(v_rows[t][d]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    float* dst = out + ((q_start + w.first + r / G) * sh.num_heads + w.kv_head * G + r % G) * D;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
  }
}

// A decode row (one new token) of a sequence, every KV head in one work item. Per block and KV head,
// the G query heads sharing it take turns over its K rows, then its V rows, which stay in L1 after
// the first head's pass (a block's head tile is BS * D elements: 16 kB for SmolLM2's 64 x 64).
// - Scores come kLanes positions at a time, as one vector: each position's q . k is V vector FMAs
//   into one vector of partial sums, and a shuffle tree (SumLanes) adds kLanes such vectors into one
//   in log2(kLanes) levels of two shuffles and an add; a horizontal sum per position cost about as
//   much as its FMAs.
// - The online softmax runs on those vectors (ExpNonPositive: no scalar exp).
// - p * V accumulates in V registers per query head over the block's positions.
// The kernel before (a horizontal sum and a scalar exp per score, an accumulator load and store per
// FMA) read decode K/V at about 30 GB/s on the 2-core AMD EPYC, this one at about 40, where a plain
// read of the same tiles reaches about 50 (scripts/bench_attention_cpu.py --layout head_major
// --block-size 64, 64 sequences of 600: 2.0 -> 1.5 ms a layer).
// Shapes: head_dim = V * kLanes for V a power of two up to kMaxVectors, blocks of at most
// kMaxBlockSize slots; AttendRows takes every other shape.
constexpr int kMaxVectors = 16, kMaxBlockSize = 128;

constexpr int BitReverse(int i, int bits) {
  int r = 0;
  for (int b = 0; b < bits; ++b) r |= ((i >> b) & 1) << (bits - 1 - b);
  return r;
}

// One level of SumLanes: in segments of 2 * kHalf lanes, the segment of u holds one sum's parts in
// both halves, as does v's; out's segment holds u's halves added in its first half, v's in its second.
constexpr int FromU(int i, int half) { return i / (2 * half) * 2 * half + i % (2 * half); }
constexpr int Pick(int i, int half, int upper) {  // lane of the 2L-lane concatenation (u, v)
  return i % (2 * half) < half ? FromU(i, half) + upper * half
                               : paged_jax::kLanes + FromU(i - half, half) + upper * half;
}
template <int kHalf, int... I>
paged_jax::Vec Combine(paged_jax::Vec u, paged_jax::Vec v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(u, v, Pick(I, kHalf, 0)...) + __builtin_shufflevector(u, v, Pick(I, kHalf, 1)...);
}

// The kLanes-lane vector whose lane i is the sum of the lanes of parts(i): kLanes vectors added in a
// tree of log2(kLanes) levels. Levels put each sum's parts in ever narrower segments, in bit-reversed
// order of the inputs, so input J is taken as parts(BitReverse(J)) and lane i comes out as sum i.
template <int W = paged_jax::kLanes, int J = 0, typename Parts>
paged_jax::Vec SumLanes(const Parts& parts) {
  constexpr int kBits = std::countr_zero(unsigned(paged_jax::kLanes));
  if constexpr (W == 1) {
    return parts(BitReverse(J, kBits));
  } else {
    return Combine<paged_jax::kLanes / W>(SumLanes<W / 2, J>(parts), SumLanes<W / 2, J + W / 2>(parts),
                                         std::make_integer_sequence<int, paged_jax::kLanes>());
  }
}

template <int V, typename KV>
void AttendDecode(const Shapes& sh, const float* q, const KV* k_pages, const KV* v_pages, const int32_t* table,
                  int seq_len, int64_t token, float scale, float* out) {
  using paged_jax::Load;
  using paged_jax::Vec;
  constexpr int L = paged_jax::kLanes, D = V * L;
  constexpr int64_t kLinesPerRow = std::max<int64_t>(1, D * sizeof(KV) / 64);  // of 64 bytes
  const int64_t BS = sh.block_size, H = sh.num_kv_heads, G = sh.num_heads / H;
  const int64_t ss = sh.slot_stride, hs = sh.head_stride, block_stride = BS * H * D;
  // Per query head r = h * G + g: its accumulator, running max and sum; p: one block's scores, then
  // their exps.
  std::vector<float> acc(H * G * D, 0.0f), m(H * G, kNoScore), l(H * G, 0.0f);
  alignas(64) float p[kMaxBlockSize];
  const float* q_token = q + token * sh.num_heads * D;
  const int64_t blocks = (seq_len + BS - 1) / BS, lo = FirstVisible(sh, seq_len - 1);
  for (int64_t b = lo / BS; b < blocks; ++b) {
    const int n = (int)std::min<int64_t>(BS, seq_len - b * BS);  // written slots only: the rest may hold NaN
    const int first = (int)std::max<int64_t>(0, lo - b * BS);  // slots before the window: never read
    for (int64_t h = 0; h < H; ++h) {
      const KV* kb = k_pages + (int64_t)table[b] * block_stride + h * hs;
      const KV* vb = v_pages + (int64_t)table[b] * block_stride + h * hs;
      // The next tile's K and V, a row per p * V step of this tile, so that memory streams while the
      // G query heads compute from L1 (only the first head's pass read memory, through the hardware
      // prefetcher, which also stalled at each jump to the next tile). Into L2 (locality 2, prefetcht1),
      // not L1: this tile's K and V and the next one's are 64 kB of float32 at SmolLM2's shapes, more
      // than a 48 kB L1, and prefetching into L1 evicted the rows the later query heads were about to
      // read (on the 2-core Intel Xeon, 64 sequences of 600: 2.76 ms a layer with prefetcht0, 2.64 with
      // no prefetch, 2.50 with prefetcht1, medians of 5 alternating runs).
      const bool last = h + 1 == H && b + 1 == blocks;
      const int64_t next_b = h + 1 < H ? b : b + 1, next_h = h + 1 < H ? h + 1 : 0;
      const KV* next_k = last ? nullptr : k_pages + (int64_t)table[next_b] * block_stride + next_h * hs;
      const KV* next_v = last ? nullptr : v_pages + (int64_t)table[next_b] * block_stride + next_h * hs;
      const int next_n = last ? 0 : (int)std::min<int64_t>(BS, seq_len - next_b * BS);
      for (int64_t r = h * G; r < (h + 1) * G; ++r) {
        Vec qv[V], a[V];
        for (int v = 0; v < V; ++v) qv[v] = Load(q_token + r * D + v * L) * scale;
        Vec block_max = Vec{} + kNoScore;
        for (int t0 = 0; t0 < n; t0 += L) {
          Vec s = SumLanes([&](int j) {
            if (t0 + j >= n || t0 + j < first) return Vec{};
            const KV* row = kb + (t0 + j) * ss;
            Vec dot = qv[0] * Load(row);
            for (int v = 1; v < V; ++v) dot += qv[v] * Load(row + v * L);
            return dot;
          });
          if (sh.soft_cap > 0.0f) {
            alignas(64) float lanes[L];
            paged_jax::Store(lanes, s);
            SoftCap(sh, lanes, L);
            s = Load(lanes);
          }
          const Vec lanes = LanePositions(t0);
          const Vec masked = (lanes < (float)n) & (lanes >= (float)first) ? s : Vec{} + kNoScore;
          paged_jax::Store(p + t0, masked);
          block_max = block_max > masked ? block_max : masked;
        }
        const float m_new = std::max(m[r], Max(block_max)), alpha = ExpNonPositive(Vec{} + (m[r] - m_new))[0];
        Vec sum{};
        for (int t0 = 0; t0 < n; t0 += L) {
          const Vec e = ExpNonPositive(Load(p + t0) - m_new);
          const Vec lanes = LanePositions(t0);
          const Vec kept = (lanes < (float)n) & (lanes >= (float)first) ? e : Vec{};  // masked lanes: exactly 0
          paged_jax::Store(p + t0, kept);
          sum += kept;
        }
        l[r] = l[r] * alpha + paged_jax::Sum(sum);
        m[r] = m_new;
        for (int v = 0; v < V; ++v) a[v] = Load(&acc[r * D + v * L]) * alpha;
        const int64_t g = r - h * G;
        for (int t = first; t < n; ++t) {
          if (const int64_t i = g * n + t; i < 2 * next_n) {
            const KV* ahead = i < next_n ? next_k + i * ss : next_v + (i - next_n) * ss;
            for (int64_t j = 0; j < kLinesPerRow; ++j) __builtin_prefetch(ahead + j * (64 / sizeof(KV)), 0, 2);
          }
          const KV* row = vb + t * ss;
          for (int v = 0; v < V; ++v) a[v] += p[t] * Load(row + v * L);
        }
        for (int v = 0; v < V; ++v) paged_jax::Store(&acc[r * D + v * L], a[v]);
      }
    }
  }
  float* dst = out + token * sh.num_heads * D;
  for (int64_t r = 0; r < H * G; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int d = 0; d < D; ++d) dst[r * D + d] = acc[r * D + d] * inv;
  }
}

// A decode row at head_dim == kLanes (16 with AVX-512: bench_overlap's tiny model), blocks a multiple of
// kLanes slots, every KV head in one work item. There a position's q . k is a single FMA, and
// AttendDecode's shuffle tree per kLanes positions and query head, and its online softmax per block and
// query head (a max, an exp and a sum across lanes, the accumulator rescaled), cost several times the
// FMAs. Instead, kLanes K rows at a time are transposed in registers once for a KV head's G query heads,
// each of which then takes kLanes scores from kLanes FMAs; every score of the context is kept
// (num_heads x context floats, in L1 or L2 for contexts of thousands), so the softmax is exact, with no
// running max and no rescaling; then V in a second pass. (Prefetching the blocks 1 to 8 ahead in
// software, K's then V's, changed nothing measurable: scripts/bench_decode_attention.py.)

// acc[g] += sum over t in [from, n) of p[g * span + t] * V row t, for the G query heads of one KV head
// (acc [G][kLanes] floats; V rows ss elements apart).
template <int G, typename KV>
void AccumulateV(const float* p, int64_t span, const KV* vb, int64_t ss, int from, int n, float* acc) {
  paged_jax::Vec a[G];
  for (int g = 0; g < G; ++g) a[g] = paged_jax::Load(acc + g * paged_jax::kLanes);
  for (int t = from; t < n; ++t) {
    const paged_jax::Vec row = paged_jax::Load(vb + t * ss);
    for (int g = 0; g < G; ++g) a[g] += p[g * span + t] * row;
  }
  for (int g = 0; g < G; ++g) paged_jax::Store(acc + g * paged_jax::kLanes, a[g]);
}

template <typename KV>
void AttendDecodeNarrow(const Shapes& sh, const float* q, const KV* k_pages, const KV* v_pages, const int32_t* table,
                        int seq_len, int64_t token, float scale, float* out) {
  using paged_jax::Load;
  using paged_jax::Vec;
  constexpr int L = paged_jax::kLanes;
  const int64_t BS = sh.block_size, H = sh.num_kv_heads, G = sh.num_heads / H, R = sh.num_heads;
  const int64_t ss = sh.slot_stride, hs = sh.head_stride, block_stride = BS * H * L;
  const int64_t lo = FirstVisible(sh, seq_len - 1), b0 = lo / BS, blocks = (seq_len + BS - 1) / BS;
  // Scores of positions b0 * BS + i for i < span, the last block's rounded up to whole vectors: those
  // outside [lo, seq_len) are kNoScore.
  const int64_t span = (blocks - 1 - b0) * BS + (seq_len - (blocks - 1) * BS + L - 1) / L * L;
  // Scores [R][span], scaled q and then the accumulators [R][L], 1 / the softmax sums [R].
  thread_local std::vector<float> buffer;
  buffer.resize(R * (span + L + 1));
  float *acc = buffer.data() + R * span, *inv = acc + R * L;
  const float* q_token = q + token * R * L;
  for (int64_t i = 0; i < R * L; ++i) acc[i] = q_token[i] * scale;
  const Vec first = Vec{} + (float)(lo - b0 * BS), end = Vec{} + (float)(seq_len - b0 * BS);
  // A block's K (or V), every KV head, is block_stride contiguous elements of a page that is one of
  // thousands: where a sequence's next block is not the one after it in the pool, the hardware
  // prefetcher, which stays within a 4 kB page, does not run ahead of the jump. There the K pass asks
  // for K kAhead blocks ahead, and for this block's V, which the V pass then finds in cache
  // (bench_overlap.py --model, 256 sequences: 40% of this function's time sat on V's loads); pages in
  // order are left to the hardware, which the extra requests only slowed (bench_decode_attention.py).
  constexpr int64_t kAhead = 2;
  const auto fetch = [&](const KV* pages, int64_t b) {
    if (b > b0 && table[b] == table[b - 1] + 1) return;
    const char* at = reinterpret_cast<const char*>(pages + (int64_t)table[b] * block_stride);
    for (int64_t i = 0; i < block_stride * (int64_t)sizeof(KV); i += 64) __builtin_prefetch(at + i, 0, 3);
  };
  for (int64_t b = b0; b < std::min(blocks, b0 + kAhead); ++b) fetch(k_pages, b);
  for (int64_t b = b0; b < blocks; ++b) {
    const int n = (int)std::min<int64_t>(BS, seq_len - b * BS);  // written slots only: the rest may hold NaN
    if (b + kAhead < blocks) fetch(k_pages, b + kAhead);
    fetch(v_pages, b);
    for (int64_t h = 0; h < H; ++h) {
      const KV* kb = k_pages + (int64_t)table[b] * block_stride + h * hs;
      for (int t0 = 0; t0 < n; t0 += L) {
        Vec kt[L];
        for (int t = 0; t < L; ++t) kt[t] = t0 + t < n ? Load(kb + (t0 + t) * ss) : Vec{};
        Transpose(kt);  // kt[d]: dimension d of positions t0 .. t0 + L - 1
        const int64_t i0 = (b - b0) * BS + t0;
        const Vec lanes = LanePositions((int)i0);
        for (int64_t r = h * G; r < (h + 1) * G; ++r) {
          const float* qr = acc + r * L;
          Vec s = kt[0] * qr[0];
          for (int d = 1; d < L; ++d) s += kt[d] * qr[d];
          if (sh.soft_cap > 0.0f) {
            alignas(64) float capped[L];
            paged_jax::Store(capped, s);
            SoftCap(sh, capped, L);
            s = Load(capped);
          }
          paged_jax::Store(&buffer[r * span + i0], (lanes >= first) & (lanes < end) ? s : Vec{} + kNoScore);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // the softmax's weights, unnormalised, and 1 / their sum
    float* sr = &buffer[r * span];
    Vec top = Vec{} + kNoScore;
    for (int64_t i = 0; i < span; i += L) top = top > Load(sr + i) ? top : Load(sr + i);
    const float m = Max(top);
    Vec sum{};
    for (int64_t i = 0; i < span; i += L) {
      const Vec s = Load(sr + i), kept = s > kNoScore * 0.5f ? ExpNonPositive(s - m) : Vec{};  // masked: 0
      paged_jax::Store(sr + i, kept);
      sum += kept;
    }
    paged_jax::Store(acc + r * L, Vec{});
    inv[r] = 1.0f / paged_jax::Sum(sum);  // the last position is always seen: sum >= 1
  }
  for (int64_t b = b0; b < blocks; ++b) {
    const int n = (int)std::min<int64_t>(BS, seq_len - b * BS);
    const int from = (int)std::max<int64_t>(0, lo - b * BS);  // slots before the window: never read
    for (int64_t h = 0; h < H; ++h) {
      const KV* vb = v_pages + (int64_t)table[b] * block_stride + h * hs;
      const float* p = &buffer[h * G * span + (b - b0) * BS];
      switch (G) {  // each V row loaded once for the group's query heads, their sums side by side
        case 1: AccumulateV<1>(p, span, vb, ss, from, n, acc + h * G * L); break;
        case 2: AccumulateV<2>(p, span, vb, ss, from, n, acc + h * G * L); break;
        case 3: AccumulateV<3>(p, span, vb, ss, from, n, acc + h * G * L); break;
        case 4: AccumulateV<4>(p, span, vb, ss, from, n, acc + h * G * L); break;
        default:
          for (int64_t g = 0; g < G; ++g) AccumulateV<1>(p + g * span, span, vb, ss, from, n, acc + (h * G + g) * L);
      }
    }
  }
  float* dst = out + token * R * L;
  for (int64_t r = 0; r < R; ++r) paged_jax::Store(dst + r * L, Load(acc + r * L) * inv[r]);
}

template <typename KV>
using DecodeFn = void (*)(const Shapes&, const float*, const KV*, const KV*, const int32_t*, int, int64_t, float,
                          float*);

// AttendDecode for this shape, or nullptr where it does not apply (AttendRows serves every shape).
template <typename KV>
DecodeFn<KV> DecodeFor(const Shapes& sh) {
  if (sh.head_dim == paged_jax::kLanes && sh.block_size % paged_jax::kLanes == 0) return AttendDecodeNarrow<KV>;
  if (sh.head_dim % paged_jax::kLanes || sh.block_size > kMaxBlockSize) return nullptr;
  switch (sh.head_dim / paged_jax::kLanes) {
    case 1: return AttendDecode<1, KV>;
    case 2: return AttendDecode<2, KV>;
    case 4: return AttendDecode<4, KV>;
    case 8: return AttendDecode<8, KV>;
    case kMaxVectors: return AttendDecode<kMaxVectors, KV>;
    default: return nullptr;
  }
}

// Every work item of one call, over pages of element type KV, shared out over XLA's thread pool.
template <typename KV>
void AttendItems(ffi::ThreadPool& pool, const Shapes& sh, const std::vector<WorkItem>& items, const float* q,
                 const KV* k_pages, const KV* v_pages, const int32_t* tables, const int32_t* lens,
                 const int32_t* starts, float scale, float* out) {
  const DecodeFn<KV> decode = DecodeFor<KV>(sh);
  std::atomic<size_t> next{0};
  auto work = [&] {
    FlushDenormals flush;
    for (size_t i; (i = next.fetch_add(1)) < items.size();) {
      const WorkItem& w = items[i];
      if (decode != nullptr && starts[w.seq + 1] - starts[w.seq] == 1) {
        decode(sh, q, k_pages, v_pages, tables + w.seq * sh.max_blocks, lens[w.seq], starts[w.seq], scale, out);
        continue;
      }
      AttendRows(sh, q, k_pages, v_pages, tables + w.seq * sh.max_blocks, lens[w.seq], starts[w.seq],
                 starts[w.seq + 1] - starts[w.seq], w, scale, out);
    }
  };
  paged_jax::RunShared(pool, (int64_t)items.size(), work, sh.num_tokens);
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                          float scale, int64_t block_size, int64_t num_kv_heads,
                          int64_t slot_stride, int64_t head_stride, int64_t sliding_window, float soft_cap,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), pd = k_pages.dimensions(), bd = block_tables.dimensions();
  const ffi::DataType page_type = k_pages.element_type();
  if (v_pages.element_type() != page_type || (page_type != ffi::DataType::F32 && page_type != ffi::DataType::BF16) ||
      pd.size() != 4 || v_pages.dimensions().size() != 4 || v_pages.element_count() != k_pages.element_count())
    return ffi::Error::InvalidArgument("paged attention: K and V pages must be 4-d, of one shape, float32 or bfloat16");
  if (sliding_window < 0 || soft_cap < 0.0f)
    return ffi::Error::InvalidArgument("paged attention: sliding_window and soft_cap must be >= 0");
  const Shapes sh{qd[0], qd[1], qd[2], pd[0], block_size, num_kv_heads, bd[0], bd[1], slot_stride, head_stride,
                  sliding_window, soft_cap};
  // Strides that could step outside a block must fail here rather than read outside the buffers.
  if (pd[1] * pd[2] != block_size * num_kv_heads || pd[3] != sh.head_dim || sh.num_heads % num_kv_heads ||
      (num_kv_heads - 1) * head_stride + (block_size - 1) * slot_stride + sh.head_dim > pd[1] * pd[2] * pd[3])
    return ffi::Error::InvalidArgument("paged attention: page shape or strides do not match q and the layout");
  std::memset(out->typed_data(), 0, sizeof(float) * sh.num_tokens * sh.num_heads * sh.head_dim);
  const int32_t* lens = seq_lens.typed_data();
  const int32_t* starts = query_start_loc.typed_data();

  const bool decode_rows = DecodeFor<float>(sh) != nullptr;  // the shapes decide, not the page type
  std::vector<WorkItem> items;
  const int32_t* tables = block_tables.typed_data();
  for (int s = 0; s < sh.num_seqs; ++s) {
    const int q_len = starts[s + 1] - starts[s];
    if (q_len <= 0 || lens[s] <= 0) continue;
    // Bad metadata must fail loudly here rather than read outside the buffers.
    if (starts[s] < 0 || starts[s + 1] > sh.num_tokens || q_len > lens[s] || lens[s] > sh.max_blocks * sh.block_size)
      return ffi::Error::InvalidArgument("paged attention: inconsistent seq_lens / query_start_loc");
    for (int64_t b = FirstVisible(sh, lens[s] - q_len) / sh.block_size; b * sh.block_size < lens[s]; ++b)
      if (tables[s * sh.max_blocks + b] < 0 || tables[s * sh.max_blocks + b] >= sh.num_blocks)
        return ffi::Error::InvalidArgument("paged attention: block table entry outside the page pool");
    if (q_len == 1 && decode_rows) {
      items.push_back({s, 0, 0, 1});  // every KV head
      continue;
    }
    const int tokens = std::max<int>(1, kRowsPerItem / (sh.num_heads / num_kv_heads));
    for (int h = 0; h < sh.num_kv_heads; ++h)
      for (int first = 0; first < q_len; first += tokens)
        items.push_back({s, h, first, std::min(first + tokens, q_len)});
  }
  // Longest contexts first, so the last items handed out are the short ones.
  std::sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return lens[a.seq] - (starts[a.seq + 1] - starts[a.seq]) + a.last >
           lens[b.seq] - (starts[b.seq + 1] - starts[b.seq]) + b.last;
  });
  if (page_type == ffi::DataType::F32)
    AttendItems(pool, sh, items, q.typed_data(), k_pages.typed_data<float>(), v_pages.typed_data<float>(), tables,
                lens, starts, scale, out->typed_data());
  else  // reinterpret: typed_data<uint16_t> would assert that the buffer holds U16
    AttendItems(pool, sh, items, q.typed_data(), k_pages.reinterpret_data<paged_jax::BF16>(),
                v_pages.reinterpret_data<paged_jax::BF16>(), tables, lens, starts, scale, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionCpu, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("num_kv_heads")
                                  .Attr<int64_t>("slot_stride")
                                  .Attr<int64_t>("head_stride")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// A buffer XLA allocates and nobody writes. The KV cache is made of these: a large allocation is
// mapped by the OS page by page as blocks are first written, so a generous KV budget costs neither
// time at start-up nor memory until it is used. Pages are never trusted (the kernels mask by length).
XLA_FFI_DEFINE_HANDLER_SYMBOL(UnwrittenBuffer, [](ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); },
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

// Whether calls of few rows use the helpers (common.h); for comparing the two in one process.
extern "C" void PagedJaxCpuHelpers(int on) { paged_jax::helpers_on.store(on != 0); }
