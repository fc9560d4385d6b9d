// The addressing a per_channel_tokens group's completion uses in the append
// kernel (kernels/runtime_layout.h: group_ring, exact_row_stride,
// exact_channel_offset, code_channel_offset) against the layout's own
// definitions (exact_store_row, exact_row_offset, code_row_offset), over
// sliding and block-flushed rings that wrap inside a group or hold many,
// sinks, page sizes, bits and element types.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/runtime_layout.h"

namespace kvforge {
namespace {

using kernels::ElementType;
using kernels::ScaleGrouping;
using kernels::TensorLayoutSpec;
using kernels::TensorPageLayout;
using kernels::WindowRule;

TensorLayoutSpec group_spec(int32_t group, int32_t residual, int32_t sink, WindowRule rule) {
  TensorLayoutSpec s;
  s.kv_heads = 2;
  s.head_dim = 64;
  s.grouping = ScaleGrouping::kPerChannelTokens;
  s.group = group;
  s.residual_tokens = residual;
  s.sink_tokens = sink;
  s.window_rule = rule;
  return s;
}

TEST(GroupRing, RowsAreTheExactStoresRowsOfTheGroupsTokens) {
  int checked = 0;
  for (const int32_t group : {1, 2, 6, 12, 32}) {
    for (const int32_t sink : {0, 1, 4}) {
      for (const WindowRule rule : {WindowRule::kSliding, WindowRule::kBlockFlush}) {
        // Block flush: residuals of whole groups (QuantizedKVCache refuses
        // others); sliding: none, fewer than a group and several.
        const std::vector<int32_t> residuals =
            rule == WindowRule::kBlockFlush ? std::vector<int32_t>{group, 4 * group} : std::vector<int32_t>{0, 5, 128};
        for (const int32_t residual : residuals) {
          const TensorPageLayout l = kernels::page_layout(group_spec(group, residual, sink, rule));
          ASSERT_GE(l.ring_capacity, group - 1);
          for (int32_t g = 0; g < 200; ++g) {
            const int32_t first = g * group;
            const kernels::GroupRing rows = kernels::group_ring(l, first);
            for (int32_t i = 0; i + 1 < group; ++i) {
              ASSERT_EQ(rows.row(i), kernels::exact_store_row(l, sink + first + i))
                  << "group " << group << " sink " << sink << " residual " << residual << " g " << g << " i " << i;
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 100000);
}

TEST(GroupRing, ChannelOffsetsSplitTheLayoutsRowOffsets) {
  for (const ElementType element : {ElementType::kFloat16, ElementType::kBFloat16, ElementType::kFloat32}) {
    for (const int32_t bits : {2, 4}) {
      for (const int32_t page_size : {1, 12, 16}) {
        for (const int32_t head_dim : {64, 128}) {
          TensorLayoutSpec s = group_spec(32, 96, 4, WindowRule::kSliding);
          s.kv_heads = 8;
          s.head_dim = head_dim;
          s.bits = bits;
          s.page_size = page_size;
          s.element = element;
          const TensorPageLayout l = kernels::page_layout(s);
          const int64_t rows = s.sink_tokens + l.ring_capacity;
          const int64_t element_bytes = kernels::element_bytes(element);
          const int32_t per_word = 32 / bits;
          for (int32_t head = 0; head < s.kv_heads; ++head) {
            for (int32_t d = 0; d < head_dim; ++d) {
              const int32_t channel = head * head_dim + d;
              for (int64_t row = 0; row < rows; row += 7) {
                ASSERT_EQ(row * kernels::exact_row_stride(l) + kernels::exact_channel_offset(l, channel),
                          kernels::exact_row_offset(l, head, row) + d * element_bytes)
                    << "head " << head << " d " << d << " row " << row;
              }
              for (int32_t in_page = 0; in_page < page_size; ++in_page) {
                ASSERT_EQ(in_page * l.row_bytes + kernels::code_channel_offset(l, channel),
                          kernels::code_row_offset(l, head, in_page) + 4 * (d / per_word))
                    << "head " << head << " d " << d << " slot " << in_page;
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvforge
