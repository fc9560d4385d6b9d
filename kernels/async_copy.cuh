#pragma once
// Asynchronous global -> shared copies (cp.async, sm_80+): bytes in flight
// while earlier ones are computed, held by no register. The decode kernels'
// stages and the token-parallel append's rotation rows.
#include <cstdint>

namespace kvforge::kernels {

// kBytes (4, 8 or 16) from `global` to `shared`; 16-byte copies bypass L1.
template <int kBytes>
__device__ inline void copy_async(void* shared, const void* global) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(address), "l"(global), "n"(kBytes) : "memory");
  }
}
// The same to a 32-bit shared-memory address, skipped where !copy: the
// int8 kernel's walk keeps its destinations as such addresses (no generic-
// to-shared conversion per copy) and predicates its copies rather than
// branching around them.
template <int kBytes>
__device__ inline void copy_async_to(uint32_t shared, const void* global, bool copy) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (kBytes == 16) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16;\n}\n" ::"r"(shared),
        "l"(global), "r"(static_cast<int>(copy))
        : "memory");
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.ca.shared.global [%0], [%1], %3;\n}\n" ::"r"(shared),
        "l"(global), "r"(static_cast<int>(copy)), "n"(kBytes)
        : "memory");
  }
}

// Closes the group of the copies issued since the last commit.
__device__ inline void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most kPending committed groups are still in flight.
template <int kPending>
__device__ inline void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace kvforge::kernels
