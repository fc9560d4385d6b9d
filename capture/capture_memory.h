#pragma once
// How much device memory a capture needs at its peak, counted before anything
// is allocated, from the model's shapes alone. The count follows what
// calib/activation_recorder.cpp and model/transformer.cpp allocate for one
// window (batch 1): the recording forward, and the Fisher pass (saved layer
// inputs, the loss over --loss-chunk positions, one layer recomputed with a
// graph and pushed backward). It is meant as an upper bound: every
// temporary of a step is counted as live at once, so the real peak is lower
// (docs: README.md, capture).
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "formats/hf_config.h"
#include "model/device.h"

namespace kvforge {

struct CaptureMemoryInputs {
  int64_t seq_len = 2048;  // positions per window
  c10::ScalarType dtype = c10::kFloat;
  AttentionBackend attention = AttentionBackend::kEager;
  bool fisher = true;  // a Fisher field is recorded
  int64_t loss_chunk_tokens = 1024;
  // CPU: staged copies of recorded fields (and their float32 conversion
  // for the store) live in the same memory as the compute.
  bool staging_in_same_memory = true;
};

// Bytes, each phase's peak above the weights.
struct CaptureMemoryEstimate {
  int64_t weights = 0;
  int64_t forward = 0;        // recording forward (the Fisher pass's no-grad forward included)
  int64_t loss_head = 0;      // Fisher: the loss and its gradient, one chunk of positions
  int64_t layer_backward = 0; // Fisher: one layer recomputed with a graph and its backward
  int64_t peak() const;       // weights + the largest phase
};

// Parameters of the checkpoint's shapes (embeddings, lm_head unless tied,
// projections, biases, norms).
int64_t parameter_count(const ModelConfig& config);

CaptureMemoryEstimate estimate_capture_memory(const ModelConfig& config, const CaptureMemoryInputs& inputs);

// "1.50 GiB"
std::string format_bytes(int64_t bytes);

}  // namespace kvforge
