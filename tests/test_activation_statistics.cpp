// Channel statistics of an activation store against a two-pass float64
// computation written here.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "calib/activation_statistics.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

TEST(ChannelStatistics, MatchATwoPassReference) {
  const auto dir = testing::scratch_dir("stats");
  ActivationStoreLayout layout;
  layout.model = {"LlamaForCausalLM", 2, 4, 2, 4, 16, 32, "{}", "kvo", "tok"};
  layout.provenance.samples = 3;
  layout.provenance.seq_len = 5;
  layout.fields = {ActivationField::kKeysPreRope};
  const int64_t kv_heads = 2, dims = 4, tokens = 5, samples = 3;
  // data[layer][sample][head][token][dim]; channel (1, 2) of layer 1 is an outlier.
  std::mt19937 generator(5);
  std::student_t_distribution<float> heavy(3.0f);
  std::vector<std::vector<float>> data(2 * samples);
  {
    auto writer = ActivationStoreWriter::create(dir / "s.h5", layout);
    for (int64_t sample = 0; sample < samples; ++sample) {
      writer.write_tokens(sample, 0, std::vector<int32_t>(tokens, 1));
      for (int64_t layer = 0; layer < 2; ++layer) {
        auto& slab = data[static_cast<size_t>(layer * samples + sample)];
        for (int64_t i = 0; i < kv_heads * tokens * dims; ++i) {
          const int64_t head = i / (tokens * dims), dim = i % dims;
          slab.push_back(heavy(generator) + ((layer == 1 && head == 1 && dim == 2) ? 40.0f : 0.0f));
        }
        writer.write(ActivationField::kKeysPreRope, layer, sample, slab);
      }
      writer.commit_sample(sample);
    }
    writer.close();
  }
  const ActivationStoreReader store(dir / "s.h5");
  const auto stats = channel_statistics(store, ActivationField::kKeysPreRope, 0, 2);
  ASSERT_EQ(stats.size(), 2u);
  for (int64_t layer = 0; layer < 2; ++layer) {
    for (int64_t head = 0; head < kv_heads; ++head) {
      for (int64_t dim = 0; dim < dims; ++dim) {
        std::vector<double> x;
        for (int64_t sample = 0; sample < samples; ++sample) {
          for (int64_t token = 0; token < tokens; ++token) {
            x.push_back(data[static_cast<size_t>(layer * samples + sample)]
                            [static_cast<size_t>((head * tokens + token) * dims + dim)]);
          }
        }
        double mean = 0, mean_abs = 0;
        for (double v : x) mean += v / x.size(), mean_abs += std::abs(v) / x.size();
        double m2 = 0, m4 = 0;
        for (double v : x) m2 += std::pow(v - mean, 2) / x.size(), m4 += std::pow(v - mean, 4) / x.size();
        const size_t channel = static_cast<size_t>(head * dims + dim);
        EXPECT_NEAR(stats[layer].mean_abs[channel], mean_abs, 1e-9);
        EXPECT_NEAR(stats[layer].kurtosis[channel], m4 / (m2 * m2), 1e-6);
      }
    }
    EXPECT_EQ(stats[layer].tokens, samples * tokens);
  }
  EXPECT_EQ(stats[1].top_channels.front(), 1 * dims + 2);
  EXPECT_GT(stats[1].max_over_median, 10.0);
  EXPECT_LT(stats[0].max_over_median, 10.0);
}

}  // namespace
}  // namespace kvforge
