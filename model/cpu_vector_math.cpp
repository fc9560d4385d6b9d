#include "model/cpu_vector_math.h"

#include <ATen/ATen.h>

namespace kvforge {

void prepare_cpu_vector_math() {
  // A function-local static: initialized once, by the first caller, while
  // any other caller waits (C++11 guarantees it), which is the point.
  static const bool prepared = [] {
    // Fewer elements than ATen's 2048-element chunk: one chunk, this thread.
    (void)at::exp(at::ones({16}, at::kFloat));
    return true;
  }();
  (void)prepared;
}

}  // namespace kvforge
