// How the per-sequence append kernel splits a sequence's tensor over blocks
// (kernels/append_slices.h): every slice a whole number of the tensor's
// groups, the slices covering the token's channels once, a group a warp
// where per-token groups are sliced, and one block wherever a token's
// outliers or a grouping over the whole token need it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/append_slices.h"
#include "kernels/decode_params.h"
#include "kernels/runtime_layout.h"

namespace kvforge {
namespace {

using kernels::OutlierSelection;
using kernels::Quantization;
using kernels::ScaleGrouping;
using kernels::TensorPageLayout;

constexpr int32_t kWarps = kernels::kAppendBlockThreads / 32;

TensorPageLayout layout(ScaleGrouping grouping, int32_t kv_heads, int32_t head_dim, int32_t group) {
  TensorPageLayout l;
  l.spec.grouping = grouping;
  l.spec.kv_heads = kv_heads;
  l.spec.head_dim = head_dim;
  l.spec.group = group;
  return l;
}

TEST(AppendSlices, KiviValuesTakeAGroupAWarpAndKiviKeysAChannelAThread) {
  const Quantization none;
  // Llama-3-8B's 8 KV heads of 128: values in groups of 32 channels.
  const TensorPageLayout values = layout(ScaleGrouping::kPerToken, 8, 128, 32);
  EXPECT_EQ(kernels::slice_channels(values, none), kWarps * 32);
  EXPECT_EQ(kernels::channel_slices(values, none), 1024 / (kWarps * 32));
  const TensorPageLayout keys = layout(ScaleGrouping::kPerChannelTokens, 8, 128, 32);
  EXPECT_EQ(kernels::slice_channels(keys, none), kernels::kAppendBlockThreads);
  EXPECT_EQ(kernels::channel_slices(keys, none), 1024 / kernels::kAppendBlockThreads);
}

TEST(AppendSlices, OneBlockWhereTheGroupsDoNotOutnumberTheWarpsOrSpanTheToken) {
  const Quantization none;
  // rtn and int2-rot: a group a head, 8 heads, already a group a warp.
  EXPECT_EQ(kernels::channel_slices(layout(ScaleGrouping::kPerToken, 8, 128, 128), none), 1);
  // Groups of 16 channels: not whole warps (the generic per-token path).
  EXPECT_EQ(kernels::channel_slices(layout(ScaleGrouping::kPerToken, 8, 128, 16), none), 1);
  EXPECT_EQ(kernels::channel_slices(layout(ScaleGrouping::kPerTokenAllHeads, 8, 128, 0), none), 1);
  EXPECT_EQ(kernels::channel_slices(layout(ScaleGrouping::kPerChannelOffline, 8, 128, 0), none), 1);
}

TEST(AppendSlices, OutliersKeepTheWholeTokenInOneBlock) {
  for (const ScaleGrouping grouping : {ScaleGrouping::kPerToken, ScaleGrouping::kPerChannelTokens}) {
    const TensorPageLayout l = layout(grouping, 8, 128, 32);
    Quantization top_bottom;
    top_bottom.outliers = OutlierSelection::kTokenTopBottom;
    EXPECT_EQ(kernels::channel_slices(l, top_bottom), 1);
    EXPECT_EQ(kernels::slice_channels(l, top_bottom), 1024);
    TensorPageLayout with_spans = l;
    with_spans.outlier_spans = 1;
    EXPECT_EQ(kernels::channel_slices(with_spans, Quantization{}), 1);
  }
}

// Every shape: the slices tile [0, width) in order, the last possibly
// narrower; per-token slices hold whole groups, at most one a warp, and
// per_channel_tokens slices at most a channel a thread.
TEST(AppendSlices, SlicesTileTheTokenInWholeGroups) {
  const Quantization none;
  int sliced = 0;
  for (const ScaleGrouping grouping : {ScaleGrouping::kPerToken, ScaleGrouping::kPerChannelTokens}) {
    for (int32_t kv_heads = 1; kv_heads <= 16; ++kv_heads) {
      for (const int32_t head_dim : {64, 96, 128, 192, 256}) {
        for (const int32_t group : {32, 64, 128, 256}) {
          if (grouping == ScaleGrouping::kPerToken && head_dim % group != 0) continue;  // G' divides D
          const TensorPageLayout l = layout(grouping, kv_heads, head_dim, group);
          const int32_t width = kv_heads * head_dim;
          const int32_t per_slice = kernels::slice_channels(l, none);
          const int32_t slices = kernels::channel_slices(l, none);
          const std::string at = "heads " + std::to_string(kv_heads) + " dim " + std::to_string(head_dim) +
                                 " group " + std::to_string(group);
          ASSERT_GE(slices, 1) << at;
          ASSERT_GE(static_cast<int64_t>(slices) * per_slice, width) << at;
          ASSERT_LT(static_cast<int64_t>(slices - 1) * per_slice, width) << at;
          if (grouping == ScaleGrouping::kPerToken) {
            const int32_t groups = width / group;
            ASSERT_EQ(per_slice % group, 0) << at;
            ASSERT_LE(per_slice / group, std::max(kWarps, groups)) << at;
            // Sliced exactly where the groups outnumber the warps.
            ASSERT_EQ(slices > 1, groups > kWarps) << at;
            if (slices > 1) ASSERT_EQ(per_slice / group, kWarps) << at;
          } else {
            ASSERT_EQ(per_slice, kernels::kAppendBlockThreads) << at;
          }
          sliced += slices > 1;
        }
      }
    }
  }
  EXPECT_GT(sliced, 100);
}

}  // namespace
}  // namespace kvforge
