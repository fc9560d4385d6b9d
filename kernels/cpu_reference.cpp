#include "kernels/cpu_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "kernels/element_conversion.h"
#include "kernels/pair_affine.h"

namespace kvforge::kernels {

void ReadTally::add(const void* address, int64_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(address);
  ranges_.emplace_back(begin, begin + static_cast<uintptr_t>(bytes));
}

int64_t ReadTally::distinct_bytes() const {
  std::vector<std::pair<uintptr_t, uintptr_t>> sorted = ranges_;
  std::sort(sorted.begin(), sorted.end());
  int64_t total = 0;
  uintptr_t covered = 0;  // the end of the ranges merged so far
  for (const auto& [begin, end] : sorted) {
    if (end <= covered) continue;
    total += static_cast<int64_t>(end - std::max(begin, covered));
    covered = end;
  }
  return total;
}

namespace {

// ---------------------------------------------------------------- bytes

// Codes, little-endian: channel d's code is bits [d * b, (d + 1) * b) of the
// row, bit i of the row being bit i mod 8 of byte i / 8 (2 and 4 bits never
// straddle a byte).
void put_code(uint8_t* row, int64_t channel, int bits, int code) {
  const int64_t bit = channel * bits;
  row[bit / 8] = static_cast<uint8_t>(row[bit / 8] | (code << (bit % 8)));
}

int get_code(const uint8_t* row, int64_t channel, int bits) {
  const int64_t bit = channel * bits;
  return (row[bit / 8] >> (bit % 8)) & ((1 << bits) - 1);
}

uint32_t load_u32(const uint8_t* at) {
  uint32_t value;
  std::memcpy(&value, at, 4);
  return value;
}

void store_u32(uint8_t* at, uint32_t value) { std::memcpy(at, &value, 4); }

uint32_t load_index(const uint8_t* at, int64_t bytes) {
  if (bytes == 4) return load_u32(at);
  uint16_t value;
  std::memcpy(&value, at, 2);
  return value;
}

void store_index(uint8_t* at, int64_t bytes, uint32_t index) {
  if (bytes == 4) {
    store_u32(at, index);
    return;
  }
  const auto value = static_cast<uint16_t>(index);
  std::memcpy(at, &value, 2);
}

void tally(ReadTally* read_tally, const void* address, int64_t bytes) {
  if (read_tally != nullptr) read_tally->add(address, bytes);
}

// ---------------------------------------------------------------- append

int64_t tensor_width(const TensorPageLayout& layout) {
  return static_cast<int64_t>(layout.spec.kv_heads) * layout.spec.head_dim;
}

// One token of one tensor kind as append quantizes and stores it: the input
// rounded to the element type, rotated in float64 and rounded again.
// [kv_heads * D], every value an element-type number.
std::vector<double> prepare_token(const void* input, ElementType input_type, int64_t row,
                                  const TensorPageLayout& layout, const Rotation& rotation) {
  const ElementType element = layout.spec.element;
  const int64_t width = tensor_width(layout), dim = layout.spec.head_dim;
  const auto* bytes = static_cast<const uint8_t*>(input) + row * width * element_bytes(input_type);
  std::vector<double> x(static_cast<size_t>(width));
  for (int64_t i = 0; i < width; ++i) {
    x[i] = round_to_element(element, load_element(input_type, bytes + i * element_bytes(input_type)));
  }
  if (rotation.kind == RotationKind::kNone) return x;
  std::vector<double> y(x.size());
  for (int64_t head = 0; head < layout.spec.kv_heads; ++head) {
    const double* in = x.data() + head * dim;
    double* out = y.data() + head * dim;
    if (rotation.kind == RotationKind::kMatrix) {
      // y_j = sum_i (x_i - c_i) R_ij, i ascending, one fma per term.
      const float* matrix = rotation.matrix + head * dim * dim;
      const float* centre = rotation.centre != nullptr ? rotation.centre + head * dim : nullptr;
      for (int64_t j = 0; j < dim; ++j) {
        double sum = 0;
        for (int64_t i = 0; i < dim; ++i) {
          const double shifted = centre != nullptr ? in[i] - static_cast<double>(centre[i]) : in[i];
          sum = std::fma(shifted, static_cast<double>(matrix[i * dim + j]), sum);
        }
        out[j] = sum;
      }
    } else {
      const int64_t half = dim / 2;
      for (int64_t j = 0; j < half; ++j) {
        const double c = rotation.pair_cos[head * half + j], s = rotation.pair_sin[head * half + j];
        const double a = in[j], b = in[j + half];
        out[j] = std::fma(a, c, -(b * s));
        out[j + half] = std::fma(a, s, b * c);
      }
    }
  }
  for (double& value : y) value = round_to_element(element, value);
  return y;
}

// The k largest and k smallest of one span (ties: lower index first), or all
// of it when 2k >= n (rule 3 of the pinned rules).
void mark_top_bottom(const double* values, int64_t n, int64_t k, uint8_t* mask) {
  if (k <= 0) return;
  if (2 * k >= n) {
    std::fill(mask, mask + n, uint8_t{1});
    return;
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
  for (int64_t i = 0; i < k; ++i) mask[order[i]] = 1;
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return values[a] < values[b] || (values[a] == values[b] && a < b);
  });
  for (int64_t i = 0; i < k; ++i) mask[order[i]] = 1;
}

// |x - mean| > tau * std over one head's D channels (population std; sums
// in channel order).
void mark_tau(const double* values, int64_t n, double tau, uint8_t* mask) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += values[i];
  const double mean = sum / static_cast<double>(n);
  double squares = 0;
  for (int64_t i = 0; i < n; ++i) squares += (values[i] - mean) * (values[i] - mean);
  const double deviation = std::sqrt(squares / static_cast<double>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (std::fabs(values[i] - mean) > deviation * tau) mask[i] = 1;
  }
}

std::vector<uint8_t> outlier_mask(const TensorPageLayout& layout, const Quantization& q, const double* y) {
  const int64_t width = tensor_width(layout), dim = layout.spec.head_dim;
  std::vector<uint8_t> mask(static_cast<size_t>(width), 0);
  switch (q.outliers) {
    case OutlierSelection::kNone:
      break;
    case OutlierSelection::kChannelThresholds:
      for (int64_t i = 0; i < width; ++i) {
        mask[i] = y[i] < static_cast<double>(q.outlier_low[i]) || y[i] > static_cast<double>(q.outlier_high[i]);
      }
      break;
    case OutlierSelection::kTokenTopBottom:
      if (layout.spec.grouping == ScaleGrouping::kPerTokenAllHeads) {
        mark_top_bottom(y, width, q.top_bottom_count, mask.data());
      } else {
        for (int64_t head = 0; head < layout.spec.kv_heads; ++head) {
          mark_top_bottom(y + head * dim, dim, q.top_bottom_count, mask.data() + head * dim);
        }
      }
      break;
    case OutlierSelection::kTokenTau:
      for (int64_t head = 0; head < layout.spec.kv_heads; ++head) {
        mark_tau(y + head * dim, dim, q.outlier_tau, mask.data() + head * dim);
      }
      break;
  }
  return mask;
}

// The inlier minimum and maximum of a group; (0, 0) without inliers (every
// element is then an outlier and the pair is never used).
struct GroupRange {
  double min = 0, max = 0;
  bool any = false;
  void add(double value) {
    if (!any) {
      min = max = value;
      any = true;
    } else {
      min = std::min(min, value);
      max = std::max(max, value);
    }
  }
};

// The index of the encode-grid level nearest to `normalized`: the number of
// midpoints strictly below it (torch.bucketize, right=False): ties go to the
// lower level.
int level_code(double normalized, const double* midpoints, int levels) {
  int code = 0;
  while (code < levels - 1 && midpoints[code] < normalized) ++code;
  return code;
}

int clamp_code(double rounded, int top) {
  return static_cast<int>(std::clamp(rounded, 0.0, static_cast<double>(top)));
}

// A runtime group's code for x (outliers included: the value clamped into
// the group's range); 0 for groups kept as they are (hi <= lo).
int runtime_code(const Quantization& q, double x, const GroupRange& range) {
  const int top = (1 << q.bits) - 1;
  const double lo = range.min * q.clip_ratio, hi = range.max * q.clip_ratio;
  if (!(hi > lo)) return 0;
  if (!q.non_uniform) {
    const double scale = (hi - lo) / top;
    return clamp_code(std::nearbyint((x - lo) / scale), top);
  }
  const double center = (lo + hi) / 2, half = (hi - lo) / 2;
  return level_code((x - center) / half, q.encode_midpoints, top + 1);
}

int offline_code(const Quantization& q, double x, int64_t channel) {
  const int top = (1 << q.bits) - 1;
  const double normalized =
      (x - static_cast<double>(q.channel_offset[channel])) / static_cast<double>(q.channel_scale[channel]);
  if (q.non_uniform) return level_code(normalized, q.encode_midpoints, top + 1);
  return clamp_code(std::nearbyint((normalized + 1) * top / 2), top);
}

// Appends one kind's tokens of one sequence slot.
class TensorAppender {
 public:
  TensorAppender(const PagedTensor& cache, const Quantization& q, const OutlierAllocator& allocator, int32_t slot,
                 const int32_t* page_row)
      : cache_(cache), layout_(cache.layout), q_(q), allocator_(allocator), slot_(slot), page_row_(page_row) {}

  // Token t (absolute index in the sequence) with values y; false when the
  // outlier pool ran out.
  bool append(int64_t token, const std::vector<double>& y) {
    const int64_t sink = layout_.spec.sink_tokens;
    if (token < sink) {
      store_exact(token, y.data());
      return true;
    }
    const int64_t s = token - sink, ring = layout_.ring_capacity;
    bool ok = true;
    if (layout_.spec.grouping != ScaleGrouping::kPerChannelTokens) {
      ok = quantize_token(s, y.data());
    } else if ((s + 1) % layout_.spec.group == 0) {
      ok = quantize_channel_group(s / layout_.spec.group, y);
    }
    // After the group: with a ring of G - 1 tokens (sliding, no residual) the
    // completing token takes the slot of its group's first token.
    if (ring > 0) store_exact(sink + s % ring, y.data());
    return ok;
  }

 private:
  uint8_t* page_of_slot(int64_t s) const {
    return cache_.pages + static_cast<int64_t>(page_row_[s / layout_.spec.page_size]) * layout_.page_bytes;
  }

  void store_exact(int64_t row, const double* y) const {
    const int64_t dim = layout_.spec.head_dim, element = element_bytes(layout_.spec.element);
    uint8_t* base = cache_.exact + slot_ * layout_.exact_slot_bytes;
    for (int64_t head = 0; head < layout_.spec.kv_heads; ++head) {
      uint8_t* out = base + exact_row_offset(layout_, head, row);
      for (int64_t d = 0; d < dim; ++d) store_element(layout_.spec.element, y[head * dim + d], out + d * element);
    }
  }

  std::vector<double> load_exact(int64_t row) const {
    const int64_t dim = layout_.spec.head_dim, element = element_bytes(layout_.spec.element);
    const uint8_t* base = cache_.exact + slot_ * layout_.exact_slot_bytes;
    std::vector<double> y(static_cast<size_t>(tensor_width(layout_)));
    for (int64_t head = 0; head < layout_.spec.kv_heads; ++head) {
      const uint8_t* in = base + exact_row_offset(layout_, head, row);
      for (int64_t d = 0; d < dim; ++d) y[head * dim + d] = load_element(layout_.spec.element, in + d * element);
    }
    return y;
  }

  void store_pair(uint8_t* at, const GroupRange& range) const {
    const int64_t element = element_bytes(layout_.spec.element);
    store_element(layout_.spec.element, range.min, at);
    store_element(layout_.spec.element, range.max, at + element);
  }

  void write_codes(uint8_t* page, int64_t in_page, const std::vector<int>& codes) const {
    const int64_t dim = layout_.spec.head_dim;
    for (int64_t head = 0; head < layout_.spec.kv_heads; ++head) {
      uint8_t* row = page + code_row_offset(layout_, head, in_page);
      std::memset(row, 0, static_cast<size_t>(layout_.row_bytes));
      for (int64_t d = 0; d < dim; ++d) put_code(row, d, layout_.spec.bits, codes[head * dim + d]);
    }
  }

  bool quantize_token(int64_t s, const double* y) {
    uint8_t* page = page_of_slot(s);
    const int64_t in_page = s % layout_.spec.page_size;
    const int64_t width = tensor_width(layout_), dim = layout_.spec.head_dim;
    const std::vector<uint8_t> mask = outlier_mask(layout_, q_, y);
    std::vector<int> codes(static_cast<size_t>(width), 0);
    const auto quantize_group = [&](int64_t first, int64_t count, uint8_t* pair) {
      GroupRange range;
      for (int64_t i = first; i < first + count; ++i) {
        if (!mask[i]) range.add(y[i]);
      }
      store_pair(pair, range);
      for (int64_t i = first; i < first + count; ++i) codes[i] = runtime_code(q_, y[i], range);
    };
    switch (layout_.spec.grouping) {
      case ScaleGrouping::kPerToken: {
        const int64_t group = layout_.spec.group;
        for (int64_t head = 0; head < layout_.spec.kv_heads; ++head) {
          for (int64_t g = 0; g < dim / group; ++g) {
            quantize_group(head * dim + g * group, group, page + token_pair_offset(layout_, head, in_page, g));
          }
        }
        break;
      }
      case ScaleGrouping::kPerTokenAllHeads:
        quantize_group(0, width, page + token_pair_offset(layout_, 0, in_page, 0));
        break;
      case ScaleGrouping::kPerChannelOffline:
        for (int64_t i = 0; i < width; ++i) codes[i] = offline_code(q_, y[i], i);
        break;
      case ScaleGrouping::kPerChannelTokens:
        break;  // quantize_channel_group
    }
    write_codes(page, in_page, codes);
    return write_outlier_rows(page, in_page, y, mask);
  }

  // Group g of G token slots [g G, (g + 1) G); its last token `last` is new,
  // the others are read back from the ring.
  bool quantize_channel_group(int64_t g, const std::vector<double>& last) {
    const int64_t group = layout_.spec.group, width = tensor_width(layout_);
    const int64_t sink = layout_.spec.sink_tokens, ring = layout_.ring_capacity;
    std::vector<std::vector<double>> tokens;
    std::vector<std::vector<uint8_t>> masks;
    for (int64_t i = 0; i < group; ++i) {
      tokens.push_back(i == group - 1 ? last : load_exact(sink + (g * group + i) % ring));
      masks.push_back(outlier_mask(layout_, q_, tokens.back().data()));
    }
    std::vector<std::vector<int>> codes(static_cast<size_t>(group), std::vector<int>(static_cast<size_t>(width)));
    for (int64_t channel = 0; channel < width; ++channel) {
      GroupRange range;
      for (int64_t i = 0; i < group; ++i) {
        if (!masks[i][channel]) range.add(tokens[i][channel]);
      }
      const int64_t sigma = channel_pair_stream_index(layout_, g, channel);
      uint8_t* page = cache_.pages + static_cast<int64_t>(page_row_[sigma / pairs_per_page(layout_)]) * layout_.page_bytes;
      store_pair(page + layout_.params_offset + (sigma % pairs_per_page(layout_)) * layout_.pair_bytes, range);
      for (int64_t i = 0; i < group; ++i) codes[i][channel] = runtime_code(q_, tokens[i][channel], range);
    }
    for (int64_t i = 0; i < group; ++i) {
      const int64_t s = g * group + i;
      uint8_t* page = page_of_slot(s);
      write_codes(page, s % layout_.spec.page_size, codes[i]);
      if (!write_outlier_rows(page, s % layout_.spec.page_size, tokens[i].data(), masks[i])) return false;
    }
    return true;
  }

  // The token's CSR rows (one per span, in span order), entries in ascending
  // index; row pointers count the slot's entries before each row's end.
  bool write_outlier_rows(uint8_t* page, int64_t in_page, const double* y, const std::vector<uint8_t>& mask) {
    const int64_t spans = layout_.outlier_spans, span = layout_.outlier_span_size;
    for (int64_t r = 0; r < spans; ++r) {
      const int64_t row = in_page * spans + r;
      if (row == 0) store_u32(page + row_pointer_offset(layout_, 0), allocator_.entry_counts[slot_]);
      for (int64_t j = 0; j < span; ++j) {
        const int64_t element = r * span + j;  // spans tile the token's kv_heads * D elements
        if (mask[element] && !append_entry(static_cast<uint32_t>(j), y[element])) return false;
      }
      store_u32(page + row_pointer_offset(layout_, row + 1), allocator_.entry_counts[slot_]);
    }
    return true;
  }

  bool append_entry(uint32_t index, double value) {
    const int64_t entries = layout_.spec.outlier_page_entries;
    const int64_t e = allocator_.entry_counts[slot_];
    const int64_t page_number = e / entries;
    int32_t* table = cache_.outlier_page_table + slot_ * cache_.outlier_table_stride;
    if (page_number == allocator_.pages_used[slot_]) {
      if (*allocator_.free_count == 0 || page_number >= cache_.outlier_table_stride) {
        *allocator_.exhausted = 1;
        return false;
      }
      table[page_number] = allocator_.free_pages[--*allocator_.free_count];
      ++allocator_.pages_used[slot_];
    }
    uint8_t* page = cache_.outlier_pages + static_cast<int64_t>(table[page_number]) * layout_.outlier_page_bytes;
    store_index(page + outlier_index_offset(layout_, e % entries), layout_.outlier_index_bytes, index);
    store_element(layout_.spec.element, value, page + outlier_value_offset(layout_, e % entries));
    ++allocator_.entry_counts[slot_];
    return true;
  }

  const PagedTensor& cache_;
  const TensorPageLayout& layout_;
  const Quantization& q_;
  const OutlierAllocator& allocator_;
  int32_t slot_;
  const int32_t* page_row_;
};

// ---------------------------------------------------------------- read

// Head `head` of token `token` of a sequence with `tokens` cached, as
// attention reads it (stored basis): out[D]; codes/outliers optional.
bool read_head(const PagedTensor& cache, const Dequantization& dq, int32_t slot, const int32_t* page_row,
               int64_t tokens, int64_t token, int64_t head, float* out, uint8_t* codes_out, uint8_t* outliers_out,
               ReadTally* read_tally) {
  const TensorPageLayout& l = cache.layout;
  const TensorLayoutSpec& spec = l.spec;
  const int64_t dim = spec.head_dim, element = element_bytes(spec.element);
  const int64_t begin = quantized_begin(spec, tokens), end = quantized_end(spec, tokens);
  if (token < begin || token >= end) {
    const int32_t row = exact_store_row(l, static_cast<int32_t>(token));
    const uint8_t* in = cache.exact + slot * l.exact_slot_bytes + exact_row_offset(l, head, row);
    tally(read_tally, in, dim * element);
    for (int64_t d = 0; d < dim; ++d) out[d] = load_element(spec.element, in + d * element);
    return false;
  }
  const int64_t s = token - spec.sink_tokens, in_page = s % spec.page_size;
  tally(read_tally, page_row + s / spec.page_size, kPageTableEntryBytes);
  const uint8_t* page = cache.pages + static_cast<int64_t>(page_row[s / spec.page_size]) * l.page_bytes;
  const uint8_t* row = page + code_row_offset(l, head, in_page);
  tally(read_tally, row, l.row_bytes);
  const int top = (1 << spec.bits) - 1;
  // (a, b) of x^ = fma(b, levels[code], a) from a stored (min, max).
  const auto from_pair = [&](const uint8_t* pair, float& a, float& b) {
    tally(read_tally, pair, l.pair_bytes);
    const float min = load_element(spec.element, pair), max = load_element(spec.element, pair + element);
    const Affine affine = pair_affine(min, max, dq.clip_ratio, dq.non_uniform, top);
    a = affine.a;
    b = affine.b;
  };
  float a = 0, b = 0;
  if (spec.grouping == ScaleGrouping::kPerTokenAllHeads) from_pair(page + token_pair_offset(l, 0, in_page, 0), a, b);
  for (int64_t d = 0; d < dim; ++d) {
    switch (spec.grouping) {
      case ScaleGrouping::kPerToken:
        if (d % spec.group == 0) from_pair(page + token_pair_offset(l, head, in_page, d / spec.group), a, b);
        break;
      case ScaleGrouping::kPerChannelTokens: {
        const int64_t sigma = channel_pair_stream_index(l, s / spec.group, head * dim + d);
        const int32_t* entry = page_row + sigma / pairs_per_page(l);
        tally(read_tally, entry, kPageTableEntryBytes);
        const uint8_t* params = cache.pages + static_cast<int64_t>(*entry) * l.page_bytes + l.params_offset;
        from_pair(params + (sigma % pairs_per_page(l)) * l.pair_bytes, a, b);
        break;
      }
      case ScaleGrouping::kPerChannelOffline:
        a = dq.channel_offset[head * dim + d];
        b = dq.channel_scale[head * dim + d];
        break;
      case ScaleGrouping::kPerTokenAllHeads:
        break;
    }
    const int code = get_code(row, d, spec.bits);
    if (codes_out != nullptr) codes_out[d] = static_cast<uint8_t>(code);
    out[d] = std::fma(b, dq.levels[code], a);
  }
  if (l.outlier_spans > 0) {
    const int64_t span = l.outlier_spans == 1 ? 0 : head;
    const uint8_t* pointer = page + row_pointer_offset(l, in_page * l.outlier_spans + span);
    tally(read_tally, pointer, 2 * kRowPointerBytes);
    const uint32_t first = load_u32(pointer), last = load_u32(pointer + kRowPointerBytes);
    const int32_t* table = cache.outlier_page_table + slot * cache.outlier_table_stride;
    const int64_t entries = spec.outlier_page_entries;
    for (int64_t e = first; e < last; ++e) {
      tally(read_tally, table + e / entries, kPageTableEntryBytes);
      const uint8_t* outlier_page = cache.outlier_pages + static_cast<int64_t>(table[e / entries]) * l.outlier_page_bytes;
      const uint8_t* index_at = outlier_page + outlier_index_offset(l, e % entries);
      const uint8_t* value_at = outlier_page + outlier_value_offset(l, e % entries);
      tally(read_tally, index_at, l.outlier_index_bytes);
      tally(read_tally, value_at, element);
      int64_t index = load_index(index_at, l.outlier_index_bytes);
      if (l.outlier_spans == 1) {  // all heads: index = head * D + d
        if (index / dim != head) continue;
        index %= dim;
      }
      out[index] = load_element(spec.element, value_at);
      if (outliers_out != nullptr) outliers_out[index] = 1;
    }
  }
  return true;
}

// ---------------------------------------------------------------- decode

float load_io(ElementType type, const void* base, int64_t index) {
  return load_element(type, static_cast<const uint8_t*>(base) + index * element_bytes(type));
}

// q' = q R with the key rotation of KV head `head` (float32, fma, i ascending).
std::vector<float> rotate_query(const Rotation& rotation, int64_t head, const float* q, int64_t dim) {
  std::vector<float> out(q, q + dim);
  if (rotation.kind == RotationKind::kMatrix) {
    const float* matrix = rotation.matrix + head * dim * dim;
    for (int64_t j = 0; j < dim; ++j) {
      float sum = 0;
      for (int64_t i = 0; i < dim; ++i) sum = std::fma(q[i], matrix[i * dim + j], sum);
      out[j] = sum;
    }
  } else if (rotation.kind == RotationKind::kPairAngles) {
    const int64_t half = dim / 2;
    for (int64_t j = 0; j < half; ++j) {
      const auto c = static_cast<float>(rotation.pair_cos[head * half + j]);
      const auto s = static_cast<float>(rotation.pair_sin[head * half + j]);
      out[j] = std::fma(q[j], c, -(q[j + half] * s));
      out[j + half] = std::fma(q[j], s, q[j + half] * c);
    }
  }
  return out;
}

// o = o' R^T with the value rotation of KV head `head`.
void unrotate_output(const Rotation& rotation, int64_t head, float* o, int64_t dim) {
  if (rotation.kind != RotationKind::kMatrix) return;
  const float* matrix = rotation.matrix + head * dim * dim;
  const std::vector<float> rotated(o, o + dim);
  for (int64_t j = 0; j < dim; ++j) {
    float sum = 0;
    for (int64_t i = 0; i < dim; ++i) sum = std::fma(rotated[i], matrix[j * dim + i], sum);
    o[j] = sum;
  }
}

// RoPE at position `position` in float32, as Hugging Face: angle = p * inv_freq
// (float32 product), x * cos + rotate_half(x) * sin.
void apply_rope(float* k, int64_t dim, int64_t position, const float* inverse_frequencies) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float angle = static_cast<float>(position) * inverse_frequencies[j];
    const float c = std::cos(angle), s = std::sin(angle);
    const float a = k[j], b = k[j + half];
    k[j] = a * c + (-b) * s;
    k[j + half] = b * c + a * s;
  }
}

// q . k in float32: 16 lanes (channel d in lane d mod 16, fma in channel
// order), then a pairwise tree over the lanes, as a warp-level kernel sums.
float dot(const float* q, const float* k, int64_t dim) {
  float lanes[16] = {};
  for (int64_t d = 0; d < dim; ++d) lanes[d % 16] = std::fma(q[d], k[d], lanes[d % 16]);
  for (int width = 8; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  return lanes[0];
}

// One split's online-softmax state of one query head.
struct SplitState {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0;
  std::vector<float> acc;
};

}  // namespace

void append_reference(const AppendParams& given) {
  check_inline_count("append (CPU reference)", given.inline_arrays.count, given.batch.count);
  AppendParams params = given;
  if (given.inline_arrays.count > 0) {  // host memory either way
    params.batch.slots = params.inline_arrays.slots;
    params.batch.lengths = params.inline_arrays.lengths;
    params.token_offsets = params.inline_arrays.token_offsets;
  }
  const SequenceBatch& batch = params.batch;
  if (params.page_table == nullptr && opens_inline_pages(given.inline_arrays)) {
    throw std::invalid_argument("append (CPU reference): inline new pages without a writable page_table");
  }
  // The pages the inline arrays open, written into the page table first.
  for (int32_t entry = 0; entry < given.inline_arrays.count; ++entry) {
    const int32_t page = given.inline_arrays.new_page_plus_one[entry] - 1;
    if (page < 0) continue;
    params.page_table[batch.slots[entry] * batch.page_table_stride +
                      new_page_index(params.key_cache.layout.spec, batch.lengths[entry])] = page;
  }
  for (int32_t entry = 0; entry < batch.count; ++entry) {
    const int32_t slot = batch.slots[entry];
    const int32_t* page_row = batch.page_table + slot * batch.page_table_stride;
    TensorAppender keys(params.key_cache, params.key_quantization, params.key_outliers, slot, page_row);
    TensorAppender values(params.value_cache, params.value_quantization, params.value_outliers, slot, page_row);
    for (int64_t row = params.token_offsets[entry]; row < params.token_offsets[entry + 1]; ++row) {
      const int64_t token = batch.lengths[entry] + (row - params.token_offsets[entry]);
      const bool ok =
          keys.append(token, prepare_token(params.keys, params.input, row, params.key_cache.layout,
                                           params.key_rotation)) &&
          values.append(token, prepare_token(params.values, params.input, row, params.value_cache.layout,
                                             params.value_rotation));
      if (!ok) return;
    }
  }
}

TokenReadout read_token_reference(const PagedTensor& cache, const Dequantization& dequantization, int32_t slot,
                                  const int32_t* page_table_row, int64_t tokens, int64_t token) {
  const int64_t dim = cache.layout.spec.head_dim, width = tensor_width(cache.layout);
  TokenReadout readout;
  readout.values.resize(static_cast<size_t>(width));
  readout.codes.assign(static_cast<size_t>(width), 0);
  readout.outliers.assign(static_cast<size_t>(width), 0);
  for (int64_t head = 0; head < cache.layout.spec.kv_heads; ++head) {
    readout.quantized = read_head(cache, dequantization, slot, page_table_row, tokens, token, head,
                                  readout.values.data() + head * dim, readout.codes.data() + head * dim,
                                  readout.outliers.data() + head * dim, nullptr);
  }
  return readout;
}

void decode_attention_reference(const DecodeParams& params) {
  check_inline_count("decode_attention (CPU reference)", params.inline_arrays.count, params.batch.count);
  const SequenceBatch& batch = params.batch;
  const TensorLayoutSpec& key_spec = params.key_cache.layout.spec;
  const int64_t dim = key_spec.head_dim, kv_heads = key_spec.kv_heads;
  const int64_t group = params.num_heads / kv_heads;
  auto* read_tally = static_cast<ReadTally*>(params.read_tally);
  std::vector<float> key(static_cast<size_t>(dim)), value(static_cast<size_t>(dim));
  for (int32_t entry = 0; entry < batch.count; ++entry) {
    const int32_t slot = entry_slot(params, entry);
    const int32_t* page_row = batch.page_table + slot * batch.page_table_stride;
    const int64_t tokens = entry_length(params, entry);
    const int64_t split = params.tokens_per_split > 0 ? params.tokens_per_split : tokens;
    for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head) {
      // The GQA group's queries, rotated into the keys' basis.
      std::vector<std::vector<float>> queries;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv_head * group + g;
        std::vector<float> q(static_cast<size_t>(dim));
        for (int64_t d = 0; d < dim; ++d) q[d] = load_io(params.io, params.queries, (entry * params.num_heads + head) * dim + d);
        queries.push_back(rotate_query(params.key_rotation, kv_head, q.data(), dim));
      }
      // Flash-decoding: each split [k S, (k + 1) S) keeps its own running
      // max, sum and weighted values; the splits are merged in split order.
      std::vector<std::vector<SplitState>> splits(static_cast<size_t>(group));
      for (int64_t first = 0; first < tokens; first += split) {
        for (auto& states : splits) states.push_back({-std::numeric_limits<float>::infinity(), 0.0f,
                                                      std::vector<float>(static_cast<size_t>(dim), 0.0f)});
        for (int64_t token = first; token < std::min(tokens, first + split); ++token) {
          read_head(params.key_cache, params.key_dequantization, slot, page_row, tokens, token, kv_head, key.data(),
                    nullptr, nullptr, read_tally);
          if (params.keys_pre_rope) apply_rope(key.data(), dim, token, params.rope_inverse_frequencies);
          read_head(params.value_cache, params.value_dequantization, slot, page_row, tokens, token, kv_head,
                    value.data(), nullptr, nullptr, read_tally);
          for (int64_t g = 0; g < group; ++g) {
            SplitState& state = splits[g].back();
            const float score = dot(queries[g].data(), key.data(), dim) * params.softmax_scale;
            const float max = std::max(state.max, score);
            const float rescale = std::exp(state.max - max);  // 0 for the first token (max was -inf)
            const float weight = std::exp(score - max);
            state.sum = state.sum * rescale + weight;
            for (int64_t d = 0; d < dim; ++d) state.acc[d] = std::fma(weight, value[d], state.acc[d] * rescale);
            state.max = max;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float max = -std::numeric_limits<float>::infinity();
        for (const SplitState& state : splits[g]) max = std::max(max, state.max);
        float sum = 0;
        std::vector<float> out(static_cast<size_t>(dim), 0.0f);
        for (const SplitState& state : splits[g]) {
          const float rescale = std::exp(state.max - max);
          sum += state.sum * rescale;
          for (int64_t d = 0; d < dim; ++d) out[d] = std::fma(state.acc[d], rescale, out[d]);
        }
        for (float& x : out) x /= sum;
        unrotate_output(params.value_rotation, kv_head, out.data(), dim);
        const int64_t head = kv_head * group + g;
        auto* output = static_cast<uint8_t*>(params.output) + (entry * params.num_heads + head) * dim * element_bytes(params.io);
        for (int64_t d = 0; d < dim; ++d) store_element(params.io, out[d], output + d * element_bytes(params.io));
      }
    }
  }
}

}  // namespace kvforge::kernels
