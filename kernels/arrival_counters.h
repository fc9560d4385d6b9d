#pragma once
// The merge's arrival counters at the start of a decode workspace
// (DecodePlan::merge_in_last_block): one uint32 per (sequence, KV head),
// which every decode that merges in its last blocks leaves zero; and which
// of them a caller's workspace is known to hold zero, so that a planner
// zeroes them only where that is not known (a new workspace, a larger
// batch), not on every decoding step.
#include <algorithm>
#include <cstdint>

namespace kvforge::kernels {

// Bytes of the counters' region at the start of the workspace: `counters`
// of 4 bytes in whole 256-byte units, so that the split states after it
// stay aligned.
constexpr int64_t arrival_region_bytes(int64_t counters) { return (counters * 4 + 255) / 256 * 256; }

class ArrivalZeros {
 public:
  // Whether a call that counts `counters` arrivals in `workspace` (of
  // `bytes`) must zero its region first: `merging` (it merges in its last
  // blocks, which needs them zero) and more of them than are known zero.
  // Records what the call leaves zero: its region's counters (zeroed here,
  // or known zero and left so by the merge), not the counters beyond it,
  // which its split states overwrite.
  bool zero_before(const void* workspace, int64_t bytes, int64_t counters, bool merging) {
    if (workspace != workspace_ || bytes != bytes_) {
      workspace_ = workspace;
      bytes_ = bytes;
      known_zero_ = 0;
    }
    const int64_t region = arrival_region_bytes(counters) / 4;
    const bool zero = merging && counters > known_zero_;
    if (zero) known_zero_ = region;
    known_zero_ = std::min(known_zero_, region);
    return zero;
  }

  // A workspace this planner allocated for one call: zeroed by that call,
  // never known zero afterwards (the allocator may hand its memory to
  // anything before it hands it back).
  void forget() { *this = ArrivalZeros(); }

 private:
  const void* workspace_ = nullptr;
  int64_t bytes_ = 0;
  int64_t known_zero_ = 0;  // counters at the start of workspace_ known zero
};

}  // namespace kvforge::kernels
