// What the CPU kernels share: the vector type their inner loops use, and sharing one call's work out
// over XLA's intra-op thread pool (the FFI's ThreadPool).

#ifndef PAGED_JAX_CPU_COMMON_H_
#define PAGED_JAX_CPU_COMMON_H_

#include <algorithm>
#include <bit>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace paged_jax {

// GCC vector types, so that -march=native picks the widest vectors the machine has. Loads and stores
// through Vec pointers need only float alignment.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));

inline Vec Load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }

// bfloat16 as the FFI hands it over: the high 16 bits of a float32. Widening one is exact: a
// zero-extension and a shift (vpmovzxwd and vpslld on x86, ushll on ARM), so kernels read 16-bit
// pages at half the bytes and compute in float32 as they do on float32 pages. Loads need only
// uint16_t alignment.
using BF16 = uint16_t;
typedef uint16_t HalfVec __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(sizeof(uint16_t))));
typedef uint32_t WideVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline Vec Load(const BF16* p) {
  return (Vec)(__builtin_convertvector(*reinterpret_cast<const HalfVec*>(p), WideVec) << 16);  // a bit cast
}
inline float ToFloat(float x) { return x; }
inline float ToFloat(BF16 x) { return std::bit_cast<float>(uint32_t{x} << 16); }

inline float Sum(Vec v) {
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += v[l];
  return sum;
}

// The helpers of one kernel call: those that enter before close_and_wait run, and it waits for them.
class Join {
 public:
  bool enter() {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    ++running_;
    return true;
  }
  void leave() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--running_ == 0) idle_.notify_all();
  }
  void close_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    closed_ = true;
    idle_.wait(lock, [this] { return running_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable idle_;
  int running_ = 0;
  bool closed_ = false;
};

// Runs work() on the calling thread and on up to num_items - 1 pool threads; work() takes items from
// a counter of its own until none are left, so every copy may run or not.
//
// Waits only for the helpers that started before the work ran out, never for one still queued: the
// pool may be busy with calls like this one (several devices of one host, each on a pool thread),
// each of which would otherwise wait for helpers queued behind the others, for ever. A helper that
// starts late touches nothing but the shared `join`, which outlives this call.
template <typename Work>
void RunShared(xla::ffi::ThreadPool& pool, int64_t num_items, Work& work) {
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), num_items - 1));
  auto join = std::make_shared<Join>();
  for (int64_t t = 0; t < helpers; ++t)
    pool.Schedule([join, &work] {
      if (!join->enter()) return;
      work();
      join->leave();
    });
  work();
  join->close_and_wait();
}

}  // namespace paged_jax

#endif  // PAGED_JAX_CPU_COMMON_H_
