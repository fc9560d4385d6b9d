#pragma once
// The CPU reference backend with hooks before each append and decode: for
// tests that watch the calls a QuantizedKVCache makes (which kernel a
// launcher would pick, in which order, with which params) or make one fail.
#include <functional>

#include "kernels/quantized_kv_cache.h"

namespace kvforge::testing {

class HookedCpuBackend final : public kernels::KernelBackend {
 public:
  void* allocate(int64_t bytes) override { return cpu_.allocate(bytes); }
  void release(void* memory) noexcept override { cpu_.release(memory); }
  void copy_in(void* to, const void* from, int64_t bytes) override { cpu_.copy_in(to, from, bytes); }
  void copy_out(void* to, const void* from, int64_t bytes) override { cpu_.copy_out(to, from, bytes); }
  bool host_addressable() const override { return true; }
  void append(const kernels::AppendParams& params) override {
    if (before_append) before_append(params);
    cpu_.append(params);
  }
  void decode_attention(const kernels::DecodeParams& params) override {
    if (before_decode) before_decode(params);
    cpu_.decode_attention(params);
  }
  // The base class's append then decode_attention (so through the hooks
  // above), after its own hook.
  bool decode_step(const kernels::AppendParams& step_append, const kernels::DecodeParams& decode) override {
    if (before_step) before_step(step_append, decode);
    return KernelBackend::decode_step(step_append, decode);
  }
  void synchronize() override {}

  // Runs before each append; an exception it throws is the append's.
  std::function<void(const kernels::AppendParams&)> before_append;
  std::function<void(const kernels::DecodeParams&)> before_decode;
  std::function<void(const kernels::AppendParams&, const kernels::DecodeParams&)> before_step;

 private:
  kernels::CpuReferenceBackend cpu_;
};

}  // namespace kvforge::testing
