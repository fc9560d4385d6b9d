#pragma once
// The runtime KV cache of one model under one artifact configuration: it
// checks the configuration against the model's dimensions and the runtime's
// layouts (one-line std::invalid_argument naming the configuration and the
// field), owns the paged pools (docs/runtime-layout.md), the sequences' page
// tables and the page allocators for a batch of sequences of different
// lengths, and runs append and decode_attention through a kernel backend:
// the CPU reference now; the CUDA kernels plug into the same slot
// (KernelBackend: memory and the two kernels over decode_params.h's
// structs).
//
// Sequences are appended layer by layer, as a model's forward pass does: each
// layer keeps its own length per sequence, and a page is allocated when the
// first layer needs it (page ids are shared by every layer and both kinds).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "formats/quantizer_config.h"
#include "kernels/cpu_reference.h"
#include "kernels/decode_params.h"

namespace kvforge::kernels {

struct ModelDimensions {
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  // The model's RoPE inverse frequencies [head_dim / 2] (model/rope.h's
  // rope_inverse_frequencies): pre-RoPE keys are rotated with them.
  std::vector<float> rope_inverse_frequencies;
};

struct CacheOptions {
  int64_t page_size = 16;                    // tokens per page
  int64_t max_sequences = 8;                 // sequence slots
  int64_t max_context = 4096;                // tokens per sequence
  int64_t max_pages = 0;                     // pages of every pool; 0: max_sequences full sequences
  ElementType element = ElementType::kFloat16;  // exact tokens, outliers, group (min, max)
  int64_t outlier_page_entries = 256;        // entries per outlier page
  int64_t max_outlier_pages = 0;             // per layer and tensor kind; 0: from the nominal outlier share
  int64_t max_outlier_pages_per_sequence = 0;  // one sequence's outlier page table; 0: from the nominal share
  int64_t tokens_per_split = 256;            // decode_attention's context splits (0: one)
  float softmax_scale = 0;                   // 0: 1 / sqrt(head_dim)
  // append returns once its copies and kernels are queued, without waiting
  // for them (a serving loop's appends then overlap its host work and each
  // other): an outlier pool the append exhausts is reported by the cache's
  // next decode_attention, synchronize() or remove_sequence instead of by
  // the append itself. Off: append waits and reports its own exhaustion.
  bool asynchronous_append = false;
  // Which CUDA decode kernel takes the quantized tokens (DecodeParams::kernel):
  // kAuto the fastest that reads the layout (the 8-bit integer tensor-core
  // kernel at 2 and 4 bits, docs/runtime-layout.md 6.5; kvquant's layouts
  // the lookup kernel, 6.6); kBf16TensorCores, kLookup or kGeneral to
  // compare. The CPU reference ignores it.
  DecodeKernel decode_kernel = DecodeKernel::kAuto;
  // The int8 kernel's softmax steps (DecodeParams::int8_steps): kAuto the
  // 64-token steps with four stages where they read the layout, else 32
  // (default_int8_steps); kSteps32, kSteps64Stages3 or kSteps64Stages4 to
  // compare (64-token steps only for the layouts they read,
  // int8_wide_steps_supported; others are refused at decode). The CPU
  // reference ignores it.
  Int8Steps int8_steps = Int8Steps::kAuto;
  // Which CUDA append kernel (AppendParams::kernel): kAuto the token-parallel
  // one where the layout allows it; kPerSequence to compare.
  AppendKernel append_kernel = AppendKernel::kAuto;
  // decode_step with one new token per sequence goes to the backend as one
  // step (KernelBackend::decode_step: on CUDA the append inside the
  // decode's launch where the layout allows it); off: append, then
  // decode_attention, to compare. The same bytes and outputs either way.
  bool fused_decode_step = true;
  // DecodeParams::rotate_before_exact_blocks (CUDA; the CPU reference
  // ignores it): where the exact blocks are few (batch 1, 2 at some
  // layouts), with a matrix key rotation and a window or sink (int2-rot's),
  // the queries rotated first and the exact blocks
  // behind the int8 kernel in slots kept for them, so that a decoding
  // step's append joins the rotation's kernel. Off: the exact blocks first.
  bool rotate_before_exact_blocks = true;
};

enum class TensorKind { kKeys, kValues };

// Memory the kernels can address and the two kernels. A device backend
// allocates device memory and copies the host's small tables in before
// each call.
class KernelBackend {
 public:
  virtual ~KernelBackend() = default;
  // Zeroed bytes the kernels can address; null only for 0 bytes. release
  // waits for the kernels that may still use the memory.
  virtual void* allocate(int64_t bytes) = 0;
  // Never throws: it runs in destructors, also while an exception (a failed
  // kernel's) unwinds and at interpreter exit.
  virtual void release(void* memory) noexcept = 0;
  // Returns when the bytes have arrived (the host side may be a temporary).
  virtual void copy_in(void* backend_memory, const void* host, int64_t bytes) = 0;
  // Queues the copy before every later kernel and copy, without waiting; the
  // host bytes may change as soon as the call returns (a device backend
  // stages them). A synchronous backend copies at once (the default).
  virtual void enqueue_copy_in(void* backend_memory, const void* host, int64_t bytes) {
    copy_in(backend_memory, host, bytes);
  }
  // Returns when the bytes have arrived, so after every kernel and copy
  // issued before it.
  virtual void copy_out(void* host, const void* backend_memory, int64_t bytes) = 0;
  // Whether the host may read backend memory directly (else read_token
  // copies the pools out first).
  virtual bool host_addressable() const = 0;
  virtual void append(const AppendParams& params) = 0;
  virtual void decode_attention(const DecodeParams& params) = 0;
  // A decoding step: `step_append`, one new token for each entry of
  // `decode` in its order (decode's lengths count it), then `decode`: the
  // same results and refusals as the two calls (this default appends first;
  // CudaBackend refuses a bad decode before it appends). A device backend may run both in one launch (CudaBackend:
  // DecodePlanner::launch_step) and says so by returning true.
  virtual bool decode_step(const AppendParams& step_append, const DecodeParams& decode) {
    append(step_append);
    if (decode.batch.count > 0) decode_attention(decode);
    return false;
  }
  // Returns when every kernel and copy issued so far has finished (a
  // synchronous backend has nothing to wait for).
  virtual void synchronize() = 0;
};

// The CPU reference (cpu_reference.h) on host memory.
class CpuReferenceBackend final : public KernelBackend {
 public:
  void* allocate(int64_t bytes) override;
  void release(void* memory) noexcept override;
  void copy_in(void* backend_memory, const void* host, int64_t bytes) override;
  void copy_out(void* host, const void* backend_memory, int64_t bytes) override;
  bool host_addressable() const override { return true; }
  void append(const AppendParams& params) override { append_reference(params); }
  void decode_attention(const DecodeParams& params) override { decode_attention_reference(params); }
  void synchronize() override {}
};

// One layer's pools of one tensor kind copied to the host (tests, inspection):
// docs/runtime-layout.md's bytes as the backend holds them.
struct TensorPoolCopy {
  std::vector<uint8_t> pages;          // [max_pages][page_bytes]
  std::vector<uint8_t> exact;          // [max_sequences][exact_slot_bytes]
  std::vector<uint8_t> outlier_pages;  // [outlier pages][outlier_page_bytes] (empty without outliers)
  std::vector<int32_t> outlier_page_table;  // [max_sequences][stride]
  std::vector<uint32_t> entry_counts;       // [max_sequences]
  std::vector<int32_t> outlier_pages_used;  // [max_sequences]
};

// New tokens of some sequences for one layer.
struct AppendBatch {
  std::vector<int32_t> sequences;
  std::vector<int64_t> positions;  // each sequence's first new position: its length for the layer so far
  std::vector<int64_t> tokens;     // new tokens per sequence (0 allowed)
  // [sum of tokens][kv_heads][head_dim] of `input`, in sequence order; keys
  // before RoPE when the configuration's keys_pre_rope, else after.
  const void* keys = nullptr;
  const void* values = nullptr;
  // Whether keys and values already lie in the backend's memory (device
  // pointers for CudaBackend, host pointers for the CPU reference): they are
  // passed to the kernel as they are, without a staging copy.
  bool backend_memory = false;
  // The element type of keys and values (both); each value is rounded once
  // to the cache's element type (an input already in it is stored as it is).
  ElementType input = ElementType::kFloat32;
};

class QuantizedKVCache {
 public:
  QuantizedKVCache(const QuantizerConfig& config, ModelDimensions model, CacheOptions options = {},
                   std::unique_ptr<KernelBackend> backend = nullptr);  // null: the CPU reference
  ~QuantizedKVCache();
  QuantizedKVCache(const QuantizedKVCache&) = delete;
  QuantizedKVCache& operator=(const QuantizedKVCache&) = delete;

  // A free sequence slot, empty (std::length_error when all are in use).
  int32_t add_sequence();
  // Frees the sequence's pages and outlier pages (after reporting an outlier
  // pool exhausted by an asynchronous append).
  void remove_sequence(int32_t sequence);
  int64_t length(int32_t sequence, int64_t layer) const;

  // Quantize-on-append of one layer's new tokens; std::invalid_argument for a
  // position that is not the sequence's length, std::length_error when a
  // sequence would exceed max_context or a pool is exhausted. The caller may
  // reuse host keys and values at once; keys and values in backend memory
  // are read by the queued kernel (asynchronous_append: order later writes
  // to them after synchronize(), or on the backend's stream). Returns after
  // the kernel, or with asynchronous_append once it is queued (an exhausted
  // outlier pool is then reported by the next decode_attention,
  // synchronize() or remove_sequence).
  void append(int64_t layer, const AppendBatch& batch);
  // The CUDA append kernel of later appends (CacheOptions::append_kernel):
  // both kernels store the same bytes, so a cache may switch between them
  // (a benchmark's baseline in the same run).
  void set_append_kernel(AppendKernel kernel) { options_.append_kernel = kernel; }
  // Waits for every queued copy and kernel, then reports an outlier pool
  // exhausted by an asynchronous append (std::length_error).
  void synchronize();

  // One query per sequence at its last position: queries and output
  // [sequences][num_heads][head_dim] of `io`, post-RoPE queries, outputs in
  // the model's basis (attention in float32, each output rounded once to
  // `io`). `tally` (optional) records the bytes read.
  // `backend_memory`: queries and output already lie in the backend's memory
  // (as AppendBatch::backend_memory) and are read and written in place; the
  // output is complete when the call returns. An empty batch does nothing.
  void decode_attention(int64_t layer, std::span<const int32_t> sequences, const void* queries, void* output,
                        ReadTally* tally = nullptr, bool backend_memory = false,
                        ElementType io = ElementType::kFloat32);

  // One decoding step of `layer`: append(layer, batch), then
  // decode_attention over batch.sequences (one query each, at its new last
  // position), with the same results and the same refusals (checked before
  // anything runs); the decode is queued right behind the append (a
  // synchronous append's exhaustion flags are read after it: an exhausted
  // outlier pool throws after the decode ran, its output then undefined).
  // With asynchronous_append and `backend_memory` the call
  // returns once both are queued, as such an append does: the output is
  // complete for work queued after it on the backend's stream and after
  // synchronize() (a serving loop queueing its layers ahead of the device).
  // With one new token per sequence (and CacheOptions::fused_decode_step)
  // the backend takes both as one step (KernelBackend::decode_step).
  void decode_step(int64_t layer, const AppendBatch& batch, const void* queries, void* output,
                   bool backend_memory = false, ElementType io = ElementType::kFloat32);
  // CacheOptions::fused_decode_step for later steps (a benchmark's baseline
  // in the same run).
  void set_fused_decode_step(bool fused) { options_.fused_decode_step = fused; }
  // CacheOptions::rotate_before_exact_blocks for later calls (likewise).
  void set_rotate_before_exact_blocks(bool rotate) { options_.rotate_before_exact_blocks = rotate; }

  // The DecodeParams decode_attention passes its backend for `layer`, in
  // backend memory, except the call's own arrays: batch.count, batch.slots,
  // batch.lengths (length(sequence, layer) of each) or inline_arrays,
  // queries and output are the caller's (read_tally null). decode_attention
  // itself carries a batch of at most kInlineBatchEntries sequences in
  // inline_arrays (nothing copied to the device for them).
  DecodeParams decode_params(int64_t layer) const;

  const TensorPageLayout& layout(TensorKind kind) const;
  const std::string& name() const { return name_; }
  // Token `token` of the sequence as attention reads it at the layer's
  // current length, in the stored basis. A device backend's pools and
  // constants are copied to the host first (slow: for tests and inspection).
  TokenReadout read_token(int64_t layer, TensorKind kind, int32_t sequence, int64_t token) const;
  // The layer's pools of `kind`, copied out through the backend.
  TensorPoolCopy copy_pools(int64_t layer, TensorKind kind) const;
  // Outlier entries stored for the sequence's layer and kind (window tokens
  // included: they are quantized on arrival).
  int64_t outlier_entries(int64_t layer, TensorKind kind, int32_t sequence) const;
  int64_t pages_held(int32_t sequence) const;
  // What the sequence holds for the layer and kind, counted from the
  // allocators' state (runtime_layout.h's bytes_held() is the formula).
  TensorBytes held_bytes(int64_t layer, TensorKind kind, int32_t sequence) const;
  int64_t free_pages() const { return static_cast<int64_t>(free_pages_.size()); }
  // The host's page table [max_sequences][page_table_stride] (-1 where no
  // page is allocated) and the copy the kernels read, copied out through the
  // backend: equal whenever no call is running.
  std::span<const int32_t> page_table() const { return page_table_; }
  std::vector<int32_t> copy_page_table() const;

 private:
  struct Buffer;
  struct CallScratch;
  struct TensorState;
  struct LayerState;
  struct EntryRange {
    int64_t begin = 0, end = 0;  // page table entries [begin, end)
  };
  // An asynchronous append whose exhaustion flags are not yet read.
  struct PendingAppend {
    int64_t layer = 0;
    std::vector<int32_t> sequences;
  };

  // A decode call's params with its arrays and queries queued (the output
  // staged where it is not in backend memory); count 0 for an empty batch.
  struct StagedDecode {
    DecodeParams params;
    int64_t io_bytes = 0;
    bool backend_memory = false;
  };

  // append's parts, which decode_step runs around the decode's: the checks,
  // new pages and uploads; the kernel; the lengths and exhaustion flags.
  AppendParams stage_append(int64_t layer, const AppendBatch& batch);
  // `step_decode`: the backend's decode_step with that decode instead of
  // its append alone.
  void launch_staged_append(int64_t layer, const AppendBatch& batch, const AppendParams& params,
                            const DecodeParams* step_decode = nullptr);
  void finish_append(int64_t layer, const AppendBatch& batch);
  // decode_attention's: the checks and uploads (lengths plus `appended`
  // tokens each where given: a decode_step's), then, after the kernels, the
  // output's copy or the sync.
  StagedDecode stage_decode(int64_t layer, std::span<const int32_t> sequences, std::span<const int64_t> appended,
                            const void* queries, void* output, bool backend_memory, ElementType io);
  void finish_decode(const StagedDecode& staged, void* output);
  TensorState& tensor(int64_t layer, TensorKind kind);
  const TensorState& tensor(int64_t layer, TensorKind kind) const;
  void check_sequence(int32_t sequence, const char* what) const;
  // The sequence's pages for `tokens` tokens, new ones recorded as page-table
  // changes to upload; returns how many it took.
  int64_t ensure_pages(int32_t sequence, int64_t tokens);
  // Throws std::length_error naming the append of `layer` to `sequences`
  // whose outlier allocators set `flags` (keys, values; the caller has
  // cleared the backend's); `late`: it was queued by an earlier call.
  [[noreturn]] void throw_exhaustion(int64_t layer, std::span<const int32_t> sequences, const int32_t* flags,
                                     bool late) const;
  // Reads every layer's flags once (a sync) for the pending asynchronous
  // appends and reports the first exhausted one.
  void check_pending_appends();
  // Queues the copies of the page table entries changed since the last
  // upload (enqueue_copy_in: the host table may change once they are queued).
  void upload_page_table_changes();

  std::string name_;
  ModelDimensions model_;
  CacheOptions options_;
  bool keys_pre_rope_ = false;
  std::unique_ptr<KernelBackend> backend_;
  int64_t page_table_stride_ = 0;
  std::vector<int32_t> page_table_;  // host: [max_sequences][stride], -1 where unallocated
  std::vector<int64_t> pages_of_;    // pages each slot holds
  std::vector<int32_t> free_pages_;  // host page allocator (a stack)
  std::vector<uint8_t> in_use_;
  std::vector<std::vector<int64_t>> lengths_;  // [slot][layer]
  std::vector<EntryRange> page_table_changes_;  // entries not yet uploaded
  std::unique_ptr<Buffer> device_page_table_;
  std::unique_ptr<Buffer> rope_frequencies_;  // the model's, in backend memory
  std::unique_ptr<Buffer> exhausted_flags_;   // [layer][keys, values]: the outlier allocators' flags
  std::unique_ptr<CallScratch> scratch_;      // the calls' arrays and staged rows, reused across calls
  std::vector<PendingAppend> pending_appends_;  // asynchronous appends not yet checked
  std::vector<LayerState> layers_;
};

}  // namespace kvforge::kernels
