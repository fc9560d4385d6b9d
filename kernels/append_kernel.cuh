#pragma once
// Device code of quantize-on-append (docs/runtime-layout.md, section 6.1):
// one thread block per sequence of the batch, tensor kind and channel slice
// (kernels/append_slices.h: per_channel_tokens keys and per_token groups of
// whole warps without outliers take several), walking the
// sequence's new tokens in order (a token's outlier entries are numbered
// after the previous token's, and a per_channel_tokens group reads its
// earlier tokens back from the ring), the threads sharing each token's
// channels. Every decision is the CPU reference's (kernels/cpu_reference.cpp)
// in float64 with the same operations in the same order, so codes, pairs,
// row pointers, exact rows and outlier entries are bit for bit the
// reference's (outlier page ids may differ: the blocks pop the free-page
// stack concurrently). The file is compiled without FMA contraction
// (--fmad=false): every fma below is written out as the reference's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "kernels/append_slices.h"
#include "kernels/decode_params.h"
#include "kernels/reciprocal_division.h"
#include "kernels/span_rank.h"
#include "kernels/top_bottom_rounds.h"

namespace kvforge::kernels::append_device {

inline constexpr int kThreads = kAppendBlockThreads;
inline constexpr int kWarps = kThreads / 32;

// ------------------------------------------------------------ shared memory

// A runtime group's grid, built once from its inlier (min, max) and then
// applied to each of its elements: uniform, code = rint((x - origin) / step)
// with origin = lo and step = (hi - lo) / top; non-uniform, the level nearest
// to (x - origin) / step with origin = (lo + hi) / 2 and step = (hi - lo) / 2
// (lo, hi = min, max times the clip ratio). Not valid (every code 0) when
// hi > lo does not hold.
struct RuntimeGrid {
  double origin = 0, step = 0;
  double inverse = 0;  // 1 / step rounded to nearest, where divides_by_reciprocal(step)
  int32_t valid = 0;
};

// The dynamic shared memory of one block (byte offsets; 8-byte items
// first): the token (y), a scratch token (the input before rotation, or a
// ring token read back), the token_top_bottom sort's keys, the per-token
// groups' grids, the KV heads' token_tau statistics, the sort's element
// indices and each element's position, and the outlier bit masks (one per
// token of a per_channel_tokens group, else one). The sort holds each
// outlier span padded to a power of two (span_slots).
struct SharedLayout {
  int64_t y = 0, scratch = 0, sort_keys = 0, grids = 0, head_stats = 0, sort_tags = 0, ranks = 0, masks = 0, bytes = 0;
  int32_t groups = 0, mask_tokens = 0, mask_words = 0;
  int64_t span_slots = 0, sort_slots = 0;
};

KVFORGE_HOST_DEVICE inline SharedLayout shared_layout(const TensorPageLayout& l, const Quantization& q) {
  const TensorLayoutSpec& s = l.spec;
  const int64_t width = static_cast<int64_t>(s.kv_heads) * s.head_dim;
  SharedLayout m;
  m.groups = s.grouping == ScaleGrouping::kPerToken           ? static_cast<int32_t>(width / s.group)
             : s.grouping == ScaleGrouping::kPerTokenAllHeads ? 1
                                                              : 0;
  const bool outliers = q.outliers != OutlierSelection::kNone;
  m.mask_tokens = !outliers ? 0 : s.grouping == ScaleGrouping::kPerChannelTokens ? s.group : 1;
  m.mask_words = static_cast<int32_t>((width + 31) / 32);
  if (q.outliers == OutlierSelection::kTokenTopBottom && l.outlier_span_size > 0) {
    m.span_slots = span_rank::slots_per_span_for(l.outlier_span_size);
    m.sort_slots = width / l.outlier_span_size * m.span_slots;
  }
  m.y = 0;
  m.scratch = m.y + width * 8;
  m.sort_keys = m.scratch + width * 8;
  m.grids = m.sort_keys + m.sort_slots * 8;
  m.head_stats = m.grids + m.groups * static_cast<int64_t>(sizeof(RuntimeGrid));
  m.sort_tags = m.head_stats + 2 * static_cast<int64_t>(s.kv_heads) * 8;
  m.ranks = m.sort_tags + m.sort_slots * 4;
  m.masks = m.ranks + (m.sort_slots > 0 ? width * 4 : 0);
  m.bytes = m.masks + static_cast<int64_t>(m.mask_tokens) * m.mask_words * 4;
  return m;
}

// One tensor kind's view of AppendParams, with its shared-memory layout
// (shared_layout of its cache layout and quantization, made by the host: in
// the kernel its 64-bit arithmetic was ~4% of a decoding step's
// instructions).
struct TensorAppendArgs {
  SequenceBatch batch;
  int32_t* page_table = nullptr;  // batch.page_table, written: the inline arrays' new pages
  const int64_t* token_offsets = nullptr;
  const void* input = nullptr;
  ElementType input_type = ElementType::kFloat32;
  PagedTensor cache;
  Quantization quantization;
  Rotation rotation;
  OutlierAllocator outliers;
  SharedLayout shared;
};

// ------------------------------------------------------------ elements

__device__ inline double load_element(ElementType type, const uint8_t* at) {
  switch (type) {
    case ElementType::kFloat16: return static_cast<double>(__half2float(*reinterpret_cast<const __half*>(at)));
    case ElementType::kBFloat16:
      return static_cast<double>(__bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(at)));
    case ElementType::kFloat32: break;
  }
  return static_cast<double>(*reinterpret_cast<const float*>(at));
}

// Rounded to nearest even in one step from double (cvt.rn.f16.f64 and
// cvt.rn.bf16.f64), as element_conversion.cpp does on the host.
__device__ inline void store_element(ElementType type, double value, uint8_t* at) {
  switch (type) {
    case ElementType::kFloat16: *reinterpret_cast<__half*>(at) = __double2half(value); return;
    case ElementType::kBFloat16: *reinterpret_cast<__nv_bfloat16*>(at) = __double2bfloat16(value); return;
    case ElementType::kFloat32: break;
  }
  *reinterpret_cast<float*>(at) = __double2float_rn(value);
}

__device__ inline double round_to_element(ElementType type, double value) {
  switch (type) {
    case ElementType::kFloat16: return static_cast<double>(__half2float(__double2half(value)));
    case ElementType::kBFloat16: return static_cast<double>(__bfloat162float(__double2bfloat16(value)));
    case ElementType::kFloat32: break;
  }
  return static_cast<double>(__double2float_rn(value));
}

__device__ inline void store_u32(uint8_t* at, uint32_t value) { *reinterpret_cast<uint32_t*>(at) = value; }

// ------------------------------------------------------------ codes

// The index of the encode level nearest to `normalized`: the midpoints
// strictly below it (ties to the lower level).
__device__ inline int level_code(double normalized, const double* midpoints, int levels) {
  int code = 0;
  while (code < levels - 1 && midpoints[code] < normalized) ++code;
  return code;
}

__device__ inline int clamp_code(double rounded, int top) {
  return static_cast<int>(rounded < 0.0 ? 0.0 : (static_cast<double>(top) < rounded ? static_cast<double>(top) : rounded));
}

// A runtime group's grid given its inlier (min, max): the reference's
// operations, split so that the group's part runs once per group.
// The step's reciprocal is taken here, once per group, so that each
// element's division is three operations (kernels/reciprocal_division.h).
template <int kBits>
__device__ inline RuntimeGrid runtime_grid(const Quantization& q, double min, double max) {
  constexpr int top = (1 << kBits) - 1;
  const double lo = __dmul_rn(min, q.clip_ratio), hi = __dmul_rn(max, q.clip_ratio);
  if (!(hi > lo)) return {};
  RuntimeGrid grid;
  if (!q.non_uniform) {
    grid.origin = lo;
    grid.step = __ddiv_rn(__dsub_rn(hi, lo), static_cast<double>(top));
  } else {
    grid.origin = __ddiv_rn(__dadd_rn(lo, hi), 2.0);
    grid.step = __ddiv_rn(__dsub_rn(hi, lo), 2.0);
  }
  grid.inverse = divides_by_reciprocal(grid.step) ? __drcp_rn(grid.step) : 0.0;
  grid.valid = 1;
  return grid;
}

// The code of x on a runtime group's grid.
template <int kBits>
__device__ inline int runtime_code(const Quantization& q, const RuntimeGrid& grid, double x) {
  constexpr int top = (1 << kBits) - 1;
  if (grid.valid == 0) return 0;
  const double shifted = __dsub_rn(x, grid.origin);
  // |shifted| < 2^129 (element-type numbers), so with the step in range the
  // quotient is in range too; a non-finite x divides outright.
  const double normalized = grid.inverse != 0.0 && isfinite(shifted)
                                ? divide_by_reciprocal(shifted, grid.step, grid.inverse)
                                : __ddiv_rn(shifted, grid.step);
  if (!q.non_uniform) return clamp_code(rint(normalized), top);
  return level_code(normalized, q.encode_midpoints, top + 1);
}

// The 32-bit code word holding channel i's code, assembled over the lanes
// that hold its other channels: the caller's lane holds channel i with
// i % 32 == lane (a word's 32 / bits channels are consecutive and aligned,
// so they lie in consecutive lanes). Every lane of the warp calls it.
template <int kBits>
__device__ inline uint32_t code_word(int code, int64_t i) {
  constexpr int per_word = 32 / kBits;
  uint32_t bits = static_cast<uint32_t>(code) << ((i % per_word) * kBits);
#pragma unroll
  for (int offset = per_word / 2; offset > 0; offset /= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, offset);
  return bits;
}

template <int kBits>
__device__ inline int offline_code(const Quantization& q, double x, int64_t channel) {
  constexpr int top = (1 << kBits) - 1;
  const double normalized = __ddiv_rn(__dsub_rn(x, static_cast<double>(q.channel_offset[channel])),
                                      static_cast<double>(q.channel_scale[channel]));
  if (q.non_uniform) return level_code(normalized, q.encode_midpoints, top + 1);
  return clamp_code(rint(__ddiv_rn(__dmul_rn(__dadd_rn(normalized, 1.0), static_cast<double>(top)), 2.0)), top);
}

// ------------------------------------------------------------ the block

// The inlier range of a group as the reference's GroupRange builds it in
// index order: the first inlier, then min = (v < min ? v : min) and
// max = (max < v ? v : max), so among equal extremes (+0 and -0) the first
// in index order is kept; `at` carries that index through the reduction.
struct Extreme {
  double value;
  int32_t at;  // -1: no inlier yet
};

__device__ inline Extreme lower(Extreme a, Extreme b) {
  if (a.at < 0) return b;
  if (b.at < 0) return a;
  if (b.value < a.value) return b;
  if (a.value < b.value) return a;
  return a.at <= b.at ? a : b;
}

__device__ inline Extreme higher(Extreme a, Extreme b) {
  if (a.at < 0) return b;
  if (b.at < 0) return a;
  if (a.value < b.value) return b;
  if (b.value < a.value) return a;
  return a.at <= b.at ? a : b;
}

__device__ inline Extreme shuffle_down(Extreme e, int offset) {
  return {__shfl_down_sync(0xffffffffu, e.value, offset), __shfl_down_sync(0xffffffffu, e.at, offset)};
}

// The warp's first candidate among the largest (top) or the smallest
// (bottom), in every lane: the key's high word, its low word among the
// lanes with that high word, then the lowest index with that key, by the
// warp's integer reductions (lanes without a candidate pass the reduction's
// neutral value; top_bottom_rounds::kNone is the largest index).
__device__ inline top_bottom_rounds::Candidate warp_first_top(top_bottom_rounds::Candidate c) {
  const auto high = static_cast<uint32_t>(c.key >> 32);
  const uint32_t top_high = __reduce_max_sync(0xffffffffu, high);
  const uint32_t top_low = __reduce_max_sync(0xffffffffu, high == top_high ? static_cast<uint32_t>(c.key) : 0u);
  const uint64_t key = (static_cast<uint64_t>(top_high) << 32) | top_low;
  return {key, __reduce_min_sync(0xffffffffu, c.key == key ? c.index : top_bottom_rounds::kNone)};
}

__device__ inline top_bottom_rounds::Candidate warp_first_bottom(top_bottom_rounds::Candidate c) {
  const auto high = static_cast<uint32_t>(c.key >> 32);
  const uint32_t bottom_high = __reduce_min_sync(0xffffffffu, high);
  const uint32_t bottom_low =
      __reduce_min_sync(0xffffffffu, high == bottom_high ? static_cast<uint32_t>(c.key) : 0xffffffffu);
  const uint64_t key = (static_cast<uint64_t>(bottom_high) << 32) | bottom_low;
  return {key, __reduce_min_sync(0xffffffffu, c.key == key ? c.index : top_bottom_rounds::kNone)};
}

template <ScaleGrouping kGrouping, int kBits>
class BlockAppender {
 public:
  using Scan = cub::BlockScan<int32_t, kThreads>;

  __device__ BlockAppender(const TensorAppendArgs& args, uint8_t* shared, typename Scan::TempStorage& scan,
                           uint32_t& entry_count, int32_t& pages_used, int32_t& abort)
      : a_(args),
        l_(args.cache.layout),
        q_(args.quantization),
        m_(args.shared),
        y_(reinterpret_cast<double*>(shared + m_.y)),
        scratch_(reinterpret_cast<double*>(shared + m_.scratch)),
        sort_keys_(reinterpret_cast<uint64_t*>(shared + m_.sort_keys)),
        grids_(reinterpret_cast<RuntimeGrid*>(shared + m_.grids)),
        head_stats_(reinterpret_cast<double*>(shared + m_.head_stats)),
        sort_tags_(reinterpret_cast<uint32_t*>(shared + m_.sort_tags)),
        ranks_(reinterpret_cast<int32_t*>(shared + m_.ranks)),
        masks_(reinterpret_cast<uint32_t*>(shared + m_.masks)),
        scan_(scan),
        entry_count_(entry_count),
        pages_used_(pages_used),
        abort_(abort),
        dim_(l_.spec.head_dim),
        width_(l_.spec.kv_heads * l_.spec.head_dim),
        element_(l_.spec.element),
        element_bytes_(kvforge::kernels::element_bytes(l_.spec.element)) {}

  // The block's sequence: its new tokens in order, at channel slice `slice`
  // (channel_slices: every channel where the tensor takes one block).
  // `arrays`: the launch's inline batch arrays (used when their count is
  // positive).
  __device__ void run(int32_t entry, int32_t slice, const InlineBatchArrays& arrays) {
    const int32_t per_slice = slice_channels(l_, q_);
    channel_begin_ = slice * per_slice;
    channel_end_ = min(width_, channel_begin_ + per_slice);
    const bool in_params = arrays.count > 0;
    slot_ = in_params ? arrays.slots[entry] : a_.batch.slots[entry];
    page_row_ = a_.batch.page_table + static_cast<int64_t>(slot_) * a_.batch.page_table_stride;
    const bool outliers = l_.outlier_spans > 0;
    const int64_t length = in_params ? arrays.lengths[entry] : a_.batch.lengths[entry];
    if (threadIdx.x == 0) {
      entry_count_ = outliers ? a_.outliers.entry_counts[slot_] : 0;
      pages_used_ = outliers ? a_.outliers.pages_used[slot_] : 0;
      abort_ = 0;
      // The page the call's tokens open, before the block reads the row
      // (both kinds' blocks write the same id).
      if (in_params && arrays.new_page_plus_one[entry] > 0) {
        a_.page_table[static_cast<int64_t>(slot_) * a_.batch.page_table_stride + new_page_index(l_.spec, length)] =
            arrays.new_page_plus_one[entry] - 1;
      }
    }
    __syncthreads();
    const int64_t* offsets = in_params ? arrays.token_offsets : a_.token_offsets;
    const int64_t first = offsets[entry], last = offsets[entry + 1];
    const int64_t sink = l_.spec.sink_tokens, ring = l_.ring_capacity;
    for (int64_t row = first; row < last; ++row) {
      const int64_t token = length + (row - first);
      // A per-token grouping's page, read before the token's barriers so
      // that the load is in flight while the token is prepared.
      uint8_t* page = nullptr;
      if constexpr (kGrouping != ScaleGrouping::kPerChannelTokens) {
        if (token >= sink) page = page_of_slot(token - sink);
      }
      prepare_token(row);
      if (token < sink) {
        store_exact(token, y_);
        __syncthreads();
        continue;
      }
      const int64_t s = token - sink;
      bool ok = true;
      if constexpr (kGrouping != ScaleGrouping::kPerChannelTokens) {
        ok = quantize_token(s, page);
      } else if ((s + 1) % l_.spec.group == 0) {
        ok = quantize_channel_group(s / l_.spec.group);
      }
      if (!ok) break;
      // After the group: with a ring of G - 1 tokens the completing token
      // takes the row of its group's first token, read above.
      if (ring > 0) store_exact(sink + s % ring, y_);
      __syncthreads();
    }
    __syncthreads();
    if (threadIdx.x == 0 && outliers) {
      a_.outliers.entry_counts[slot_] = entry_count_;
      a_.outliers.pages_used[slot_] = pages_used_;
    }
  }

 private:
  // y = E(rotate(E(input))) of input row `row`, in shared memory.
  __device__ void prepare_token(int64_t row) {
    const int64_t in_bytes = kvforge::kernels::element_bytes(a_.input_type);
    const auto* input = static_cast<const uint8_t*>(a_.input) + row * width_ * in_bytes;
    const Rotation& r = a_.rotation;
    // Without a rotation the token goes straight to y (one pass and one
    // barrier fewer: a decoding step's append is a chain of latencies).
    double* rounded = r.kind == RotationKind::kNone ? y_ : scratch_;
    // Without a rotation the block's channels only (a slice's block uses
    // no other); a rotation mixes each head's channels: all of them.
    const int32_t begin = r.kind == RotationKind::kNone ? channel_begin_ : 0;
    const int32_t end = r.kind == RotationKind::kNone ? channel_end_ : width_;
    // Unrolled: a thread's loads in flight together, not one after another.
#pragma unroll 4
    for (int i = begin + static_cast<int32_t>(threadIdx.x); i < end; i += kThreads) {
      rounded[i] = round_to_element(element_, load_element(a_.input_type, input + i * in_bytes));
    }
    __syncthreads();
    if (r.kind == RotationKind::kNone) return;
    if (r.kind == RotationKind::kMatrix) {
      // y_j = sum_i (x_i - c_i) R_ij, i ascending, one fma per term.
      for (int j = threadIdx.x; j < width_; j += kThreads) {
        const int head = j / dim_, jj = j % dim_;
        const double* x = scratch_ + head * dim_;
        const float* matrix = r.matrix + head * dim_ * dim_;
        const float* centre = r.centre != nullptr ? r.centre + head * dim_ : nullptr;
        double sum = 0;
        for (int i = 0; i < dim_; ++i) {
          const double shifted = centre != nullptr ? __dsub_rn(x[i], static_cast<double>(centre[i])) : x[i];
          sum = fma(shifted, static_cast<double>(matrix[i * dim_ + jj]), sum);
        }
        y_[j] = round_to_element(element_, sum);
      }
    } else if (r.kind == RotationKind::kPairAngles) {
      const int half = dim_ / 2;
      for (int p = threadIdx.x; p < width_ / 2; p += kThreads) {
        const int64_t head = p / half, j = p % half;
        const double c = r.pair_cos[head * half + j], s = r.pair_sin[head * half + j];
        const double a = scratch_[head * dim_ + j], b = scratch_[head * dim_ + j + half];
        y_[head * dim_ + j] = round_to_element(element_, fma(a, c, -__dmul_rn(b, s)));
        y_[head * dim_ + j + half] = round_to_element(element_, fma(a, s, __dmul_rn(b, c)));
      }
    }
    __syncthreads();
  }

  __device__ uint8_t* exact_row(int64_t head, int64_t row) const {
    return a_.cache.exact + static_cast<int64_t>(slot_) * l_.exact_slot_bytes + exact_row_offset(l_, head, row);
  }

  // The block's channels of exact row `row` (every channel but where the
  // tensor takes a block per channel slice).
  __device__ void store_exact(int64_t row, const double* y) const {
    for (int i = channel_begin_ + threadIdx.x; i < channel_end_; i += kThreads) {
      store_element(element_, y[i], exact_row(i / dim_, row) + (i % dim_) * element_bytes_);
    }
  }

  // Ring row `row` into `out` (shared); the caller synchronizes.
  __device__ void load_exact(int64_t row, double* out) const {
    for (int i = threadIdx.x; i < width_; i += kThreads) {
      out[i] = load_element(element_, exact_row(i / dim_, row) + (i % dim_) * element_bytes_);
    }
  }

  // The channel loops' bound: every lane of a warp runs every round (the
  // words are assembled with shuffles), lanes past the width with code 0.
  __device__ int padded_width() const { return (width_ + kThreads - 1) / kThreads * kThreads; }
  // The same for the block's channels [channel_begin_, channel_end_).
  __device__ int padded_slice_end() const {
    return channel_begin_ + (channel_end_ - channel_begin_ + kThreads - 1) / kThreads * kThreads;
  }

  // s < 2^31 (a sequence's tokens): a 32-bit division, not a 64-bit one.
  __device__ uint8_t* page_of_slot(int64_t s) const {
    return a_.cache.pages + static_cast<int64_t>(page_row_[static_cast<int32_t>(s) / l_.spec.page_size]) * l_.page_bytes;
  }

  __device__ static bool is_marked(const uint32_t* mask, int64_t i) {
    return mask != nullptr && ((mask[i / 32] >> (i % 32)) & 1u) != 0;
  }

  // token_top_bottom without comparing every pair (n^2 per span: 230 us per
  // token over 1024 all-heads channels): kernels/span_rank.h, each stage of
  // the network on the block's threads.
  __device__ span_rank::SpanSort span_sort() const {
    return {sort_keys_, sort_tags_, static_cast<int>(l_.outlier_span_size), static_cast<int>(m_.span_slots),
            static_cast<int>(m_.sort_slots)};
  }

  __device__ void sort_spans(const double* y) {
    const span_rank::SpanSort sort = span_sort();
    for (int x = threadIdx.x; x < sort.slots; x += kThreads) span_rank::fill_slot(sort, y, x);
    __syncthreads();
    for (int size = 2; size <= sort.slots_per_span; size *= 2) {
      for (int stride = size / 2; stride > 0; stride /= 2) {
        for (int x = threadIdx.x; x < sort.slots; x += kThreads) span_rank::compare_exchange(sort, size, stride, x);
        __syncthreads();
      }
    }
    for (int x = threadIdx.x; x < sort.slots; x += kThreads) span_rank::record_rank(sort, ranks_, x);
    __syncthreads();
  }

  // token_top_bottom by rounds (top_bottom_rounds.h): per span, k rounds
  // of a block-wide first-of-the-rest among the largest and the smallest,
  // their elements' bits set in `mask` (zeroed before; the first round's
  // barrier orders the zeroing before the bits).
  __device__ void select_top_bottom_by_rounds(const double* y, uint32_t* mask) {
    using top_bottom_rounds::Candidate;
    constexpr int kSlots = top_bottom_rounds::kMaxSlots;
    // Each round's warp winners, two rounds apart (one barrier a round: a
    // round's slots are rewritten two rounds later, after every thread has
    // passed the barrier between).
    __shared__ Candidate firsts[2][2][kWarps];  // [round parity][top, bottom][warp]
    const int n = l_.outlier_span_size, spans = l_.outlier_spans;
    const int k = q_.top_bottom_count, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int parity = 0;
    for (int span = 0; span < spans; ++span) {
      const int base = span * n;
      uint64_t key[kSlots];
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        const int at = threadIdx.x + j * kThreads;
        key[j] = at < n ? span_rank::order_key(y[base + at]) : 0;
      }
      uint32_t top_taken = 0, bottom_taken = 0;  // bit j: slot j's element taken
      for (int round = 0; round < k; ++round) {
        Candidate top, bottom;
        top_bottom_rounds::thread_firsts(key, n, base, static_cast<int>(threadIdx.x), kThreads, top_taken, bottom_taken,
                                         top, bottom);
        top = warp_first_top(top);
        bottom = warp_first_bottom(bottom);
        if (lane == 0) {
          firsts[parity][0][warp] = top;
          firsts[parity][1][warp] = bottom;
        }
        __syncthreads();
        top = firsts[parity][0][0];
        bottom = firsts[parity][1][0];
        for (int w = 1; w < kWarps; ++w) {
          const Candidate t = firsts[parity][0][w], b = firsts[parity][1][w];
          if (top_bottom_rounds::before_in_top(t, top)) top = t;
          if (top_bottom_rounds::before_in_bottom(b, bottom)) bottom = b;
        }
        // Each round takes one of each: 2k < n leaves a candidate for both.
        top_taken |= top_bottom_rounds::taken_bit(top.index, base, static_cast<int>(threadIdx.x), kThreads);
        bottom_taken |= top_bottom_rounds::taken_bit(bottom.index, base, static_cast<int>(threadIdx.x), kThreads);
        parity ^= 1;
      }
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        const int i = base + static_cast<int>(threadIdx.x) + j * kThreads;
        if ((((top_taken | bottom_taken) >> j) & 1u) != 0) atomicOr(&mask[i / 32], 1u << (i % 32));
      }
    }
  }

  // The token's outliers (docs/artifact.md rule 3) as bits of `mask`.
  __device__ void mark_outliers(const double* y, uint32_t* mask) {
    for (int32_t w = threadIdx.x; w < m_.mask_words; w += kThreads) mask[w] = 0;
    const bool ranked = q_.outliers == OutlierSelection::kTokenTopBottom && q_.top_bottom_count > 0 &&
                        2 * static_cast<int64_t>(q_.top_bottom_count) < l_.outlier_span_size;
    const bool by_rounds = ranked && top_bottom_rounds::applies(l_.outlier_span_size, l_.outlier_spans,
                                                                q_.top_bottom_count, kThreads);
    if (by_rounds) {
      select_top_bottom_by_rounds(y, mask);
    } else if (ranked) {
      sort_spans(y);
    }
    if (q_.outliers == OutlierSelection::kTokenTau) {
      // Sums in channel order, as the reference: one thread per head.
      for (int64_t head = threadIdx.x; head < l_.spec.kv_heads; head += kThreads) {
        const double* v = y + head * dim_;
        double sum = 0;
        for (int d = 0; d < dim_; ++d) sum = __dadd_rn(sum, v[d]);
        const double mean = __ddiv_rn(sum, static_cast<double>(dim_));
        double squares = 0;
        for (int d = 0; d < dim_; ++d) {
          const double deviation = __dsub_rn(v[d], mean);
          squares = __dadd_rn(squares, __dmul_rn(deviation, deviation));
        }
        head_stats_[2 * head] = mean;
        head_stats_[2 * head + 1] = __dsqrt_rn(__ddiv_rn(squares, static_cast<double>(dim_)));
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < width_; i += kThreads) {
      bool outlier = false;
      switch (q_.outliers) {
        case OutlierSelection::kNone:
          break;
        case OutlierSelection::kChannelThresholds:
          outlier = y[i] < static_cast<double>(q_.outlier_low[i]) || y[i] > static_cast<double>(q_.outlier_high[i]);
          break;
        case OutlierSelection::kTokenTopBottom: {
          // i is among the k largest when fewer than k elements precede it
          // in (value descending, index ascending), likewise the smallest.
          const int64_t n = l_.outlier_span_size, k = q_.top_bottom_count;
          if (k <= 0 || by_rounds) break;  // by rounds: marked already
          outlier = 2 * k >= n || span_rank::top_or_bottom(span_sort(), ranks_, y, i, k);
          break;
        }
        case OutlierSelection::kTokenTau: {
          const int head = i / dim_;
          outlier = fabs(__dsub_rn(y[i], head_stats_[2 * head])) > __dmul_rn(head_stats_[2 * head + 1], q_.outlier_tau);
          break;
        }
      }
      if (outlier) atomicOr(&mask[i / 32], 1u << (i % 32));
    }
    __syncthreads();
  }

  // Outlier page `number` of the slot exists (thread 0; false and
  // `exhausted` set when no page is free or the slot's table is full).
  __device__ bool reserve_outlier_pages(int64_t entries_end) {
    const int64_t per_page = l_.spec.outlier_page_entries;
    const int64_t needed = (entries_end + per_page - 1) / per_page;
    int32_t* table = a_.cache.outlier_page_table + static_cast<int64_t>(slot_) * a_.cache.outlier_table_stride;
    while (pages_used_ < needed) {
      if (pages_used_ >= a_.cache.outlier_table_stride) return false;
      const int32_t height = atomicSub(a_.outliers.free_count, 1);
      if (height <= 0) {
        atomicAdd(a_.outliers.free_count, 1);
        return false;
      }
      table[pages_used_] = a_.outliers.free_pages[height - 1];
      ++pages_used_;
    }
    return true;
  }

  // The token's CSR rows (spans in order, entries in ascending index):
  // entries numbered by a block-wide prefix count of the mask, each row's end
  // pointer written by the thread holding the row's last element.
  __device__ bool write_outlier_rows(uint8_t* page, int64_t in_page, const double* y, const uint32_t* mask) {
    // 32-bit index math (a row's width): the 64-bit remainders by the span
    // were library calls, twice per element.
    const int32_t span = l_.outlier_span_size, spans = l_.outlier_spans;
    const int32_t chunk = (width_ + kThreads - 1) / kThreads;
    const int32_t begin = static_cast<int32_t>(threadIdx.x) * chunk, end = begin + chunk < width_ ? begin + chunk : width_;
    int32_t count = 0;
    for (int32_t i = begin; i < end; ++i) count += is_marked(mask, i) ? 1 : 0;
    int32_t before = 0, total = 0;
    Scan(scan_).ExclusiveSum(count, before, total);
    const uint32_t base = entry_count_;
    if (threadIdx.x == 0 && !reserve_outlier_pages(static_cast<int64_t>(base) + total)) {
      *a_.outliers.exhausted = 1;
      abort_ = 1;
    }
    __syncthreads();
    if (abort_ != 0) return false;
    const auto per_page = static_cast<uint32_t>(l_.spec.outlier_page_entries);
    const int32_t* table = a_.cache.outlier_page_table + static_cast<int64_t>(slot_) * a_.cache.outlier_table_stride;
    uint32_t next = base + static_cast<uint32_t>(before);
    for (int32_t i = begin; i < end; ++i) {
      if (is_marked(mask, i)) {
        const uint32_t e = next++;
        uint8_t* outlier_page = a_.cache.outlier_pages + static_cast<int64_t>(table[e / per_page]) * l_.outlier_page_bytes;
        const auto index = static_cast<uint32_t>(i % span);
        uint8_t* index_at = outlier_page + outlier_index_offset(l_, e % per_page);
        if (l_.outlier_index_bytes == 4) {
          store_u32(index_at, index);
        } else {
          *reinterpret_cast<uint16_t*>(index_at) = static_cast<uint16_t>(index);
        }
        store_element(element_, y[i], outlier_page + outlier_value_offset(l_, e % per_page));
      }
      if ((i + 1) % span == 0) store_u32(page + row_pointer_offset(l_, in_page * spans + i / span + 1), next);
    }
    if (threadIdx.x == 0 && in_page == 0) store_u32(page + row_pointer_offset(l_, 0), base);
    __syncthreads();
    if (threadIdx.x == 0) entry_count_ = base + static_cast<uint32_t>(total);
    __syncthreads();
    return true;
  }

  // The inlier extremes of y over channels first, first + stride, ... below
  // end, folded over the warp into lane 0 (Extreme: the reference's order).
  __device__ void warp_extremes(const uint32_t* mask, int32_t first, int32_t end, int32_t stride, Extreme& low,
                                Extreme& high) const {
    low = {0, -1};
    high = {0, -1};
    for (int32_t i = first; i < end; i += stride) {
      if (is_marked(mask, i)) continue;
      const Extreme here{y_[i], i};
      low = lower(low, here);
      high = higher(high, here);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      low = lower(low, shuffle_down(low, offset));
      high = higher(high, shuffle_down(high, offset));
    }
  }

  // The inlier (min, max) of channels [begin, end) of y by one warp (every
  // lane gets them), in the reference's order (Extreme); (0, 0) without an
  // inlier.
  __device__ void group_range(const uint32_t* mask, int32_t begin, int32_t end, double& min, double& max) const {
    Extreme low, high;
    warp_extremes(mask, begin + static_cast<int32_t>(threadIdx.x % 32), end, 32, low, high);
    min = __shfl_sync(0xffffffffu, low.at < 0 ? 0.0 : low.value, 0);
    max = __shfl_sync(0xffffffffu, high.at < 0 ? 0.0 : high.value, 0);
  }

  // The inlier (min, max) of channels [begin, end) of y by the whole block,
  // in thread 0 (as group_range: per_token_all_heads has one group over the
  // token, which one warp walked alone, 32 elements a lane, while the other
  // warps waited).
  __device__ void block_range(const uint32_t* mask, int32_t begin, int32_t end, double& min, double& max) const {
    __shared__ Extreme lows[kWarps], highs[kWarps];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    Extreme low, high;
    warp_extremes(mask, begin + static_cast<int32_t>(threadIdx.x), end, kThreads, low, high);
    if (lane == 0) {
      lows[warp] = low;
      highs[warp] = high;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w) {
        low = lower(low, lows[w]);
        high = higher(high, highs[w]);
      }
      min = low.at < 0 ? 0.0 : low.value;
      max = high.at < 0 ? 0.0 : high.value;
    }
  }

  // A per-token grouping's pair of group g (of `size` channels) into the page.
  __device__ void store_group_pair(uint8_t* page, int32_t in_page, int32_t g, int32_t size, double min,
                                   double max) const {
    const int32_t per_head = dim_ / size;  // kPerToken: groups of one head
    uint8_t* pair = kGrouping == ScaleGrouping::kPerToken ? page + token_pair_offset(l_, g / per_head, in_page, g % per_head)
                                                          : page + token_pair_offset(l_, 0, in_page, 0);
    store_element(element_, min, pair);
    store_element(element_, max, pair + element_bytes_);
  }

  // kPerToken with groups of whole warps' widths (the rtn and int2-rot
  // defaults; KIVI's values): each warp takes its groups of the block's
  // channels (a slice's: append_slices.h) from range to codes, the codes of
  // 32 channels per round with no division per channel and no barrier
  // between the pairs and the codes (a decoding step's append is a chain of
  // latencies, and the generic path's code is what its instruction fetches
  // wait for: ncu, bench/README.md).
  __device__ void quantize_groups_by_warp(uint8_t* page, int32_t in_page, const uint32_t* mask, int32_t size) {
    constexpr int per_word = 32 / kBits;
    const int lane = threadIdx.x % 32;
    for (int32_t g = channel_begin_ / size + static_cast<int32_t>(threadIdx.x / 32); g < channel_end_ / size;
         g += kWarps) {
      const int32_t begin = g * size;
      double min, max;
      group_range(mask, begin, begin + size, min, max);
      if (lane == 0) store_group_pair(page, in_page, g, size, min, max);
      const RuntimeGrid grid = runtime_grid<kBits>(q_, min, max);
      uint8_t* row = page + code_row_offset(l_, begin / dim_, in_page);
      const int32_t first_word = (begin % dim_) / per_word;
      for (int32_t k = 0; k < size; k += 32) {
        const int32_t i = begin + k + lane;  // begin and k multiples of 32: a word's channels in consecutive lanes
        const uint32_t bits = code_word<kBits>(runtime_code<kBits>(q_, grid, y_[i]), lane);
        if (lane % per_word == 0) store_u32(row + 4 * (first_word + (k + lane) / per_word), bits);
      }
    }
  }

  // Per-token groupings and per_channel_offline: token slot s.
  // `page`: page_of_slot(s), read by the caller ahead.
  __device__ bool quantize_token(int64_t s, uint8_t* page) {
    const auto in_page = static_cast<int32_t>(s) % l_.spec.page_size;  // s < 2^31: 32 bits, not a 64-bit remainder call
    const bool outliers = q_.outliers != OutlierSelection::kNone;
    uint32_t* mask = outliers ? masks_ : nullptr;
    if (outliers) mark_outliers(y_, mask);
    if constexpr (kGrouping == ScaleGrouping::kPerToken || kGrouping == ScaleGrouping::kPerTokenAllHeads) {
      const int32_t size = width_ / m_.groups;
      if (kGrouping == ScaleGrouping::kPerToken && size % 32 == 0) {
        quantize_groups_by_warp(page, in_page, mask, size);
        if (!outliers) return true;
        return write_outlier_rows(page, in_page, y_, mask);
      }
      if (m_.groups == 1) {
        double min = 0, max = 0;
        block_range(mask, 0, width_, min, max);
        if (threadIdx.x == 0) {
          grids_[0] = runtime_grid<kBits>(q_, min, max);
          store_group_pair(page, in_page, 0, width_, min, max);
        }
      }
      // Else a warp per group: the inlier minimum and maximum, then the pair.
      const int lane = threadIdx.x % 32;
      for (int32_t g = threadIdx.x / 32; m_.groups > 1 && g < m_.groups; g += kWarps) {
        double min, max;
        group_range(mask, g * size, (g + 1) * size, min, max);
        if (lane == 0) {
          grids_[g] = runtime_grid<kBits>(q_, min, max);
          store_group_pair(page, in_page, g, size, min, max);
        }
      }
      __syncthreads();
    }
    // A thread per channel, its word assembled over the lanes (code_word):
    // the token's latency is a few channels' division, not a word's 16.
    constexpr int per_word = 32 / kBits;
    const int group_size = m_.groups > 0 ? width_ / m_.groups : width_;
    // Unrolled: the threads' channels' divisions overlap.
#pragma unroll 4
    for (int i = threadIdx.x; i < padded_width(); i += kThreads) {
      int code = 0;
      if (i < width_) {
        if constexpr (kGrouping == ScaleGrouping::kPerChannelOffline) {
          code = offline_code<kBits>(q_, y_[i], i);
        } else {
          code = runtime_code<kBits>(q_, grids_[i / group_size], y_[i]);
        }
      }
      const uint32_t bits = code_word<kBits>(code, i);
      if (i < width_ && i % per_word == 0) {
        store_u32(page + code_row_offset(l_, i / dim_, in_page) + 4 * ((i % dim_) / per_word), bits);
      }
    }
    if (!outliers) return true;
    return write_outlier_rows(page, in_page, y_, mask);
  }

  // Token i of group g into scratch (the last one is y).
  __device__ const double* load_group_token(int64_t g, int64_t i) {
    if (i == l_.spec.group - 1) return y_;
    load_exact(l_.spec.sink_tokens + (g * l_.spec.group + i) % l_.ring_capacity, scratch_);
    __syncthreads();
    return scratch_;
  }

  // per_channel_tokens: the channels a thread completes at once, token by
  // token: a token's ring row and code row are found once for them, in
  // 32-bit arithmetic (per element, the ring row's 64-bit modulo and the
  // 64-bit offsets made the completion's inner loops 315 and 293
  // instructions an element), and their ring loads are in flight together.
  // Two: four spilled at the two-kind kernel's 128 registers.
  static constexpr int kGroupChannels = 2;

  // A thread's channels of one pass of a group's completion: channel
  // c0 + k kThreads for k < kGroupChannels, each with its offsets in a ring
  // row and in a code row.
  struct GroupChannels {
    int32_t channel[kGroupChannels];
    int64_t exact_offset[kGroupChannels];  // exact_channel_offset
    int64_t code_offset[kGroupChannels];   // code_channel_offset
    bool active[kGroupChannels];           // a channel of the token (else code 0 in the word)
    bool present[kGroupChannels];          // below padded_slice_end: every lane of the block alike
  };

  __device__ GroupChannels group_channels(int32_t c0) const {
    GroupChannels c;
#pragma unroll
    for (int k = 0; k < kGroupChannels; ++k) {
      const int32_t channel = c0 + k * kThreads;
      c.channel[k] = channel;
      c.present[k] = channel - static_cast<int32_t>(threadIdx.x) < padded_slice_end();
      c.active[k] = channel < channel_end_;
      c.exact_offset[k] = c.active[k] ? exact_channel_offset(l_, channel) : 0;
      c.code_offset[k] = c.active[k] ? code_channel_offset(l_, channel) : 0;
    }
    return c;
  }

  // A token's values at a pass's channels: from its ring row, or from y
  // where `row` is null (the group's last token).
  __device__ void group_token_values(const uint8_t* row, const GroupChannels& c, double (&v)[kGroupChannels]) const {
#pragma unroll
    for (int k = 0; k < kGroupChannels; ++k) {
      v[k] = !c.active[k] ? 0.0 : row != nullptr ? load_element(element_, row + c.exact_offset[k]) : y_[c.channel[k]];
    }
  }

  __device__ bool quantize_channel_group(int64_t g) {
    const int32_t group = l_.spec.group;
    const bool outliers = q_.outliers != OutlierSelection::kNone;
    if (outliers) {
      for (int64_t i = 0; i < group; ++i) {
        mark_outliers(load_group_token(g, i), masks_ + i * m_.mask_words);
      }
    }
    // The group's first slot (a sequence's slots are fewer than 2^31).
    const int32_t first = static_cast<int32_t>(g) * group;
    const GroupRing group_rows = group_ring(l_, first);
    const int64_t row_stride = exact_row_stride(l_);
    const uint8_t* exact_slot = a_.cache.exact + static_cast<int64_t>(slot_) * l_.exact_slot_bytes;
    // Token i's ring row, or none for the group's last token (in y).
    const auto token_row = [&](int32_t i) -> const uint8_t* {
      return i < group - 1 ? exact_slot + group_rows.row(i) * row_stride : nullptr;
    };
    const int32_t page_size = l_.spec.page_size;
    const auto per_page = static_cast<int32_t>(pairs_per_page(l_));
    constexpr int per_word = 32 / kBits;
    // A thread per channel (kGroupChannels at a time): its range over the
    // group's tokens in token order (as the reference), its pair, then its
    // code in each token's word (assembled over the lanes, code_word).
    for (int32_t c0 = channel_begin_ + threadIdx.x; c0 < padded_slice_end(); c0 += kGroupChannels * kThreads) {
      const GroupChannels c = group_channels(c0);
      double min[kGroupChannels], max[kGroupChannels];
      bool any[kGroupChannels];
#pragma unroll
      for (int k = 0; k < kGroupChannels; ++k) {
        min[k] = max[k] = 0;
        any[k] = false;
      }
      for (int32_t i = 0; i < group; ++i) {
        double v[kGroupChannels];
        group_token_values(token_row(i), c, v);
#pragma unroll
        for (int k = 0; k < kGroupChannels; ++k) {
          if (!c.active[k] || (outliers && is_marked(masks_ + i * m_.mask_words, c.channel[k]))) continue;
          if (!any[k]) {
            min[k] = max[k] = v[k];
            any[k] = true;
          } else {
            min[k] = v[k] < min[k] ? v[k] : min[k];
            max[k] = max[k] < v[k] ? v[k] : max[k];
          }
        }
      }
      RuntimeGrid grid[kGroupChannels];
#pragma unroll
      for (int k = 0; k < kGroupChannels; ++k) {
        if (!c.active[k]) continue;
        const StreamPlace place = stream_place(first, static_cast<int32_t>(l_.pairs_per_slot), per_page, c.channel[k]);
        uint8_t* pair = a_.cache.pages + static_cast<int64_t>(page_row_[place.entry]) * l_.page_bytes +
                        l_.params_offset + static_cast<int64_t>(place.offset) * l_.pair_bytes;
        store_element(element_, min[k], pair);
        store_element(element_, max[k], pair + element_bytes_);
        grid[k] = runtime_grid<kBits>(q_, min[k], max[k]);
      }
      // Every present lane runs every token (code_word's shuffles), the
      // inactive ones with code 0.
      for (int32_t i = 0; i < group; ++i) {
        const int32_t s = first + i;
        uint8_t* code_row = a_.cache.pages + static_cast<int64_t>(page_row_[s / page_size]) * l_.page_bytes +
                            static_cast<int64_t>(s % page_size) * l_.row_bytes;
        double v[kGroupChannels];
        group_token_values(token_row(i), c, v);
#pragma unroll
        for (int k = 0; k < kGroupChannels; ++k) {
          if (!c.present[k]) continue;
          const int code = c.active[k] ? runtime_code<kBits>(q_, grid[k], v[k]) : 0;
          const uint32_t bits = code_word<kBits>(code, c.channel[k]);
          if (c.active[k] && c.channel[k] % per_word == 0) store_u32(code_row + c.code_offset[k], bits);
        }
      }
    }
    __syncthreads();
    if (!outliers) return true;
    for (int64_t i = 0; i < group; ++i) {
      const int64_t s = g * group + i;
      if (!write_outlier_rows(page_of_slot(s), s % l_.spec.page_size, load_group_token(g, i),
                              masks_ + i * m_.mask_words)) {
        return false;
      }
      __syncthreads();  // scratch is reloaded for the next token
    }
    return true;
  }

  const TensorAppendArgs& a_;
  const TensorPageLayout& l_;
  const Quantization& q_;
  const SharedLayout m_;
  double* y_;
  double* scratch_;
  uint64_t* sort_keys_;
  RuntimeGrid* grids_;
  double* head_stats_;
  uint32_t* sort_tags_;
  int32_t* ranks_;
  uint32_t* masks_;
  typename Scan::TempStorage& scan_;
  uint32_t& entry_count_;
  int32_t& pages_used_;
  int32_t& abort_;
  // 32-bit: a token row's channel index math (a 64-bit division is several
  // times a 32-bit one, and the channel loops divide by head_dim and group).
  const int32_t dim_, width_;
  const ElementType element_;
  const int64_t element_bytes_;
  int32_t slot_ = 0;
  const int32_t* page_row_ = nullptr;
  int32_t channel_begin_ = 0, channel_end_ = 0;  // the block's channels (run)
};

// One block per batch entry (blockIdx.x) and channel slice (blockIdx.y,
// append_slices.h) for one tensor kind.
template <ScaleGrouping kGrouping, int kBits>
__global__ void __launch_bounds__(kThreads)
    append_kernel(const __grid_constant__ TensorAppendArgs args, const __grid_constant__ InlineBatchArrays arrays) {
  extern __shared__ __align__(16) uint8_t shared[];
  __shared__ typename BlockAppender<kGrouping, kBits>::Scan::TempStorage scan;
  __shared__ uint32_t entry_count;
  __shared__ int32_t pages_used, abort;
  BlockAppender<kGrouping, kBits> appender(args, shared, scan, entry_count, pages_used, abort);
  appender.run(static_cast<int32_t>(blockIdx.x), static_cast<int32_t>(blockIdx.y), arrays);
}

// Keys (blockIdx.y below their channel_slices: a block per slice) and
// values (the slices after them) of batch entry blockIdx.x in one
// launch: a decoding step's append is otherwise two small kernels, and at
// batch 1 their launches, not their work, are its time. The same appenders
// as append_kernel's (each kind's state in its own static shared memory).
template <ScaleGrouping kKeys, ScaleGrouping kValues, int kBits>
__global__ void __launch_bounds__(kThreads)
    append_pair_kernel(const __grid_constant__ TensorAppendArgs keys, const __grid_constant__ TensorAppendArgs values,
                       const __grid_constant__ InlineBatchArrays arrays) {
  extern __shared__ __align__(16) uint8_t shared[];
  __shared__ uint32_t entry_count;
  __shared__ int32_t pages_used, abort;
  const int32_t key_slices = channel_slices(keys.cache.layout, keys.quantization);
  const auto y = static_cast<int32_t>(blockIdx.y);
  if (y < key_slices) {
    __shared__ typename BlockAppender<kKeys, kBits>::Scan::TempStorage key_scan;
    BlockAppender<kKeys, kBits> appender(keys, shared, key_scan, entry_count, pages_used, abort);
    appender.run(static_cast<int32_t>(blockIdx.x), y, arrays);
  } else {
    __shared__ typename BlockAppender<kValues, kBits>::Scan::TempStorage value_scan;
    BlockAppender<kValues, kBits> appender(values, shared, value_scan, entry_count, pages_used, abort);
    appender.run(static_cast<int32_t>(blockIdx.x), y - key_slices, arrays);
  }
}

}  // namespace kvforge::kernels::append_device
