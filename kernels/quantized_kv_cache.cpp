#include "kernels/quantized_kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace kvforge::kernels {

// ------------------------------------------------------------ the CPU backend

void* CpuReferenceBackend::allocate(int64_t bytes) {
  if (bytes <= 0) return nullptr;
  const auto size = static_cast<size_t>(align_up(bytes, 64));
  void* memory = std::aligned_alloc(64, size);
  if (memory == nullptr) throw std::bad_alloc();
  std::memset(memory, 0, size);
  return memory;
}

void CpuReferenceBackend::release(void* memory) noexcept { std::free(memory); }

void CpuReferenceBackend::copy_in(void* backend_memory, const void* host, int64_t bytes) {
  if (bytes > 0) std::memcpy(backend_memory, host, static_cast<size_t>(bytes));
}

void CpuReferenceBackend::copy_out(void* host, const void* backend_memory, int64_t bytes) {
  if (bytes > 0) std::memcpy(host, backend_memory, static_cast<size_t>(bytes));
}

// ------------------------------------------------------------ state

struct QuantizedKVCache::Buffer {
  Buffer(KernelBackend& backend, int64_t bytes) : backend(&backend), data(backend.allocate(bytes)), bytes(bytes) {}
  ~Buffer() {
    if (data != nullptr) backend->release(data);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
  KernelBackend* backend;
  void* data;
  int64_t bytes;
};

// What append and decode_attention pass their kernels besides the cache's
// own state, one buffer per purpose: the call's small arrays packed into one
// upload, and the rows of callers whose rows lie in host memory.
struct QuantizedKVCache::CallScratch {
  // Backend memory that only grows: a call asks for what it needs and gets
  // the buffer of the calls before it when that is large enough, so
  // steady-state calls allocate nothing.
  class GrowingBuffer {
   public:
    explicit GrowingBuffer(KernelBackend& backend) : backend_(&backend) {}
    // At least `bytes` (> 0) of backend memory, holding whatever an earlier
    // call left there.
    void* reserve(int64_t bytes) {
      if (buffer_ == nullptr || buffer_->bytes < bytes) {
        // Twice the old size (amortized growth), in 256-byte units; the old
        // buffer goes first (release waits for the kernels that may read it).
        const int64_t grown = align_up(std::max(bytes, buffer_ ? 2 * buffer_->bytes : int64_t{0}), 256);
        buffer_.reset();
        buffer_ = std::make_unique<Buffer>(*backend_, grown);
      }
      return buffer_->data;
    }

   private:
    KernelBackend* backend_;
    std::unique_ptr<Buffer> buffer_;
  };

  explicit CallScratch(KernelBackend& backend)
      : call_arrays(backend), decode_arrays(backend), rows(backend), queries(backend), output(backend) {}
  GrowingBuffer call_arrays;  // append's lengths, token offsets, slots (call_arrays_layout)
  // decode_attention's, where they are not carried in its launch (a
  // decode_step queues them before the append's kernel, which reads
  // call_arrays after).
  GrowingBuffer decode_arrays;
  GrowingBuffer rows;         // staged keys, then values
  GrowingBuffer queries, output;
  std::vector<uint8_t> host_call_arrays;  // their host side (unchanged until the call's final sync)
  std::vector<uint8_t> host_decode_arrays;
  std::vector<uint8_t> appending;         // [max_sequences]: append's marks of the call's sequences (all 0 between calls)
};

struct QuantizedKVCache::TensorState {
  TensorPageLayout layout;
  int64_t outlier_pages_total = 0, outlier_table_stride = 0;
  std::unique_ptr<Buffer> pages, exact, outlier_pages, outlier_table, entry_counts, pages_used, free_outlier_pages,
      free_outlier_count;
  int32_t* exhausted = nullptr;  // this tensor's flag in exhausted_flags_
  std::unique_ptr<Buffer> levels, midpoints, channel_scale, channel_offset, outlier_low, outlier_high, matrix, centre,
      pair_cos, pair_sin;
  Quantization quantization;
  Dequantization dequantization;
  Rotation rotation;

  PagedTensor paged() const {
    PagedTensor p;
    p.layout = layout;
    p.pages = pages ? pages->as<uint8_t>() : nullptr;
    p.exact = exact ? exact->as<uint8_t>() : nullptr;
    p.outlier_pages = outlier_pages ? outlier_pages->as<uint8_t>() : nullptr;
    p.outlier_page_table = outlier_table ? outlier_table->as<int32_t>() : nullptr;
    p.outlier_table_stride = outlier_table_stride;
    return p;
  }
  OutlierAllocator allocator() const {
    OutlierAllocator a;
    a.entry_counts = entry_counts->as<uint32_t>();
    a.pages_used = pages_used->as<int32_t>();
    a.free_pages = free_outlier_pages ? free_outlier_pages->as<int32_t>() : nullptr;
    a.free_count = free_outlier_count->as<int32_t>();
    a.exhausted = exhausted;
    return a;
  }
};

struct QuantizedKVCache::LayerState {
  TensorState keys, values;
};

namespace {

// ------------------------------------------------------------ validation

// One-line refusals: "quantizer config 'NAME': FIELD ...: expected ...".
class Refusal {
 public:
  explicit Refusal(const std::string& config) : prefix_("quantizer config '" + config + "': ") {}
  [[noreturn]] void operator()(const std::string& what) const { throw std::invalid_argument(prefix_ + what); }

 private:
  std::string prefix_;
};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

void check_array(const Refusal& refuse, const Float32Array& array, const std::vector<int64_t>& shape,
                 const std::string& field) {
  int64_t count = 1;
  for (int64_t s : shape) count *= s;
  if (array.shape != shape || static_cast<int64_t>(array.values.size()) != count) {
    refuse(field + " has shape " + shape_text(array.shape) + ": expected " + shape_text(shape) +
           " for the model's kv_heads and head_dim");
  }
  for (float v : array.values) {
    if (!std::isfinite(v)) refuse(field + " holds a non-finite value: expected finite");
  }
}

void check_grid(const Refusal& refuse, const std::vector<float>& grid, int bits, const std::string& field) {
  if (static_cast<int64_t>(grid.size()) != (int64_t{1} << bits)) {
    refuse(field + " has " + std::to_string(grid.size()) + " levels: expected 2^bits = " +
           std::to_string(int64_t{1} << bits));
  }
  for (size_t i = 0; i < grid.size(); ++i) {
    if (!std::isfinite(grid[i]) || (i > 0 && !(grid[i] > grid[i - 1]))) {
      refuse(field + " is not finite and strictly ascending at level " + std::to_string(i));
    }
  }
}

// calib's top_bottom_count (quantize_simulation.h rule 2): the same float64
// expression, so that kernels and simulation take the same k.
int64_t top_bottom_count(int64_t n, double fraction) {
  const double rank = static_cast<double>(n - 1) * (1 - fraction / 2);
  return n - static_cast<int64_t>(std::ceil(rank - 1e-9 * std::max(1.0, rank)));
}

ScaleGrouping scale_grouping(Grouping grouping) {
  switch (grouping) {
    case Grouping::kPerToken: return ScaleGrouping::kPerToken;
    case Grouping::kPerChannelTokens: return ScaleGrouping::kPerChannelTokens;
    case Grouping::kPerChannelOffline: return ScaleGrouping::kPerChannelOffline;
    case Grouping::kPerTokenAllHeads: return ScaleGrouping::kPerTokenAllHeads;
  }
  return ScaleGrouping::kPerToken;
}

// The settings of one tensor kind that the runtime's layouts can serve.
void check_tensor_settings(const Refusal& refuse, const QuantizerSettings& settings,
                           const TensorQuantizerSettings& tensor, const std::string& kind, int64_t head_dim) {
  const std::string grouping(grouping_name(tensor.grouping));
  if (tensor.grouping == Grouping::kPerToken) {
    const int64_t group = std::min(tensor.group, head_dim);
    if (tensor.group < 1 || head_dim % group != 0) {
      refuse(kind + "_group " + std::to_string(tensor.group) + ": expected a divisor of head_dim " +
             std::to_string(head_dim) + " (or head_dim or more) for per_token");
    }
  }
  if (tensor.grouping == Grouping::kPerChannelTokens && tensor.group < 1) {
    refuse(kind + "_group " + std::to_string(tensor.group) + ": expected >= 1 tokens for per_channel_tokens");
  }
  if (tensor.residual_rule == ResidualRule::kBlockFlush) {
    if (settings.residual_tokens < 1) refuse(kind + "_residual_rule block_flush: expected residual_tokens >= 1, got 0");
    if (tensor.grouping == Grouping::kPerChannelTokens && settings.residual_tokens % tensor.group != 0) {
      refuse(kind + "_residual_rule block_flush: expected residual_tokens " + std::to_string(settings.residual_tokens) +
             " to be a multiple of " + kind + "_group " + std::to_string(tensor.group));
    }
  }
  const bool outliers = tensor.outlier_fraction > 0;
  if (!(tensor.outlier_fraction >= 0 && tensor.outlier_fraction < 1)) {
    refuse(kind + "_outlier_fraction " + std::to_string(tensor.outlier_fraction) + ": expected a value in [0, 1)");
  }
  if (outliers != (tensor.outlier_rule != OutlierRule::kNone)) {
    refuse(kind + "_outlier_rule " + std::string(outlier_rule_name(tensor.outlier_rule)) + " with " + kind +
           "_outlier_fraction " + std::to_string(tensor.outlier_fraction) +
           ": expected none exactly when the fraction is 0");
  }
  const bool offline = tensor.grouping == Grouping::kPerChannelOffline;
  if (outliers && offline != (tensor.outlier_rule == OutlierRule::kChannelThresholds)) {
    refuse(kind + "_outlier_rule " + std::string(outlier_rule_name(tensor.outlier_rule)) + " with " + kind +
           "_grouping " + grouping + ": expected channel_thresholds exactly for per_channel_offline");
  }
  if (tensor.outlier_rule == OutlierRule::kTokenTau && tensor.grouping == Grouping::kPerTokenAllHeads) {
    refuse(kind + "_outlier_rule token_tau with per_token_all_heads: expected a per-head grouping");
  }
}

void check_tensor_quantizer(const Refusal& refuse, const QuantizerSettings& settings,
                            const TensorQuantizerSettings& tensor, const TensorQuantizer& quantizer,
                            const std::string& field, int64_t kv_heads, int64_t head_dim) {
  if (tensor.non_uniform) {
    check_grid(refuse, quantizer.grid, settings.bits, field + "/grid");
    if (!quantizer.encode_grid.empty()) check_grid(refuse, quantizer.encode_grid, settings.bits, field + "/encode_grid");
  } else if (!quantizer.grid.empty() || !quantizer.encode_grid.empty()) {
    refuse(field + "/grid is present for a uniform quantizer: expected none");
  }
  if (tensor.grouping == Grouping::kPerChannelOffline) {
    check_array(refuse, quantizer.channel_scale, {kv_heads, head_dim}, field + "/channel_scale");
    check_array(refuse, quantizer.channel_offset, {kv_heads, head_dim}, field + "/channel_offset");
    for (float s : quantizer.channel_scale.values) {
      if (!(s > 0)) refuse(field + "/channel_scale holds " + std::to_string(s) + ": expected > 0");
    }
    if (tensor.outlier_fraction > 0) {
      check_array(refuse, quantizer.outlier_low, {kv_heads, head_dim}, field + "/outlier_low");
      check_array(refuse, quantizer.outlier_high, {kv_heads, head_dim}, field + "/outlier_high");
    }
  }
  if (!(quantizer.clip_ratio > 0 && quantizer.clip_ratio <= 1)) {
    refuse(field + "/clip_ratio " + std::to_string(quantizer.clip_ratio) + ": expected a value in (0, 1]");
  }
  if (tensor.outlier_rule == OutlierRule::kTokenTau && !(quantizer.outlier_tau > 0 && std::isfinite(quantizer.outlier_tau))) {
    refuse(field + "/outlier_tau " + std::to_string(quantizer.outlier_tau) + ": expected > 0 with token_tau");
  }
}

RotationForm effective_form(const QuantizerConfig& config, TensorKind kind) {
  if (!config.rotation || config.rotation->folded) return RotationForm::kNone;  // folded: the weights carry it
  return kind == TensorKind::kKeys ? config.rotation->keys : config.rotation->values;
}

void check_rotation(const Refusal& refuse, const QuantizerConfig& config, const TensorRotation& rotation,
                    TensorKind kind, const std::string& field, int64_t kv_heads, int64_t head_dim) {
  const RotationForm form = effective_form(config, kind);
  const std::string name = kind == TensorKind::kKeys ? "keys" : "values";
  switch (form) {
    case RotationForm::kNone:
      return;
    case RotationForm::kMatrix:
      if (kind == TensorKind::kKeys && config.settings.keys_pre_rope) {
        refuse("rotation keys_form matrix with keys_pre_rope: expected pair_angles for pre-RoPE keys");
      }
      check_array(refuse, rotation.matrix, {kv_heads, head_dim, head_dim}, field + "/matrix");
      if (!rotation.centre.empty()) {
        if (kind != TensorKind::kKeys) refuse(field + "/centre is present for values: expected none");
        check_array(refuse, rotation.centre, {kv_heads, head_dim}, field + "/centre");
      }
      return;
    case RotationForm::kPairAngles:
      if (kind != TensorKind::kKeys) refuse("rotation values_form pair_angles: expected none or matrix");
      if (head_dim % 2 != 0) refuse("rotation keys_form pair_angles with odd head_dim " + std::to_string(head_dim));
      check_array(refuse, rotation.angles, {kv_heads, head_dim / 2}, field + "/angles");
      return;
  }
  refuse("rotation " + name + "_form: unknown");
}

void check_options(const Refusal& refuse, const CacheOptions& o) {
  const auto positive = [&](int64_t value, const char* field) {
    if (value < 1 || value > (int64_t{1} << 30)) {
      refuse(std::string("cache option ") + field + " " + std::to_string(value) + ": expected 1..2^30");
    }
  };
  positive(o.page_size, "page_size");
  positive(o.max_sequences, "max_sequences");
  positive(o.max_context, "max_context");
  positive(o.outlier_page_entries, "outlier_page_entries");
  if (o.max_pages < 0 || o.max_outlier_pages < 0 || o.max_outlier_pages_per_sequence < 0 || o.tokens_per_split < 0) {
    refuse("cache options max_pages, max_outlier_pages, max_outlier_pages_per_sequence and tokens_per_split: "
           "expected >= 0");
  }
  if (!(o.softmax_scale >= 0) || !std::isfinite(o.softmax_scale)) {
    refuse("cache option softmax_scale: expected a finite value >= 0 (0: 1/sqrt(head_dim))");
  }
}

void check_configuration(const QuantizerConfig& config, const ModelDimensions& model, const CacheOptions& options) {
  const Refusal refuse(config.name);
  const int64_t heads = model.num_heads, kv_heads = model.num_kv_heads, dim = model.head_dim;
  if (model.num_layers < 1 || heads < 1 || kv_heads < 1 || dim < 1 || heads % kv_heads != 0) {
    refuse("model dimensions layers " + std::to_string(model.num_layers) + ", heads " + std::to_string(heads) +
           ", kv_heads " + std::to_string(kv_heads) + ", head_dim " + std::to_string(dim) +
           ": expected positive sizes with kv_heads dividing heads");
  }
  if (static_cast<int64_t>(config.layers.size()) != model.num_layers) {
    refuse("layers: " + std::to_string(config.layers.size()) + " layers, expected the model's " +
           std::to_string(model.num_layers));
  }
  const QuantizerSettings& s = config.settings;
  if (s.bits != 2 && s.bits != 4) {
    refuse("bits " + std::to_string(s.bits) + ": expected 2 or 4 (the runtime packs 2- or 4-bit codes)");
  }
  if (dim * s.bits % 32 != 0) {
    refuse("head_dim " + std::to_string(dim) + " at " + std::to_string(s.bits) +
           " bits: expected head_dim * bits to be a multiple of 32 (code rows of whole 32-bit words)");
  }
  if (s.sink_tokens < 0 || s.residual_tokens < 0 || s.sink_tokens > (int64_t{1} << 20) ||
      s.residual_tokens > (int64_t{1} << 20)) {
    refuse("sink_tokens " + std::to_string(s.sink_tokens) + " and residual_tokens " +
           std::to_string(s.residual_tokens) + ": expected 0..2^20");
  }
  if (s.keys_pre_rope && (dim % 2 != 0 || static_cast<int64_t>(model.rope_inverse_frequencies.size()) != dim / 2)) {
    refuse("keys_pre_rope: expected an even head_dim and the model's " + std::to_string(dim / 2) +
           " RoPE inverse frequencies, got " + std::to_string(model.rope_inverse_frequencies.size()));
  }
  check_tensor_settings(refuse, s, s.keys, "keys", dim);
  check_tensor_settings(refuse, s, s.values, "values", dim);
  for (size_t i = 0; i < config.layers.size(); ++i) {
    const std::string layer = "layers/" + std::to_string(i);
    const LayerQuantizers& q = config.layers[i];
    check_tensor_quantizer(refuse, s, s.keys, q.keys, layer + "/keys", kv_heads, dim);
    check_tensor_quantizer(refuse, s, s.values, q.values, layer + "/values", kv_heads, dim);
    check_rotation(refuse, config, q.rotation.keys, TensorKind::kKeys, layer + "/rotation/keys", kv_heads, dim);
    check_rotation(refuse, config, q.rotation.values, TensorKind::kValues, layer + "/rotation/values", kv_heads, dim);
  }
  check_options(refuse, options);
}

TensorLayoutSpec layout_spec(const QuantizerConfig& config, const TensorQuantizerSettings& tensor,
                             const ModelDimensions& model, const CacheOptions& options) {
  TensorLayoutSpec spec;
  spec.kv_heads = static_cast<int32_t>(model.num_kv_heads);
  spec.head_dim = static_cast<int32_t>(model.head_dim);
  spec.bits = config.settings.bits;
  spec.page_size = static_cast<int32_t>(options.page_size);
  spec.grouping = scale_grouping(tensor.grouping);
  if (tensor.grouping == Grouping::kPerToken) spec.group = static_cast<int32_t>(std::min(tensor.group, model.head_dim));
  if (tensor.grouping == Grouping::kPerChannelTokens) spec.group = static_cast<int32_t>(tensor.group);
  spec.element = options.element;
  spec.sink_tokens = static_cast<int32_t>(config.settings.sink_tokens);
  spec.residual_tokens = static_cast<int32_t>(config.settings.residual_tokens);
  spec.window_rule = tensor.residual_rule == ResidualRule::kBlockFlush ? WindowRule::kBlockFlush : WindowRule::kSliding;
  spec.outliers = tensor.outlier_fraction > 0;
  spec.outlier_page_entries = static_cast<int32_t>(options.outlier_page_entries);
  return spec;
}

// Outlier entries per token to provision for: the exact bound for
// token_top_bottom, twice the nominal share for the other rules.
double nominal_outliers_per_token(const TensorQuantizerSettings& tensor, const TensorPageLayout& layout) {
  if (layout.outlier_spans == 0) return 0;
  const int64_t n = layout.outlier_span_size;
  if (tensor.outlier_rule == OutlierRule::kTokenTopBottom) {
    return static_cast<double>(layout.outlier_spans * std::min(n, 2 * top_bottom_count(n, tensor.outlier_fraction)));
  }
  return std::min(1.0, 2 * tensor.outlier_fraction) * static_cast<double>(layout.outlier_spans * n);
}

// Byte offsets of one call's small arrays in its single upload: the 8-byte
// arrays first, so that each array is aligned to its element.
struct CallArrays {
  int64_t lengths = 0, token_offsets = 0, slots = 0, bytes = 0;
};

CallArrays call_arrays_layout(int64_t count, bool with_token_offsets) {
  CallArrays a;
  a.token_offsets = count * 8;
  a.slots = a.token_offsets + (with_token_offsets ? (count + 1) * 8 : 0);
  a.bytes = a.slots + count * 4;
  return a;
}

// Page table entries closer than this are uploaded in one copy with the
// unchanged entries between them: one copy call costs microseconds, in which
// the link moves tens of KiB (64 KiB of int32 entries).
constexpr int64_t kPageTableCopyGap = 16384;

// The ranges ({begin, end} entries) sorted, with those that overlap or lie
// within max_gap entries of each other merged.
template <class Range>
std::vector<Range> coalesced(std::vector<Range> ranges, int64_t max_gap) {
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::vector<Range> merged;
  for (const Range& r : ranges) {
    if (r.end <= r.begin) continue;
    if (!merged.empty() && r.begin - merged.back().end <= max_gap) {
      merged.back().end = std::max(merged.back().end, r.end);
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

}  // namespace

// ------------------------------------------------------------ construction

QuantizedKVCache::QuantizedKVCache(const QuantizerConfig& config, ModelDimensions model, CacheOptions options,
                                   std::unique_ptr<KernelBackend> backend)
    : name_(config.name), model_(std::move(model)), options_(options), keys_pre_rope_(config.settings.keys_pre_rope),
      backend_(backend ? std::move(backend) : std::make_unique<CpuReferenceBackend>()) {
  check_configuration(config, model_, options_);
  const int64_t kv_heads = model_.num_kv_heads, dim = model_.head_dim, width = kv_heads * dim;
  const int64_t slots = options_.max_sequences;
  const int64_t sink = config.settings.sink_tokens;
  page_table_stride_ = ceil_div(std::max<int64_t>(options_.max_context - sink, 1), options_.page_size);
  if (options_.max_pages == 0) options_.max_pages = slots * page_table_stride_;
  if (options_.softmax_scale == 0) options_.softmax_scale = 1.0f / std::sqrt(static_cast<float>(dim));
  page_table_.assign(static_cast<size_t>(slots * page_table_stride_), -1);
  pages_of_.assign(static_cast<size_t>(slots), 0);
  in_use_.assign(static_cast<size_t>(slots), 0);
  lengths_.assign(static_cast<size_t>(slots), std::vector<int64_t>(static_cast<size_t>(model_.num_layers), 0));
  for (int64_t page = options_.max_pages - 1; page >= 0; --page) free_pages_.push_back(static_cast<int32_t>(page));
  device_page_table_ = std::make_unique<Buffer>(*backend_, static_cast<int64_t>(page_table_.size()) * 4);
  backend_->copy_in(device_page_table_->data, page_table_.data(), device_page_table_->bytes);
  exhausted_flags_ = std::make_unique<Buffer>(*backend_, model_.num_layers * 2 * 4);
  scratch_ = std::make_unique<CallScratch>(*backend_);
  scratch_->appending.assign(static_cast<size_t>(slots), 0);
  rope_frequencies_ =
      std::make_unique<Buffer>(*backend_, static_cast<int64_t>(model_.rope_inverse_frequencies.size()) * 4);
  backend_->copy_in(rope_frequencies_->data, model_.rope_inverse_frequencies.data(), rope_frequencies_->bytes);

  const auto upload = [&](const void* host, int64_t bytes) {
    auto buffer = std::make_unique<Buffer>(*backend_, bytes);
    backend_->copy_in(buffer->data, host, bytes);
    return buffer;
  };
  layers_.resize(static_cast<size_t>(model_.num_layers));
  for (int64_t layer = 0; layer < model_.num_layers; ++layer) {
    const LayerQuantizers& fitted = config.layers[static_cast<size_t>(layer)];
    for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
      const bool is_keys = kind == TensorKind::kKeys;
      const TensorQuantizerSettings& settings = is_keys ? config.settings.keys : config.settings.values;
      const TensorQuantizer& quantizer = is_keys ? fitted.keys : fitted.values;
      const TensorRotation& rotation = is_keys ? fitted.rotation.keys : fitted.rotation.values;
      TensorState& t = tensor(layer, kind);
      t.layout = page_layout(layout_spec(config, settings, model_, options_));
      const TensorPageLayout& l = t.layout;
      // Pools.
      t.pages = std::make_unique<Buffer>(*backend_, options_.max_pages * l.page_bytes);
      t.exact = std::make_unique<Buffer>(*backend_, slots * l.exact_slot_bytes);
      const double per_token = nominal_outliers_per_token(settings, l);
      if (l.outlier_spans > 0) {
        t.outlier_pages_total = options_.max_outlier_pages > 0
                                    ? options_.max_outlier_pages
                                    : ceil_div(static_cast<int64_t>(std::ceil(per_token * static_cast<double>(
                                                   options_.max_pages * options_.page_size))),
                                               options_.outlier_page_entries) + slots;
        // A sequence's table: its tokens at twice the provisioned share
        // (token_top_bottom: the exact bound), capped by every element.
        const double per_sequence_token =
            std::min(static_cast<double>(width),
                     settings.outlier_rule == OutlierRule::kTokenTopBottom ? per_token : 2 * per_token);
        t.outlier_table_stride =
            options_.max_outlier_pages_per_sequence > 0
                ? options_.max_outlier_pages_per_sequence
                : ceil_div(static_cast<int64_t>(std::ceil(per_sequence_token * static_cast<double>(options_.max_context))),
                           options_.outlier_page_entries) + 1;
        t.outlier_pages = std::make_unique<Buffer>(*backend_, t.outlier_pages_total * l.outlier_page_bytes);
        t.outlier_table = std::make_unique<Buffer>(*backend_, slots * t.outlier_table_stride * 4);
        std::vector<int32_t> free(static_cast<size_t>(t.outlier_pages_total));
        for (int64_t i = 0; i < t.outlier_pages_total; ++i) free[i] = static_cast<int32_t>(t.outlier_pages_total - 1 - i);
        t.free_outlier_pages = upload(free.data(), t.outlier_pages_total * 4);
      }
      t.entry_counts = std::make_unique<Buffer>(*backend_, slots * 4);
      t.pages_used = std::make_unique<Buffer>(*backend_, slots * 4);
      const auto free_count = static_cast<int32_t>(t.outlier_pages_total);
      t.free_outlier_count = upload(&free_count, 4);
      t.exhausted = exhausted_flags_->as<int32_t>() + layer * 2 + (is_keys ? 0 : 1);
      // Dequantization: levels and per-channel constants.
      const int levels = 1 << config.settings.bits, top = levels - 1;
      std::vector<float> table(static_cast<size_t>(levels));
      for (int k = 0; k < levels; ++k) {
        if (settings.non_uniform) {
          table[k] = quantizer.grid[k];
        } else if (settings.grouping == Grouping::kPerChannelOffline) {
          table[k] = static_cast<float>(static_cast<double>(k) * 2 / top - 1);  // calib's uniform offline level
        } else {
          table[k] = static_cast<float>(k);
        }
      }
      t.levels = upload(table.data(), levels * 4);
      t.dequantization.non_uniform = settings.non_uniform;
      t.dequantization.levels = t.levels->as<float>();
      t.dequantization.clip_ratio = quantizer.clip_ratio;
      t.quantization.bits = config.settings.bits;
      t.quantization.non_uniform = settings.non_uniform;
      t.quantization.clip_ratio = quantizer.clip_ratio;
      if (settings.non_uniform) {
        const std::vector<float>& encode = quantizer.encode_grid.empty() ? quantizer.grid : quantizer.encode_grid;
        std::vector<double> midpoints(static_cast<size_t>(top));
        for (int k = 0; k < top; ++k) midpoints[k] = (static_cast<double>(encode[k]) + encode[k + 1]) / 2;
        t.midpoints = upload(midpoints.data(), top * 8);
        t.quantization.encode_midpoints = t.midpoints->as<double>();
      }
      if (settings.grouping == Grouping::kPerChannelOffline) {
        t.channel_scale = upload(quantizer.channel_scale.values.data(), width * 4);
        t.channel_offset = upload(quantizer.channel_offset.values.data(), width * 4);
        t.dequantization.channel_scale = t.quantization.channel_scale = t.channel_scale->as<float>();
        t.dequantization.channel_offset = t.quantization.channel_offset = t.channel_offset->as<float>();
      }
      switch (settings.outlier_rule) {
        case OutlierRule::kNone:
          break;
        case OutlierRule::kChannelThresholds:
          t.quantization.outliers = OutlierSelection::kChannelThresholds;
          t.outlier_low = upload(quantizer.outlier_low.values.data(), width * 4);
          t.outlier_high = upload(quantizer.outlier_high.values.data(), width * 4);
          t.quantization.outlier_low = t.outlier_low->as<float>();
          t.quantization.outlier_high = t.outlier_high->as<float>();
          break;
        case OutlierRule::kTokenTopBottom:
          t.quantization.outliers = OutlierSelection::kTokenTopBottom;
          t.quantization.top_bottom_count =
              static_cast<int32_t>(top_bottom_count(l.outlier_span_size, settings.outlier_fraction));
          break;
        case OutlierRule::kTokenTau:
          t.quantization.outliers = OutlierSelection::kTokenTau;
          t.quantization.outlier_tau = quantizer.outlier_tau;
          break;
      }
      // Rotation.
      switch (effective_form(config, kind)) {
        case RotationForm::kNone:
          break;
        case RotationForm::kMatrix:
          t.rotation.kind = RotationKind::kMatrix;
          t.matrix = upload(rotation.matrix.values.data(), width * dim * 4);
          t.rotation.matrix = t.matrix->as<float>();
          if (!rotation.centre.empty()) {
            t.centre = upload(rotation.centre.values.data(), width * 4);
            t.rotation.centre = t.centre->as<float>();
          }
          break;
        case RotationForm::kPairAngles: {
          std::vector<double> cos(rotation.angles.values.size()), sin(rotation.angles.values.size());
          for (size_t i = 0; i < cos.size(); ++i) {
            cos[i] = std::cos(static_cast<double>(rotation.angles.values[i]));
            sin[i] = std::sin(static_cast<double>(rotation.angles.values[i]));
          }
          t.rotation.kind = RotationKind::kPairAngles;
          t.pair_cos = upload(cos.data(), static_cast<int64_t>(cos.size()) * 8);
          t.pair_sin = upload(sin.data(), static_cast<int64_t>(sin.size()) * 8);
          t.rotation.pair_cos = t.pair_cos->as<double>();
          t.rotation.pair_sin = t.pair_sin->as<double>();
          break;
        }
      }
    }
  }
}

QuantizedKVCache::~QuantizedKVCache() = default;

QuantizedKVCache::TensorState& QuantizedKVCache::tensor(int64_t layer, TensorKind kind) {
  LayerState& state = layers_.at(static_cast<size_t>(layer));
  return kind == TensorKind::kKeys ? state.keys : state.values;
}

const QuantizedKVCache::TensorState& QuantizedKVCache::tensor(int64_t layer, TensorKind kind) const {
  const LayerState& state = layers_.at(static_cast<size_t>(layer));
  return kind == TensorKind::kKeys ? state.keys : state.values;
}

const TensorPageLayout& QuantizedKVCache::layout(TensorKind kind) const { return tensor(0, kind).layout; }

void QuantizedKVCache::upload_page_table_changes() {
  if (page_table_changes_.empty()) return;
  for (const EntryRange& r : coalesced(std::move(page_table_changes_), kPageTableCopyGap)) {
    backend_->enqueue_copy_in(device_page_table_->as<int32_t>() + r.begin, page_table_.data() + r.begin,
                              (r.end - r.begin) * 4);
  }
  page_table_changes_.clear();
}

std::vector<int32_t> QuantizedKVCache::copy_page_table() const {
  std::vector<int32_t> table(page_table_.size());
  backend_->copy_out(table.data(), device_page_table_->data, static_cast<int64_t>(table.size()) * 4);
  return table;
}

// ------------------------------------------------------------ sequences

int32_t QuantizedKVCache::add_sequence() {
  const auto free = std::find(in_use_.begin(), in_use_.end(), uint8_t{0});
  if (free == in_use_.end()) {
    throw std::length_error("quantized KV cache '" + name_ + "': all " + std::to_string(options_.max_sequences) +
                            " sequence slots are in use (raise max_sequences)");
  }
  *free = 1;
  return static_cast<int32_t>(free - in_use_.begin());
}

void QuantizedKVCache::check_sequence(int32_t sequence, const char* what) const {
  if (sequence < 0 || sequence >= options_.max_sequences || !in_use_[static_cast<size_t>(sequence)]) {
    throw std::invalid_argument(std::string("quantized KV cache '") + name_ + "': " + what + ": sequence " +
                                std::to_string(sequence) + " is not an active sequence");
  }
}

void QuantizedKVCache::remove_sequence(int32_t sequence) {
  check_sequence(sequence, "remove_sequence");
  check_pending_appends();
  const auto slot = static_cast<size_t>(sequence);
  const int64_t row = static_cast<int64_t>(slot) * page_table_stride_;
  for (int64_t p = 0; p < pages_of_[slot]; ++p) {
    int32_t& entry = page_table_[row + p];
    free_pages_.push_back(entry);
    entry = -1;
  }
  page_table_changes_.push_back({row, row + pages_of_[slot]});
  pages_of_[slot] = 0;
  upload_page_table_changes();  // the copy_out below synchronizes
  for (int64_t layer = 0; layer < model_.num_layers; ++layer) {
    for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
      TensorState& t = tensor(layer, kind);
      int32_t used = 0, free_count = 0;
      const uint32_t zero_entries = 0;
      const int32_t zero = 0;
      backend_->copy_out(&used, t.pages_used->as<int32_t>() + slot, 4);
      if (used > 0) {
        std::vector<int32_t> pages(static_cast<size_t>(used));
        backend_->copy_out(pages.data(), t.outlier_table->as<int32_t>() + slot * t.outlier_table_stride, used * 4);
        backend_->copy_out(&free_count, t.free_outlier_count->data, 4);
        backend_->copy_in(t.free_outlier_pages->as<int32_t>() + free_count, pages.data(), used * 4);
        free_count += used;
        backend_->copy_in(t.free_outlier_count->data, &free_count, 4);
      }
      backend_->copy_in(t.pages_used->as<int32_t>() + slot, &zero, 4);
      backend_->copy_in(t.entry_counts->as<uint32_t>() + slot, &zero_entries, 4);
    }
  }
  std::fill(lengths_[slot].begin(), lengths_[slot].end(), 0);
  in_use_[slot] = 0;
}

int64_t QuantizedKVCache::length(int32_t sequence, int64_t layer) const {
  check_sequence(sequence, "length");
  return lengths_[static_cast<size_t>(sequence)].at(static_cast<size_t>(layer));
}

int64_t QuantizedKVCache::pages_held(int32_t sequence) const {
  check_sequence(sequence, "pages_held");
  return pages_of_[static_cast<size_t>(sequence)];
}

int64_t QuantizedKVCache::ensure_pages(int32_t sequence, int64_t tokens) {
  const auto slot = static_cast<size_t>(sequence);
  const int64_t sink = tensor(0, TensorKind::kKeys).layout.spec.sink_tokens;
  const int64_t needed = tokens > sink ? ceil_div(tokens - sink, options_.page_size) : 0;
  if (tokens > options_.max_context) {
    throw std::length_error("quantized KV cache '" + name_ + "': sequence " + std::to_string(sequence) + " would hold " +
                            std::to_string(tokens) + " tokens, more than max_context " +
                            std::to_string(options_.max_context));
  }
  if (needed - pages_of_[slot] > static_cast<int64_t>(free_pages_.size())) {
    throw std::length_error("quantized KV cache '" + name_ + "': page pool exhausted (" +
                            std::to_string(options_.max_pages) + " pages of " + std::to_string(options_.page_size) +
                            " tokens; raise max_pages)");
  }
  const int64_t row = static_cast<int64_t>(slot) * page_table_stride_;
  const int64_t held = pages_of_[slot];
  if (held < needed) page_table_changes_.push_back({row + held, row + needed});
  while (pages_of_[slot] < needed) {
    page_table_[row + pages_of_[slot]] = free_pages_.back();
    free_pages_.pop_back();
    ++pages_of_[slot];
  }
  return needed > held ? needed - held : 0;
}

// ------------------------------------------------------------ kernels

// Per call, once the scratch buffers have grown to the batch: no
// allocation, one upload of the call's small arrays (none for an append of
// up to kInlineBatchEntries sequences: they travel in the launch's
// parameters) plus the page table entries of new pages and host rows, the
// kernels, and one synchronizing
// copy_out (append: the layer's two pool-exhaustion flags; decode_attention:
// the output, or synchronize() for an output in backend memory). That sync is
// the one the documented semantics need: append's caller may reuse its rows
// and decode_attention's may read its output when the call returns; it also
// frees the host sides of the queued copies for the next call.

void QuantizedKVCache::append(int64_t layer, const AppendBatch& batch) {
  const AppendParams params = stage_append(layer, batch);
  launch_staged_append(layer, batch, params);
  finish_append(layer, batch);
}

AppendParams QuantizedKVCache::stage_append(int64_t layer, const AppendBatch& batch) {
  const auto context = [&] { return "quantized KV cache '" + name_ + "': append to layer " + std::to_string(layer); };
  if (layer < 0 || layer >= model_.num_layers) throw std::invalid_argument(context() + ": no such layer");
  const size_t count = batch.sequences.size();
  if (batch.positions.size() != count || batch.tokens.size() != count) {
    throw std::invalid_argument(context() + ": sequences, positions and tokens differ in length");
  }
  const CallArrays arrays = call_arrays_layout(static_cast<int64_t>(count), true);
  std::vector<uint8_t>& host = scratch_->host_call_arrays;
  host.resize(static_cast<size_t>(arrays.bytes));
  const auto lengths = reinterpret_cast<int64_t*>(host.data() + arrays.lengths);
  const auto offsets = reinterpret_cast<int64_t*>(host.data() + arrays.token_offsets);
  offsets[0] = 0;
  // Each sequence once per call: a mark per slot, cleared on every way out
  // (linear in the batch; comparing every pair was quadratic).
  struct Marks {
    std::vector<uint8_t>& marks;
    const std::vector<int32_t>& sequences;
    size_t set = 0;
    ~Marks() {
      for (size_t i = 0; i < set; ++i) marks[static_cast<size_t>(sequences[i])] = 0;
    }
  } marks{scratch_->appending, batch.sequences};
  for (size_t i = 0; i < count; ++i) {
    const int32_t sequence = batch.sequences[i];
    check_sequence(sequence, "append");
    if (marks.marks[static_cast<size_t>(sequence)] != 0) {
      throw std::invalid_argument(context() + ": sequence " + std::to_string(sequence) + " appears twice in one batch");
    }
    marks.marks[static_cast<size_t>(sequence)] = 1;
    marks.set = i + 1;
    const int64_t length = lengths_[static_cast<size_t>(sequence)][static_cast<size_t>(layer)];
    if (batch.positions[i] != length || batch.tokens[i] < 0) {
      throw std::invalid_argument(context() + ": sequence " + std::to_string(sequence) + " gets " +
                                  std::to_string(batch.tokens[i]) + " tokens at position " +
                                  std::to_string(batch.positions[i]) + ", expected its length " +
                                  std::to_string(length));
    }
    lengths[i] = length;
    offsets[i + 1] = offsets[i] + batch.tokens[i];
  }
  const int64_t rows = offsets[count];
  if (rows > 0 && (batch.keys == nullptr || batch.values == nullptr)) {
    throw std::invalid_argument(context() + ": keys and values are null");
  }
  // A small batch's arrays travel in the launch's parameters, with the one
  // page each entry's new tokens open right after the layer's length (a
  // decoding step's), which the kernel writes into the page table; a larger
  // batch's arrays and every other new page (several, or opened behind
  // another layer's longer length) are uploaded.
  const bool inline_arrays = count > 0 && count <= static_cast<size_t>(kInlineBatchEntries);
  const TensorLayoutSpec& spec = tensor(layer, TensorKind::kKeys).layout.spec;
  AppendParams params;
  for (size_t i = 0; i < count; ++i) {
    const auto slot = static_cast<size_t>(batch.sequences[i]);
    const int64_t opened = ensure_pages(batch.sequences[i], lengths[i] + batch.tokens[i]);
    const int64_t index = pages_of_[slot] - 1;  // the last page, when opened
    if (inline_arrays && opened == 1 && index == new_page_index(spec, lengths[i])) {
      page_table_changes_.pop_back();  // ensure_pages' record of that page
      params.inline_arrays.new_page_plus_one[i] =
          page_table_[static_cast<size_t>(static_cast<int64_t>(slot) * page_table_stride_ + index)] + 1;
    }
  }
  upload_page_table_changes();

  std::memcpy(host.data() + arrays.slots, batch.sequences.data(), count * 4);
  uint8_t* device = nullptr;
  if (!inline_arrays) {
    device = static_cast<uint8_t*>(scratch_->call_arrays.reserve(arrays.bytes));
    backend_->enqueue_copy_in(device, host.data(), arrays.bytes);
  }
  // Rows in host memory are staged through the scratch (keys, then values);
  // rows already in backend memory go to the kernel as they are.
  const void* keys = batch.keys;
  const void* values = batch.values;
  if (!batch.backend_memory && rows > 0) {
    const int64_t rows_bytes = rows * model_.num_kv_heads * model_.head_dim * element_bytes(batch.input);
    const int64_t values_at = align_up(rows_bytes, 256);
    auto* const staged = static_cast<uint8_t*>(scratch_->rows.reserve(values_at + rows_bytes));
    backend_->enqueue_copy_in(staged, batch.keys, rows_bytes);
    backend_->enqueue_copy_in(staged + values_at, batch.values, rows_bytes);
    keys = staged;
    values = staged + values_at;
  }

  params.batch.count = static_cast<int32_t>(count);
  params.rows = rows;
  params.kernel = options_.append_kernel;
  params.page_table = device_page_table_->as<int32_t>();
  params.batch.page_table = params.page_table;
  params.batch.page_table_stride = page_table_stride_;
  if (inline_arrays) {
    InlineBatchArrays& a = params.inline_arrays;
    a.count = static_cast<int32_t>(count);
    std::copy(batch.sequences.begin(), batch.sequences.end(), a.slots);
    std::copy(lengths, lengths + count, a.lengths);
    std::copy(offsets, offsets + count + 1, a.token_offsets);
  } else {
    params.batch.slots = reinterpret_cast<const int32_t*>(device + arrays.slots);
    params.batch.lengths = reinterpret_cast<const int64_t*>(device + arrays.lengths);
    params.token_offsets = reinterpret_cast<const int64_t*>(device + arrays.token_offsets);
  }
  params.keys = keys;
  params.values = values;
  params.input = batch.input;
  const TensorState& k = tensor(layer, TensorKind::kKeys);
  const TensorState& v = tensor(layer, TensorKind::kValues);
  params.key_cache = k.paged();
  params.value_cache = v.paged();
  params.key_quantization = k.quantization;
  params.value_quantization = v.quantization;
  params.key_rotation = k.rotation;
  params.value_rotation = v.rotation;
  params.key_outliers = k.allocator();
  params.value_outliers = v.allocator();
  return params;
}

void QuantizedKVCache::launch_staged_append(int64_t layer, const AppendBatch& batch, const AppendParams& params,
                                            const DecodeParams* step_decode) {
  try {
    if (step_decode != nullptr) {
      backend_->decode_step(params, *step_decode);
    } else {
      backend_->append(params);
    }
  } catch (...) {
    // The inline new pages never reached the kernels' table: upload them
    // with the next call's changes.
    const TensorLayoutSpec& spec = tensor(layer, TensorKind::kKeys).layout.spec;
    // (Inline new pages only: at most kInlineBatchEntries, the arrays'
    // count; a larger batch's pages were uploaded before the launch.)
    for (int32_t i = 0; i < params.inline_arrays.count; ++i) {
      if (params.inline_arrays.new_page_plus_one[i] == 0) continue;
      const int32_t sequence = batch.sequences[static_cast<size_t>(i)];
      const int64_t at = static_cast<int64_t>(sequence) * page_table_stride_ +
                         new_page_index(spec, lengths_[static_cast<size_t>(sequence)][static_cast<size_t>(layer)]);
      page_table_changes_.push_back({at, at + 1});
    }
    throw;
  }
}

void QuantizedKVCache::finish_append(int64_t layer, const AppendBatch& batch) {
  const size_t count = batch.sequences.size();
  const TensorState& k = tensor(layer, TensorKind::kKeys);
  if (options_.asynchronous_append) {
    // No sync: the flags are read by the next call that synchronizes.
    for (size_t i = 0; i < count; ++i) {
      lengths_[static_cast<size_t>(batch.sequences[i])][static_cast<size_t>(layer)] += batch.tokens[i];
    }
    pending_appends_.push_back({layer, batch.sequences});
    return;
  }
  // The call's one sync: the flags of keys and values lie side by side.
  int32_t exhausted[2] = {0, 0};
  backend_->copy_out(exhausted, k.exhausted, 8);
  if (exhausted[0] != 0 || exhausted[1] != 0) {
    const int32_t cleared[2] = {0, 0};
    backend_->copy_in(k.exhausted, cleared, 8);
    throw_exhaustion(layer, batch.sequences, exhausted, false);
  }
  for (size_t i = 0; i < count; ++i) {
    lengths_[static_cast<size_t>(batch.sequences[i])][static_cast<size_t>(layer)] += batch.tokens[i];
  }
}

void QuantizedKVCache::throw_exhaustion(int64_t layer, std::span<const int32_t> sequences, const int32_t* flags,
                                        bool late) const {
  const TensorState& k = tensor(layer, TensorKind::kKeys);
  const TensorState& t = flags[0] != 0 ? k : tensor(layer, TensorKind::kValues);
  std::string batch;
  if (late) {
    for (const int32_t s : sequences) batch += (batch.empty() ? "" : ", ") + std::to_string(s);
    batch = " (sequences " + batch + ", reported by a later call: asynchronous_append)";
  }
  throw std::length_error("quantized KV cache '" + name_ + "': append to layer " + std::to_string(layer) + batch +
                          ": the " + std::string(&t == &k ? "keys'" : "values'") + " outlier pool is exhausted (" +
                          std::to_string(t.outlier_pages_total) + " pages of " +
                          std::to_string(options_.outlier_page_entries) + " entries, at most " +
                          std::to_string(t.outlier_table_stride) +
                          " per sequence; raise max_outlier_pages or max_outlier_pages_per_sequence); the "
                          "batch's sequences must be removed");
}

void QuantizedKVCache::check_pending_appends() {
  if (pending_appends_.empty()) return;
  std::vector<int32_t> flags(static_cast<size_t>(model_.num_layers * 2));
  backend_->copy_out(flags.data(), exhausted_flags_->data, static_cast<int64_t>(flags.size()) * 4);
  const std::vector<PendingAppend> pending = std::move(pending_appends_);
  pending_appends_.clear();
  // The first append of an exhausted layer is named (the flag is set by the
  // append that ran out and stays set); every layer's flags are cleared with
  // the report, which asks for the batch's sequences to be removed anyway.
  for (const PendingAppend& a : pending) {
    const int32_t* layer_flags = flags.data() + a.layer * 2;
    if (layer_flags[0] == 0 && layer_flags[1] == 0) continue;
    const std::vector<int32_t> cleared(flags.size(), 0);
    backend_->copy_in(exhausted_flags_->data, cleared.data(), static_cast<int64_t>(cleared.size()) * 4);
    throw_exhaustion(a.layer, a.sequences, layer_flags, true);
  }
}

void QuantizedKVCache::synchronize() {
  backend_->synchronize();
  check_pending_appends();
}

void QuantizedKVCache::decode_attention(int64_t layer, std::span<const int32_t> sequences, const void* queries,
                                        void* output, ReadTally* tally, bool backend_memory, ElementType io) {
  const StagedDecode staged = stage_decode(layer, sequences, {}, queries, output, backend_memory, io);
  if (staged.params.batch.count == 0) return;  // an empty batch: no output rows, nothing to plan
  DecodeParams params = staged.params;
  params.read_tally = tally;
  backend_->decode_attention(params);
  finish_decode(staged, output);
}

void QuantizedKVCache::decode_step(int64_t layer, const AppendBatch& batch, const void* queries, void* output,
                                   bool backend_memory, ElementType io) {
  // The decode's checks first, at the lengths the append leaves (so that a
  // refused step runs nothing), then the append's; the decode's arrays have
  // their own buffer (the append's may still be read by its kernel).
  if (batch.tokens.size() != batch.sequences.size()) {
    throw std::invalid_argument("quantized KV cache '" + name_ + "': decode_step on layer " + std::to_string(layer) +
                                ": sequences, positions and tokens differ in length");
  }
  const StagedDecode staged = stage_decode(layer, batch.sequences, batch.tokens, queries, output, backend_memory, io);
  const AppendParams append_params = stage_append(layer, batch);
  // One token per sequence: the backend's one step (the decode's arrays and
  // the append's the same entries in the same order).
  const bool one_step = options_.fused_decode_step && staged.params.batch.count > 0 &&
                        std::all_of(batch.tokens.begin(), batch.tokens.end(), [](int64_t t) { return t == 1; });
  if (one_step) {
    launch_staged_append(layer, batch, append_params, &staged.params);
  } else {
    launch_staged_append(layer, batch, append_params);
    if (staged.params.batch.count > 0) backend_->decode_attention(staged.params);
  }
  // The append's lengths and (a synchronous append's) exhaustion flags
  // before the output: an exhausted pool throws here, its output undefined.
  finish_append(layer, batch);
  if (staged.params.batch.count == 0) return;
  if (options_.asynchronous_append && backend_memory) return;  // queued, as the append
  finish_decode(staged, output);
}

QuantizedKVCache::StagedDecode QuantizedKVCache::stage_decode(int64_t layer, std::span<const int32_t> sequences,
                                                              std::span<const int64_t> appended, const void* queries,
                                                              void* output, bool backend_memory, ElementType io) {
  const auto context = [&] {
    return "quantized KV cache '" + name_ + "': " + (appended.empty() ? "decode_attention" : "decode_step") +
           " on layer " + std::to_string(layer);
  };
  if (layer < 0 || layer >= model_.num_layers) throw std::invalid_argument(context() + ": no such layer");
  const auto count = static_cast<int64_t>(sequences.size());
  const CallArrays arrays = call_arrays_layout(count, false);
  std::vector<uint8_t>& host = scratch_->host_decode_arrays;
  host.resize(static_cast<size_t>(arrays.bytes));
  const auto lengths = reinterpret_cast<int64_t*>(host.data() + arrays.lengths);
  int64_t max_length = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int32_t sequence = sequences[static_cast<size_t>(i)];
    check_sequence(sequence, appended.empty() ? "decode_attention" : "decode_step");
    lengths[i] = lengths_[static_cast<size_t>(sequence)][static_cast<size_t>(layer)] +
                 (appended.empty() ? 0 : std::max<int64_t>(appended[static_cast<size_t>(i)], 0));
    if (lengths[i] < 1) {
      throw std::invalid_argument(context() + ": sequence " + std::to_string(sequence) + " holds no tokens");
    }
    max_length = std::max(max_length, lengths[i]);
  }
  StagedDecode staged;
  if (count == 0) return staged;
  DecodeParams& params = staged.params;
  params = decode_params(layer);
  params.batch.count = static_cast<int32_t>(count);
  // A small batch's arrays travel in the launch (no copy on the stream); a
  // larger one's are uploaded.
  if (count <= kInlineBatchEntries) {
    InlineDecodeArrays& a = params.inline_arrays;
    a.count = static_cast<int32_t>(count);
    std::copy(sequences.begin(), sequences.end(), a.slots);
    std::copy(lengths, lengths + count, a.lengths);
  } else {
    std::memcpy(host.data() + arrays.slots, sequences.data(), static_cast<size_t>(count) * 4);
    auto* const device = static_cast<uint8_t*>(scratch_->decode_arrays.reserve(arrays.bytes));
    backend_->enqueue_copy_in(device, host.data(), arrays.bytes);
    params.batch.slots = reinterpret_cast<const int32_t*>(device + arrays.slots);
    params.batch.lengths = reinterpret_cast<const int64_t*>(device + arrays.lengths);
  }
  // Host queries and output are staged through the scratch (none when the
  // caller's arrays are already in backend memory).
  staged.io_bytes = count * model_.num_heads * model_.head_dim * element_bytes(io);
  staged.backend_memory = backend_memory;
  const void* kernel_queries = queries;
  void* kernel_output = output;
  if (!backend_memory && staged.io_bytes > 0) {
    void* const staged_queries = scratch_->queries.reserve(staged.io_bytes);
    backend_->enqueue_copy_in(staged_queries, queries, staged.io_bytes);
    kernel_queries = staged_queries;
    kernel_output = scratch_->output.reserve(staged.io_bytes);
  }
  params.batch.max_length = max_length;
  params.queries = kernel_queries;
  params.output = kernel_output;
  params.io = io;
  return staged;
}

void QuantizedKVCache::finish_decode(const StagedDecode& staged, void* output) {
  // The call's one sync: the output is the caller's to read on return.
  if (staged.backend_memory || staged.io_bytes == 0) {
    backend_->synchronize();
  } else {
    backend_->copy_out(output, staged.params.output, staged.io_bytes);
  }
  check_pending_appends();  // after the sync: one small read, only when appends are pending
}

DecodeParams QuantizedKVCache::decode_params(int64_t layer) const {
  if (layer < 0 || layer >= model_.num_layers) {
    throw std::invalid_argument("quantized KV cache '" + name_ + "': decode_params: no layer " + std::to_string(layer));
  }
  DecodeParams params;
  params.kernel = options_.decode_kernel;
  params.int8_steps = options_.int8_steps;
  params.rotate_before_exact_blocks = options_.rotate_before_exact_blocks;
  params.batch.page_table = device_page_table_->as<int32_t>();
  params.batch.page_table_stride = page_table_stride_;
  params.io = ElementType::kFloat32;
  params.num_heads = static_cast<int32_t>(model_.num_heads);
  params.softmax_scale = options_.softmax_scale;
  params.tokens_per_split = static_cast<int32_t>(options_.tokens_per_split);
  const TensorState& k = tensor(layer, TensorKind::kKeys);
  const TensorState& v = tensor(layer, TensorKind::kValues);
  params.key_cache = k.paged();
  params.value_cache = v.paged();
  params.key_dequantization = k.dequantization;
  params.value_dequantization = v.dequantization;
  params.key_rotation = k.rotation;
  params.value_rotation = v.rotation;
  params.keys_pre_rope = keys_pre_rope_;
  params.rope_inverse_frequencies = rope_frequencies_->as<float>();
  return params;
}

// ------------------------------------------------------------ inspection

TokenReadout QuantizedKVCache::read_token(int64_t layer, TensorKind kind, int32_t sequence, int64_t token) const {
  check_sequence(sequence, "read_token");
  const int64_t tokens = length(sequence, layer);
  if (token < 0 || token >= tokens) {
    throw std::invalid_argument("quantized KV cache '" + name_ + "': read_token: token " + std::to_string(token) +
                                " of a sequence of " + std::to_string(tokens));
  }
  const TensorState& t = tensor(layer, kind);
  const int32_t* page_row = page_table_.data() + static_cast<size_t>(sequence) * page_table_stride_;
  if (backend_->host_addressable()) return read_token_reference(t.paged(), t.dequantization, sequence, page_row, tokens, token);
  // A device backend: the reference reads host copies of the pools and of
  // the dequantization constants.
  const TensorPoolCopy pools = copy_pools(layer, kind);
  PagedTensor paged = t.paged();
  paged.pages = const_cast<uint8_t*>(pools.pages.data());
  paged.exact = const_cast<uint8_t*>(pools.exact.data());
  paged.outlier_pages = pools.outlier_pages.empty() ? nullptr : const_cast<uint8_t*>(pools.outlier_pages.data());
  paged.outlier_page_table = pools.outlier_page_table.empty() ? nullptr : const_cast<int32_t*>(pools.outlier_page_table.data());
  const auto host_floats = [&](const std::unique_ptr<Buffer>& buffer) {
    std::vector<float> values(buffer ? static_cast<size_t>(buffer->bytes / 4) : 0);
    if (buffer) backend_->copy_out(values.data(), buffer->data, buffer->bytes);
    return values;
  };
  const std::vector<float> levels = host_floats(t.levels), scale = host_floats(t.channel_scale),
                           offset = host_floats(t.channel_offset);
  Dequantization dequantization = t.dequantization;
  dequantization.levels = levels.data();
  dequantization.channel_scale = scale.empty() ? nullptr : scale.data();
  dequantization.channel_offset = offset.empty() ? nullptr : offset.data();
  return read_token_reference(paged, dequantization, sequence, page_row, tokens, token);
}

TensorPoolCopy QuantizedKVCache::copy_pools(int64_t layer, TensorKind kind) const {
  const TensorState& t = tensor(layer, kind);
  const auto host_copy = [&](const std::unique_ptr<Buffer>& buffer, auto& out) {
    using Value = typename std::decay_t<decltype(out)>::value_type;
    out.assign(buffer ? static_cast<size_t>(buffer->bytes / static_cast<int64_t>(sizeof(Value))) : 0, Value{});
    if (buffer) backend_->copy_out(out.data(), buffer->data, static_cast<int64_t>(out.size() * sizeof(Value)));
  };
  TensorPoolCopy copy;
  host_copy(t.pages, copy.pages);
  host_copy(t.exact, copy.exact);
  host_copy(t.outlier_pages, copy.outlier_pages);
  host_copy(t.outlier_table, copy.outlier_page_table);
  host_copy(t.entry_counts, copy.entry_counts);
  host_copy(t.pages_used, copy.outlier_pages_used);
  return copy;
}

TensorBytes QuantizedKVCache::held_bytes(int64_t layer, TensorKind kind, int32_t sequence) const {
  check_sequence(sequence, "held_bytes");
  const TensorState& t = tensor(layer, kind);
  int32_t outlier_pages = 0;
  backend_->copy_out(&outlier_pages, t.pages_used->as<int32_t>() + sequence, 4);
  const int64_t pages = pages_of_[static_cast<size_t>(sequence)];
  TensorBytes b;
  b.exact = t.layout.exact_slot_bytes;
  b.codes = pages * t.layout.page_bytes;
  b.page_table = pages * kPageTableEntryBytes;
  b.outlier_entries = outlier_pages * t.layout.outlier_page_bytes;
  b.outlier_page_table = outlier_pages * kPageTableEntryBytes;
  return b;
}

int64_t QuantizedKVCache::outlier_entries(int64_t layer, TensorKind kind, int32_t sequence) const {
  check_sequence(sequence, "outlier_entries");
  uint32_t entries = 0;
  backend_->copy_out(&entries, tensor(layer, kind).entry_counts->as<uint32_t>() + sequence, 4);
  return entries;
}

}  // namespace kvforge::kernels
