// Paged attention for the CPU as an XLA FFI custom call: the same maths as reference.py, float32.
//
// XLA's CPU backend gathers pages into contiguous copies and runs many tiny batched matmuls; this
// kernel instead streams each sequence's pages once through the cache, flash-attention style: a
// tile of query rows (the query heads of one KV head, for up to kTileQ new tokens) meets one K/V
// block at a time, with an online softmax, so K/V are read once per tile and never copied.
// Work items (sequence, KV head, query tile) are shared out over XLA's intra-op thread pool.
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

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTileQ = 16;  // new tokens per work item: bounds a tile's accumulators to L1 size
constexpr int kTransposeRows = 8;  // rows from which transposing a K block pays for itself
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

// Rows of a tile are (token i, head g) pairs; acc holds their running sum of p * V.
void AttendTile(const Shapes& sh, const float* q, const float* k_pages, const float* v_pages,
                const int32_t* block_tables, int seq_len, int q_start, int q_len, const WorkItem& w,
                float scale, float* out) {
  const int64_t D = sh.head_dim, G = sh.num_heads / sh.num_kv_heads, BS = sh.block_size;
  const int64_t rows = (w.last - w.first) * G;
  const int64_t slot_stride = sh.slot_stride;
  const int64_t block_stride = BS * sh.num_kv_heads * D;
  std::vector<float> acc(rows * D, 0.0f), m(rows, kNoScore), l(rows, 0.0f), s(BS);
  std::vector<float> qrows(rows * D), kt(D * BS, 0.0f);
  std::vector<int> limit(rows);  // last position each row may see (causal)
  for (int i = w.first; i < w.last; ++i) {
    for (int g = 0; g < G; ++g) {
      const int64_t r = (i - w.first) * G + g;
      const float* src = q + ((q_start + i) * sh.num_heads + w.kv_head * G + g) * D;
      for (int64_t d = 0; d < D; ++d) qrows[r * D + d] = src[d] * scale;
      limit[r] = seq_len - q_len + i;
    }
  }
  const int last_pos = seq_len - q_len + w.last - 1;
  const int32_t* table = block_tables + w.seq * sh.max_blocks;
  for (int b = 0; b * BS <= last_pos; ++b) {
    const int64_t base = (int64_t)table[b] * block_stride + w.kv_head * sh.head_stride;
    const float* kb = k_pages + base;
    const float* vb = v_pages + base;
    const int valid = (int)std::min<int64_t>(BS, last_pos + 1 - b * BS);
    // Many rows (a prefill tile) share one transposed copy of K, [head_dim][position]: each row's
    // scores are then FMAs across positions with no horizontal sums. A few rows (a decode) read K
    // in place. Only written slots are read: the rest may hold NaN.
    const bool transposed = rows >= kTransposeRows;
    if (transposed)
      for (int t = 0; t < valid; ++t)
        for (int64_t d = 0; d < D; ++d) kt[d * BS + t] = kb[t * slot_stride + d];
    for (int64_t r = 0; r < rows; ++r) {
      // Causality masks a suffix of the block: the row sees positions [0, n) of it.
      const int n = std::min(valid, limit[r] - b * (int)BS + 1);
      if (n <= 0) continue;
      const float* qr = &qrows[r * D];
      if (transposed) {
        for (int t = 0; t < BS; ++t) s[t] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = qr[d];
          const float* kd = &kt[d * BS];
          for (int t = 0; t < BS; ++t) s[t] += qd * kd[t];
        }
      } else {
        for (int t = 0; t < n; ++t) {
          const float* kt_row = kb + t * slot_stride;
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kt_row[d];
          s[t] = dot;
        }
      }
      float block_max = kNoScore;
      for (int t = 0; t < n; ++t) block_max = std::max(block_max, s[t]);
      const float m_new = std::max(m[r], block_max);
      const float alpha = std::exp(m[r] - m_new);  // 0 on the first block
      float sum = 0.0f;
      for (int t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - m_new);
        sum += s[t];
      }
      float* ar = &acc[r * D];
      for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
      for (int t = 0; t < n; ++t) {
        const float p = s[t];
        const float* vt = vb + t * slot_stride;
        for (int64_t d = 0; d < D; ++d) ar[d] += p * vt[d];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
    }
  }
  for (int i = w.first; i < w.last; ++i) {
    for (int g = 0; g < G; ++g) {
      const int64_t r = (i - w.first) * G + g;
      float* dst = out + ((q_start + i) * sh.num_heads + w.kv_head * G + g) * D;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
    }
  }
}

// A decode row (one new token) of G query heads sharing a KV head, with the vectors along head_dim:
// scores for two positions at a time (2 * G independent sums), then p * V for two vectors of head_dim
// at a time, every query head at once, so each K and V row is read from memory once and feeds G
// FMAs per load. Bounds: kMaxHeadDim, kMaxBlockSize; head_dim a multiple of kLanes.
constexpr int kMaxHeadDim = 256, kMaxBlockSize = 128;
constexpr int kAhead = 2;  // blocks

template <int G>
void AttendDecode(const Shapes& sh, const float* q, const float* k_pages, const float* v_pages, const int32_t* table,
                  int seq_len, int64_t token, int kv_head, float scale, float* out) {
  using paged_jax::Load;
  using paged_jax::Vec;
  constexpr int L = paged_jax::kLanes;
  const int64_t D = sh.head_dim, BS = sh.block_size, V = D / L, ss = sh.slot_stride;
  const int64_t block_stride = BS * sh.num_kv_heads * D;
  alignas(64) float qs[G][kMaxHeadDim], acc[G][kMaxHeadDim], s[G][kMaxBlockSize];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    const float* src = q + (token * sh.num_heads + kv_head * G + g) * D;
    for (int64_t d = 0; d < D; ++d) qs[g][d] = src[d] * scale, acc[g][d] = 0.0f;
    m[g] = kNoScore, l[g] = 0.0f;
  }
  auto prefetch = [&](int64_t b) {
    if (b * BS >= seq_len) return;
    const int64_t base = (int64_t)table[b] * block_stride + kv_head * sh.head_stride;
    for (int64_t i = 0; i < std::min<int64_t>(BS, seq_len - b * BS); ++i)
      for (int64_t d = 0; d < D; d += 64 / sizeof(float)) {
        __builtin_prefetch(k_pages + base + i * ss + d);
        __builtin_prefetch(v_pages + base + i * ss + d);
      }
  };
  for (int64_t b = 0; b < kAhead; ++b) prefetch(b);
  for (int64_t b = 0; b * BS < seq_len; ++b) {
    const int64_t base = (int64_t)table[b] * block_stride + kv_head * sh.head_stride;
    const float* kb = k_pages + base;
    const float* vb = v_pages + base;
    const int n = (int)std::min<int64_t>(BS, seq_len - b * BS);  // written slots only: the rest may hold NaN
    // Pages lie in any order, so the hardware prefetcher cannot guess the next ones: ask for them
    // while this one is computed. Without this the kernel waits on memory at a third of its bandwidth.
    prefetch(b + kAhead);
    int t = 0;
    for (; t + 2 <= n; t += 2) {
      Vec a0[G] = {}, a1[G] = {};
      for (int64_t v = 0; v < V; ++v) {
        const Vec k0 = Load(kb + t * ss + v * L), k1 = Load(kb + (t + 1) * ss + v * L);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const Vec qv = Load(&qs[g][v * L]);
          a0[g] += qv * k0;
          a1[g] += qv * k1;
        }
      }
      for (int g = 0; g < G; ++g) s[g][t] = paged_jax::Sum(a0[g]), s[g][t + 1] = paged_jax::Sum(a1[g]);
    }
    for (; t < n; ++t) {
      Vec a0[G] = {};
      for (int64_t v = 0; v < V; ++v) {
        const Vec k0 = Load(kb + t * ss + v * L);
        for (int g = 0; g < G; ++g) a0[g] += Load(&qs[g][v * L]) * k0;
      }
      for (int g = 0; g < G; ++g) s[g][t] = paged_jax::Sum(a0[g]);
    }
    for (int g = 0; g < G; ++g) {  // the online softmax
      float block_max = kNoScore;
      for (int i = 0; i < n; ++i) block_max = std::max(block_max, s[g][i]);
      const float m_new = std::max(m[g], block_max), alpha = std::exp(m[g] - m_new);
      float sum = 0.0f;
      for (int i = 0; i < n; ++i) sum += (s[g][i] = std::exp(s[g][i] - m_new));
      l[g] = l[g] * alpha + sum;
      m[g] = m_new;
      for (int64_t d = 0; d < D; ++d) acc[g][d] *= alpha;
    }
    int64_t v = 0;
    for (; v + 2 <= V; v += 2) {
      Vec c0[G], c1[G];
      for (int g = 0; g < G; ++g) c0[g] = Load(&acc[g][v * L]), c1[g] = Load(&acc[g][(v + 1) * L]);
      for (int i = 0; i < n; ++i) {
        const Vec v0 = Load(vb + i * ss + v * L), v1 = Load(vb + i * ss + (v + 1) * L);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) c0[g] += s[g][i] * v0, c1[g] += s[g][i] * v1;
      }
      for (int g = 0; g < G; ++g) paged_jax::Store(&acc[g][v * L], c0[g]), paged_jax::Store(&acc[g][(v + 1) * L], c1[g]);
    }
    for (; v < V; ++v) {
      Vec c0[G];
      for (int g = 0; g < G; ++g) c0[g] = Load(&acc[g][v * L]);
      for (int i = 0; i < n; ++i) {
        const Vec v0 = Load(vb + i * ss + v * L);
        for (int g = 0; g < G; ++g) c0[g] += s[g][i] * v0;
      }
      for (int g = 0; g < G; ++g) paged_jax::Store(&acc[g][v * L], c0[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* dst = out + (token * sh.num_heads + kv_head * G + g) * D;
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[g][d] * inv;
  }
}

using DecodeFn = void (*)(const Shapes&, const float*, const float*, const float*, const int32_t*, int, int64_t, int,
                          float, float*);

// AttendDecode for this shape, or nullptr where it does not apply (AttendTile serves every shape).
DecodeFn DecodeFor(const Shapes& sh) {
  if (sh.head_dim % paged_jax::kLanes || sh.head_dim > kMaxHeadDim || sh.block_size > kMaxBlockSize) return nullptr;
  switch (sh.num_heads / sh.num_kv_heads) {
    case 1: return AttendDecode<1>;
    case 2: return AttendDecode<2>;
    case 3: return AttendDecode<3>;
    case 4: return AttendDecode<4>;
    case 6: return AttendDecode<6>;
    case 8: return AttendDecode<8>;
    default: return nullptr;
  }
}

ffi::Error PagedAttentionF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                             ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_tables,
                             ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                             float scale, bool single_token_rows_only, int64_t block_size, int64_t num_kv_heads,
                             int64_t slot_stride, int64_t head_stride, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), pd = k_pages.dimensions(), bd = block_tables.dimensions();
  const Shapes sh{qd[0], qd[1], qd[2], pd[0], block_size, num_kv_heads, bd[0], bd[1], slot_stride, head_stride};
  // Strides that could step outside a block must fail here rather than read outside the buffers.
  if (pd[1] * pd[2] != block_size * num_kv_heads || pd[3] != sh.head_dim || sh.num_heads % num_kv_heads ||
      (num_kv_heads - 1) * head_stride + (block_size - 1) * slot_stride + sh.head_dim > pd[1] * pd[2] * pd[3])
    return ffi::Error::InvalidArgument("paged attention: page shape or strides do not match q and the layout");
  std::memset(out->typed_data(), 0, sizeof(float) * sh.num_tokens * sh.num_heads * sh.head_dim);
  const int32_t* lens = seq_lens.typed_data();
  const int32_t* starts = query_start_loc.typed_data();

  std::vector<WorkItem> items;
  const int32_t* tables = block_tables.typed_data();
  for (int s = 0; s < sh.num_seqs; ++s) {
    const int q_len = starts[s + 1] - starts[s];
    if (q_len <= 0 || lens[s] <= 0 || (single_token_rows_only && q_len > 1)) continue;
    // Bad metadata must fail loudly here rather than read outside the buffers.
    if (starts[s] < 0 || starts[s + 1] > sh.num_tokens || q_len > lens[s] || lens[s] > sh.max_blocks * sh.block_size)
      return ffi::Error::InvalidArgument("paged attention: inconsistent seq_lens / query_start_loc");
    for (int64_t b = 0; b * sh.block_size < lens[s]; ++b)
      if (tables[s * sh.max_blocks + b] < 0 || tables[s * sh.max_blocks + b] >= sh.num_blocks)
        return ffi::Error::InvalidArgument("paged attention: block table entry outside the page pool");
    for (int h = 0; h < sh.num_kv_heads; ++h)
      for (int first = 0; first < q_len; first += kTileQ)
        items.push_back({s, h, first, std::min(first + kTileQ, q_len)});
  }
  // Longest contexts first, so the last items handed out are the short ones.
  std::sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return lens[a.seq] - (starts[a.seq + 1] - starts[a.seq]) + a.last >
           lens[b.seq] - (starts[b.seq + 1] - starts[b.seq]) + b.last;
  });
  std::atomic<size_t> next{0};
  const DecodeFn decode = DecodeFor(sh);
  auto work = [&] {
    FlushDenormals flush;
    for (size_t i; (i = next.fetch_add(1)) < items.size();) {
      const WorkItem& w = items[i];
      if (decode != nullptr && starts[w.seq + 1] - starts[w.seq] == 1) {
        decode(sh, q.typed_data(), k_pages.typed_data(), v_pages.typed_data(), tables + w.seq * sh.max_blocks,
               lens[w.seq], starts[w.seq], w.kv_head, scale, out->typed_data());
        continue;
      }
      AttendTile(sh, q.typed_data(), k_pages.typed_data(), v_pages.typed_data(), block_tables.typed_data(),
                 lens[w.seq], starts[w.seq], starts[w.seq + 1] - starts[w.seq], w, scale, out->typed_data());
    }
  };
  paged_jax::RunShared(pool, (int64_t)items.size(), work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionCpuF32, PagedAttentionF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("single_token_rows_only")
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
