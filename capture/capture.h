#pragma once
// kvforge capture: the KVQuant calibration recipe. `samples` windows of
// `seq_len` tokens are drawn from the calibration token stream with a seeded
// generator; each window is recorded (activation_recorder.h) and streamed
// into an activation store, one committed sample at a time, so that an
// interrupted capture resumes where it stopped and yields the same store.
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "capture/activation_recorder.h"
#include "formats/activation_store.h"
#include "model/transformer.h"

namespace kvforge {

// Window starts in the stream: draw i is mt19937_64(seed)'s i-th output modulo
// the number of possible starts. Deterministic across platforms.
std::vector<int64_t> sample_window_starts(int64_t stream_tokens, int64_t window_tokens, int64_t samples,
                                          uint64_t seed);

struct CaptureSettings {
  int64_t samples = 16;
  int64_t seq_len = 2048;  // positions per window, BOS included
  uint64_t seed = 0;
  std::optional<int32_t> bos;
  RecorderOptions recorder;
};

// Records samples [writer.samples_complete(), settings.samples) and commits
// each; `on_committed(sample)` runs after each commit.
void run_capture(const Transformer& model, std::span<const int32_t> stream, const CaptureSettings& settings,
                 ActivationStoreWriter& writer, const std::function<void(int64_t sample)>& on_committed = {});

}  // namespace kvforge
