#include "capture/capture.h"

#include <ATen/ATen.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <string>

#include "capture/host_stager.h"
#include "log/log.h"
#include "log/progress.h"

namespace kvforge {

std::vector<int64_t> sample_window_starts(int64_t stream_tokens, int64_t window_tokens, int64_t samples,
                                          uint64_t seed) {
  if (window_tokens > stream_tokens) {
    throw std::invalid_argument("--seq-len: the data has " + std::to_string(stream_tokens) +
                                " tokens, fewer than one window of " + std::to_string(window_tokens));
  }
  const auto choices = static_cast<uint64_t>(stream_tokens - window_tokens + 1);
  std::mt19937_64 generator(seed);
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < samples; ++i) starts.push_back(static_cast<int64_t>(generator() % choices));
  return starts;
}

namespace {

std::span<const float> as_floats(const at::Tensor& host_float32) {
  return {host_float32.data_ptr<float>(), static_cast<size_t>(host_float32.numel())};
}

}  // namespace

void run_capture(const Transformer& model, std::span<const int32_t> stream, const CaptureSettings& settings,
                 ActivationStoreWriter& writer, const std::function<void(int64_t)>& on_committed) {
  const int64_t bos = settings.bos ? 1 : 0;
  const int64_t stream_length = settings.seq_len - bos;
  const auto starts =
      sample_window_starts(static_cast<int64_t>(stream.size()), stream_length, settings.samples, settings.seed);
  const int64_t first = writer.samples_complete();
  if (first > 0) log::info("resuming at sample ", first, " of ", settings.samples);
  log::ProgressMeter progress("capture", settings.samples - first);
  HostStager stager(model.target().device);
  for (int64_t sample = first; sample < settings.samples; ++sample) {
    std::vector<int32_t> window;
    if (settings.bos) window.push_back(*settings.bos);
    const auto begin = stream.begin() + starts[static_cast<size_t>(sample)];
    window.insert(window.end(), begin, begin + stream_length);
    writer.write_tokens(sample, starts[static_cast<size_t>(sample)], window);

    const at::Tensor ids = at::tensor(at::ArrayRef<int32_t>(window), at::kInt).to(at::kLong).unsqueeze(0);
    // Copies leave the GPU while it computes; the store is written once the
    // sample's compute is done.
    const double loss = record_activations(
        model, ids, settings.recorder, [&](ActivationField field, int64_t layer, const at::Tensor& values) {
          stager.stage(values[0], [&writer, field, layer, sample](const at::Tensor& host) {
            writer.write(field, layer, sample, as_floats(host.to(at::kFloat).contiguous()));
          });
          stager.drain_ready();  // write what has arrived while the GPU computes on
        });
    stager.drain();
    writer.commit_sample(sample);
    if (on_committed) on_committed(sample);
    progress.advance(1, settings.seq_len, std::isnan(loss) ? std::string() : log::concat("loss ", loss));
  }
  progress.finish();
}

}  // namespace kvforge
