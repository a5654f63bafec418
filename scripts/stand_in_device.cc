// The device of scripts/bench_overlap.py: an XLA FFI call that holds its XLA thread for a given time
// without using the CPU (it sleeps), and records when each call started and ended (CLOCK_MONOTONIC,
// Python's time.monotonic), for the script to read back.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
std::mutex mu;
std::vector<int64_t> spans;  // start, end, start, end, ... in nanoseconds

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Holds for `micros` times x[0] when `per_step` is set (a multi-step dispatch of x[0] steps), else `micros`.
ffi::Error Hold(ffi::Buffer<ffi::S32> x, ffi::ResultBuffer<ffi::S32> y, int64_t micros, bool per_step) {
  int64_t start = NowNs();
  if (per_step) micros *= std::max<int32_t>(x.typed_data()[0], 0);
  if (micros > 0) std::this_thread::sleep_for(std::chrono::microseconds(micros));
  y->typed_data()[0] = x.typed_data()[0];
  std::lock_guard<std::mutex> lock(mu);
  spans.push_back(start);
  spans.push_back(NowNs());
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StandInHold, Hold,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("micros").Attr<bool>("per_step"));

// Copies up to `max` recorded times into out; returns how many there are.
extern "C" int64_t StandInSpans(int64_t* out, int64_t max) {
  std::lock_guard<std::mutex> lock(mu);
  int64_t n = std::min<int64_t>(max, spans.size());
  std::copy(spans.begin(), spans.begin() + n, out);
  return spans.size();
}
