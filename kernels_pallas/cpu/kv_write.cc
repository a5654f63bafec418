// A step's new K/V rows into bfloat16 pages, in place: an XLA FFI custom call whose results alias the
// pages it is given (kernels_pallas/cpu/kernel.py: write_kv_cpu).
//
// XLA's CPU backend computes a scatter into 16-bit floats in float32: it converts the whole operand,
// a layer's page pool, to float32 and back around every write, and even a scatter into the pool's
// bits as 16-bit integers went through two elementwise copies of it (bitcast-convert is a loop
// there). This writes the step's rows and touches nothing else. Rounding is to nearest, ties to
// even, in integer arithmetic, exactly as XLA's convert and ml_dtypes round (subnormals included,
// which vcvtneps2bf16 would flush; a step writes a few thousand values, so speed is no concern).

#include <cstdint>
#include <cstring>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

paged_jax::BF16 RoundToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (paged_jax::BF16)((bits >> 16) | 0x40);  // NaN stays NaN
  return (paged_jax::BF16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

ffi::Error WriteKvBf16(ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, int64_t block_size, int64_t slot_stride,
                       int64_t head_stride, ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const auto kd = k.dimensions(), pd = k_pages.dimensions();
  const int64_t num_tokens = kd[0], heads = kd[1], dim = kd[2];
  if (k_pages.element_type() != ffi::DataType::BF16 || v_pages.element_type() != ffi::DataType::BF16 ||
      pd.size() != 4 || v.element_count() != k.element_count() || v_pages.element_count() != k_pages.element_count() ||
      slot_mapping.element_count() != num_tokens || pd[3] != dim || pd[1] * pd[2] != block_size * heads ||
      (heads - 1) * head_stride + (block_size - 1) * slot_stride + dim > pd[1] * pd[2] * pd[3])
    return ffi::Error::InvalidArgument("write kv: k/v [tokens, kv_heads, head_dim] do not match the bfloat16 pages");
  const int64_t num_blocks = pd[0], block_stride = pd[1] * pd[2] * pd[3];
  const float* rows[2] = {k.typed_data(), v.typed_data()};
  const ffi::AnyBuffer* in[2] = {&k_pages, &v_pages};
  ffi::Result<ffi::AnyBuffer>* out[2] = {&k_out, &v_out};
  const int32_t* slots = slot_mapping.typed_data();
  for (int which = 0; which < 2; ++which) {
    // reinterpret: typed_data<uint16_t> would assert that the buffer holds U16
    auto* pages = (*out[which])->reinterpret_data<paged_jax::BF16>();
    if ((void*)pages != in[which]->untyped_data())  // XLA aliases them; were it ever not to, start from the input
      std::memcpy(pages, in[which]->untyped_data(), in[which]->size_bytes());
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slots[t], block = slot / block_size;
      if (slot < 0 || block >= num_blocks) continue;  // padding, dropped as XLA's scatter mode "drop" does
      for (int64_t h = 0; h < heads; ++h) {
        const float* src = rows[which] + (t * heads + h) * dim;
        paged_jax::BF16* dst = pages + block * block_stride + h * head_stride + slot % block_size * slot_stride;
        for (int64_t d = 0; d < dim; ++d) dst[d] = RoundToBf16(src[d]);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteKvCpuBf16, WriteKvBf16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("slot_stride")
                                  .Attr<int64_t>("head_stride")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
