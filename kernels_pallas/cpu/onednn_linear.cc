// out = x @ w for prefill-sized row counts, float32, through oneDNN's matmul (its brgemm kernels, the
// recipe of vLLM's CPU build): an XLA FFI custom call in a library of its own, built only where the
// oneDNN wheels are installed (kernels_pallas/cpu/kernel.py).
//
// The weight comes packed once, when the model is loaded, in oneDNN's BA16a64b layout: column panels
// of 64, [ceil(N / 64)][K rounded up to 16][64], zeros in the padding (kernel.py: pack_panels, the
// layout oneDNN's brgemm picks for these shapes when left free to). The panels of 16 of linear.cc
// suit decode's few rows; on hundreds of rows oneDNN's blocking computed SmolLM2's layer matmuls at
// 470-480 GFLOP/s on the 2-core AMD EPYC, where linear.cc reached 360-410 and XLA's dot 410-420.
//
// A primitive is made for each (rows, K, N), rows being the step's real tokens rounded up to a
// multiple of 16 (so a bucket's padding costs at most 15 rows), and kept. Making one generates its
// code: the engine's warm-up makes all it can meet (PagedJaxOneDnnPrepare), so that none is made once
// traffic comes.
// oneDNN runs it on its own OpenMP threads; kernel.py makes them sleep, not spin, between calls,
// where XLA's threads run the ops in between.

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "common.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64, kDepthBlock = 16, kRowStep = 16;

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// The matmul primitive for [M, K] @ packed [K, N], made once per shape.
const dnnl::matmul& Primitive(int64_t M, int64_t K, int64_t N) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<dnnl::matmul>> made;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = made[{M, K, N}];
  if (!slot) {
    using tag = dnnl::memory::format_tag;
    const auto f32 = dnnl::memory::data_type::f32;
    dnnl::matmul::primitive_desc pd(Engine(), dnnl::memory::desc({M, K}, f32, tag::ab),
                                     dnnl::memory::desc({K, N}, f32, tag::BA16a64b),
                                     dnnl::memory::desc({M, N}, f32, tag::ab));
    slot = std::make_unique<dnnl::matmul>(pd);
  }
  return *slot;
}

ffi::Error LinearOneDnn(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> rows,
                        ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  const int64_t K = xd[1], N = od[1];
  if (wd[0] != (N + kPanel - 1) / kPanel || wd[1] != (K + kDepthBlock - 1) / kDepthBlock * kDepthBlock ||
      wd[2] != kPanel || od[0] != xd[0])
    return ffi::Error::InvalidArgument(
        "onednn linear: x [M, K], packed w [ceil(N / 64), K rounded up to 16, 64] and out [M, N] disagree");
  float* outs = out->typed_data();
  const int64_t real = paged_jax::ComputedRows(rows, xd[0], outs, N);
  if (real == 0) return ffi::Error::Success();
  const int64_t M = std::min<int64_t>(xd[0], (real + kRowStep - 1) / kRowStep * kRowStep);
  using tag = dnnl::memory::format_tag;
  const auto f32 = dnnl::memory::data_type::f32;
  dnnl::memory src({{M, K}, f32, tag::ab}, Engine(), x.typed_data());
  dnnl::memory weights({{K, N}, f32, tag::BA16a64b}, Engine(), w.typed_data());
  dnnl::memory dst({{M, N}, f32, tag::ab}, Engine(), outs);
  dnnl::stream stream(Engine());
  Primitive(M, K, N).execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}});
  stream.wait();
  // The rows past the real ones that the rounding computed: zeros, as linear.cc leaves them.
  std::fill(outs + real * N, outs + M * N, 0.0f);
  return ffi::Error::Success();
}

}  // namespace

// The primitive for x [M, K] @ w [K, N], made now if it was not.
extern "C" void PagedJaxOneDnnPrepare(int64_t M, int64_t K, int64_t N) { Primitive(M, K, N); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(LinearOneDnnF32, LinearOneDnn,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
