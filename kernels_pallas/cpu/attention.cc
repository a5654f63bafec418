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

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
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

struct Shapes {
  int64_t num_tokens, num_heads, head_dim, num_blocks, block_size, num_kv_heads, num_seqs, max_blocks;
  int64_t slot_stride, head_stride;  // elements between a page's consecutive slots / KV heads
};

struct WorkItem {
  int seq, kv_head, first, last;  // new tokens [first, last) of sequence seq
};

// Rows of several new tokens (a prefill chunk), and the decode rows AttendDecode does not take: a work
// item is up to kRowsPerItem rows, (token i, query head g) for consecutive new tokens of one sequence
// and the G query heads of one KV head, scaled q in qrows [rows][D]. Keys come kChunk positions at a
// time, with an online softmax, as two small matmuls on register tiles:
// - scores s [rows][kChunk] = qrows @ kt, kt being the chunk's K transposed to [D][kChunk] once for
//   all rows, so a tile of kTileRows rows x 2 vectors of positions needs no horizontal sums;
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
  constexpr int L = paged_jax::kLanes;
  const int64_t D = sh.head_dim, G = sh.num_heads / sh.num_kv_heads, BS = sh.block_size, ss = sh.slot_stride;
  const int64_t block_stride = BS * sh.num_kv_heads * D;
  const int rows = (w.last - w.first) * G;
  const int padded = (rows + kTileRows - 1) / kTileRows * kTileRows;  // padding rows: q = 0, never stored
  std::vector<float> qrows(padded * D, 0.0f), acc(padded * D, 0.0f), s(padded * kChunk), kt(D * kChunk);
  std::vector<float> m(padded, kNoScore), l(padded, 0.0f);
  std::vector<int> limit(padded);  // the last position each row sees (causal), ascending
  for (int r = 0; r < padded; ++r) {
    const int i = w.first + std::min(r, rows - 1) / G;
    limit[r] = seq_len - q_len + i;
    if (r >= rows) continue;
    const float* src = q + ((q_start + i) * sh.num_heads + w.kv_head * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) qrows[r * D + d] = src[d] * scale;
  }
  const KV* k_rows[kChunk];
  const KV* v_rows[kChunk];
  for (int c0 = 0; c0 <= limit[padded - 1]; c0 += kChunk) {
    // Only written slots are read (the rest may hold NaN); kt's columns past n are zero.
    const int n = std::min(kChunk, limit[padded - 1] + 1 - c0);
    for (int t = 0; t < n; ++t) {
      const int pos = c0 + t;
      const int64_t base = (int64_t)table[pos / BS] * block_stride + w.kv_head * sh.head_stride + pos % BS * ss;
      k_rows[t] = k_pages + base, v_rows[t] = v_pages + base;
      for (int64_t d = 0; d < D; ++d) kt[d * kChunk + t] = paged_jax::ToFloat(k_rows[t][d]);
    }
    for (int64_t d = 0; d < D; ++d) std::fill(&kt[d * kChunk + n], &kt[d * kChunk + kChunk], 0.0f);
    for (int r0 = 0; r0 < padded; r0 += kTileRows) {
      if (limit[r0 + kTileRows - 1] < c0) continue;  // the tile sees none of this chunk
      float* st = &s[r0 * kChunk];
      for (int c = 0; c < n; c += 2 * L) ScoreTile(&qrows[r0 * D], &kt[c], D, st + c);
      for (int r = r0; r < r0 + kTileRows; ++r) {  // the online softmax over the positions row r sees
        float* sr = &s[r * kChunk];
        const int seen = std::clamp(limit[r] - c0 + 1, 0, n);
        float chunk_max = kNoScore;
        for (int t = 0; t < seen; ++t) chunk_max = std::max(chunk_max, sr[t]);
        const float m_new = std::max(m[r], chunk_max), alpha = std::exp(m[r] - m_new);
        float sum = 0.0f;
        for (int t = 0; t < seen; ++t) sum += (sr[t] = std::exp(sr[t] - m_new));
        std::fill(sr + seen, sr + n, 0.0f);
        l[r] = l[r] * alpha + sum;
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

// A decode row (one new token) of a sequence, every KV head in one work item, so that each block's K,
// then its V, is read whole and in memory order: the hardware prefetcher streams a block at the full
// read rate of the machine, where the strided rows of one KV head at a time (a third of every block,
// for SmolLM2) ran at half of it, and software prefetches (tried, of the next blocks) only slowed it.
// Vectors run along head_dim. Scores come two positions at a time for the G query heads sharing a KV
// head (2 * G independent sums, each K load feeding G FMAs), then p * V row by row into accumulators
// in L1. Bounds: head_dim a multiple of kLanes and at most kMaxHeadDim, blocks of at most kMaxBlockSize.
constexpr int kMaxHeadDim = 256, kMaxBlockSize = 128;

template <int G, typename KV>
void AttendDecode(const Shapes& sh, const float* q, const KV* k_pages, const KV* v_pages, const int32_t* table,
                  int seq_len, int64_t token, float scale, float* out) {
  using paged_jax::Load;
  using paged_jax::Vec;
  constexpr int L = paged_jax::kLanes;
  const int64_t D = sh.head_dim, BS = sh.block_size, V = D / L, H = sh.num_kv_heads;
  const int64_t ss = sh.slot_stride, hs = sh.head_stride, block_stride = BS * H * D;
  // The page's rows in memory order: slots outer for token-major pages, KV heads outer for head-major.
  const bool slots_outer = ss > hs;
  // Per query head r = h * G + g: its scaled q, accumulator, running max and sum; scores per block.
  std::vector<float> qs(H * G * D), acc(H * G * D, 0.0f), s(H * G * BS), m(H * G, kNoScore), l(H * G, 0.0f);
  const float* q_token = q + token * sh.num_heads * D;
  for (int64_t i = 0; i < H * G * D; ++i) qs[i] = q_token[i] * scale;

  auto score_two = [&](const KV* kb, int64_t h, int t) {  // positions t, t + 1 of KV head h
    Vec a0[G] = {}, a1[G] = {};
    const KV* k0 = kb + t * ss + h * hs;
    for (int64_t v = 0; v < V; ++v) {
      const Vec x0 = Load(k0 + v * L), x1 = Load(k0 + ss + v * L);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const Vec qv = Load(&qs[(h * G + g) * D + v * L]);
        a0[g] += qv * x0;
        a1[g] += qv * x1;
      }
    }
    for (int g = 0; g < G; ++g)
      s[(h * G + g) * BS + t] = paged_jax::Sum(a0[g]), s[(h * G + g) * BS + t + 1] = paged_jax::Sum(a1[g]);
  };
  auto score_one = [&](const KV* kb, int64_t h, int t) {
    Vec a0[G] = {};
    for (int64_t v = 0; v < V; ++v) {
      const Vec x0 = Load(kb + t * ss + h * hs + v * L);
      for (int g = 0; g < G; ++g) a0[g] += Load(&qs[(h * G + g) * D + v * L]) * x0;
    }
    for (int g = 0; g < G; ++g) s[(h * G + g) * BS + t] = paged_jax::Sum(a0[g]);
  };
  auto add_value = [&](const KV* vb, int64_t h, int t) {  // acc += p * V for position t of KV head h
    const KV* row = vb + t * ss + h * hs;
    float* a = &acc[h * G * D];
    const float* p = &s[h * G * BS + t];
    for (int64_t v = 0; v < V; ++v) {
      const Vec x = Load(row + v * L);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) paged_jax::Store(a + g * D + v * L, Load(a + g * D + v * L) + p[g * BS] * x);
    }
  };

  for (int64_t b = 0; b * BS < seq_len; ++b) {
    const int64_t base = (int64_t)table[b] * block_stride;
    const KV* kb = k_pages + base;
    const KV* vb = v_pages + base;
    const int n = (int)std::min<int64_t>(BS, seq_len - b * BS);  // written slots only: the rest may hold NaN
    if (slots_outer) {
      int t = 0;
      for (; t + 2 <= n; t += 2)
        for (int64_t h = 0; h < H; ++h) score_two(kb, h, t);
      for (; t < n; ++t)
        for (int64_t h = 0; h < H; ++h) score_one(kb, h, t);
    } else {
      for (int64_t h = 0; h < H; ++h) {
        int t = 0;
        for (; t + 2 <= n; t += 2) score_two(kb, h, t);
        for (; t < n; ++t) score_one(kb, h, t);
      }
    }
    for (int64_t r = 0; r < H * G; ++r) {  // the online softmax
      float* sr = &s[r * BS];
      float block_max = kNoScore;
      for (int i = 0; i < n; ++i) block_max = std::max(block_max, sr[i]);
      const float m_new = std::max(m[r], block_max), alpha = std::exp(m[r] - m_new);
      float sum = 0.0f;
      for (int i = 0; i < n; ++i) sum += (sr[i] = std::exp(sr[i] - m_new));
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
      for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= alpha;
    }
    if (slots_outer) {
      for (int t = 0; t < n; ++t)
        for (int64_t h = 0; h < H; ++h) add_value(vb, h, t);
    } else {
      for (int64_t h = 0; h < H; ++h)
        for (int t = 0; t < n; ++t) add_value(vb, h, t);
    }
  }
  float* dst = out + token * sh.num_heads * D;
  for (int64_t r = 0; r < H * G; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[r * D + d] = acc[r * D + d] * inv;
  }
}

template <typename KV>
using DecodeFn = void (*)(const Shapes&, const float*, const KV*, const KV*, const int32_t*, int, int64_t, float,
                          float*);

// AttendDecode for this shape, or nullptr where it does not apply (AttendRows serves every shape).
template <typename KV>
DecodeFn<KV> DecodeFor(const Shapes& sh) {
  if (sh.head_dim % paged_jax::kLanes || sh.head_dim > kMaxHeadDim || sh.block_size > kMaxBlockSize) return nullptr;
  switch (sh.num_heads / sh.num_kv_heads) {
    case 1: return AttendDecode<1, KV>;
    case 2: return AttendDecode<2, KV>;
    case 3: return AttendDecode<3, KV>;
    case 4: return AttendDecode<4, KV>;
    case 6: return AttendDecode<6, KV>;
    case 8: return AttendDecode<8, KV>;
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
                          int64_t slot_stride, int64_t head_stride, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), pd = k_pages.dimensions(), bd = block_tables.dimensions();
  const ffi::DataType page_type = k_pages.element_type();
  if (v_pages.element_type() != page_type || (page_type != ffi::DataType::F32 && page_type != ffi::DataType::BF16) ||
      pd.size() != 4 || v_pages.dimensions().size() != 4 || v_pages.element_count() != k_pages.element_count())
    return ffi::Error::InvalidArgument("paged attention: K and V pages must be 4-d, of one shape, float32 or bfloat16");
  const Shapes sh{qd[0], qd[1], qd[2], pd[0], block_size, num_kv_heads, bd[0], bd[1], slot_stride, head_stride};
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
    for (int64_t b = 0; b * sh.block_size < lens[s]; ++b)
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
                                  .Ret<ffi::Buffer<ffi::F32>>());

// A buffer XLA allocates and nobody writes. The KV cache is made of these: a large allocation is
// mapped by the OS page by page as blocks are first written, so a generous KV budget costs neither
// time at start-up nor memory until it is used. Pages are never trusted (the kernels mask by length).
XLA_FFI_DEFINE_HANDLER_SYMBOL(UnwrittenBuffer, [](ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); },
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

// Whether calls of few rows use the helpers (common.h); for comparing the two in one process.
extern "C" void PagedJaxCpuHelpers(int on) { paged_jax::helpers_on.store(on != 0); }
