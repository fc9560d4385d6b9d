// kvforge_bench_decode_attention: the runtime kernels' decode attention at
// Llama-3-8B's attention shapes (32 query heads on 8 KV heads of 128), one
// layer, against bf16 SDPA on the same context in the same run, and the
// bytes it must read against the device's measured copy bandwidth (issue 10):
//   for each method and bits (int2-rot with its per-head key and value
//   rotations, as `kvforge rotate` writes them; random orthogonal matrices
//   here), batch and context: fill a QuantizedKVCache
//   (CudaBackend) with random tokens through the append kernel, then time
//   launch_decode_attention (planned once: DecodeParams built, slots and
//   lengths in the launch at batch 32 and below, else uploaded) and one decode-step append (one token per sequence,
//   asynchronous_append): append_time_us per step of a run queued back to
//   back (throughput; 16 steps, or whole per_channel_tokens groups:
//   append_run_steps), append_latency_us of one step and its synchronize();
//   SDPA: at::scaled_dot_product_attention on contiguous bf16 K/V.
// Times are CUDA-event medians of --repeats launches after warm-up, each
// queued behind a busy kernel so that the events time the device side
// (the host side is measured on its own) and, unless --warm-l2, behind a
// read of 4x the L2's size (bench/l2_flush.h), so that each repeat finds
// none of its bytes in L2, as a layer's decode in a server does (l2_cold;
// the decode and SDPA also warm, as the grids before 2026-12-05 timed
// them: warm_l2_time_us, sdpa_warm_l2_time_us); the report's empty_kernel_us and
// empty_dependent_pair_us are the same timer's floor (bench/launch_floor.h;
// empty_dependent_pair_decode_params_us the pair with the decode's parameter block),
// and a row's read_floor_us the time one plain kernel takes to read the
// row's bytes_read under it (floor_speedup_vs_sdpa: the most any one launch
// could gain on SDPA there).
// FlashInfer
// columns come from bench/decode_baselines.py's JSON (--baselines), measured
// in the same gpu_checks call. Writes rows with context, batch, method, bits,
// time_us (the decode as the cache launches it: at batch 32 and below its
// slots and lengths in the launch, inline_arrays; device_arrays_time_us the
// same decode reading them uploaded), sdpa_time_us, speedup_vs_sdpa, bytes_read, bandwidth_fraction,
// append_time_us, append_over_decode_rate and the FlashInfer times, and the
// append step's host and device sides (append_host_us, append_device_us),
// the same four of the block-per-sequence append kernel as the baseline
// (append_per_sequence_time_us, _latency_us, _host_us, _device_us; equal to
// the first where the layout has no token-parallel kernel),
// and the decode launch's host side with and without a DecodePlanner's
// cached device facts (decode_host_us, decode_host_us_replanning), and the
// same decode replayed from a CUDA graph (graph_time_us, graph_host_us; or
// graph_error where the runtime refused the capture);
// `kernel` names the default kernel that ran (int8_tensor_cores,
// tensor_cores, lookup, general) and `splits`, `exact_splits`, `exact_first`, `exact_slots_reserved`,
// `exact_kernel`, `rotate_queries_first`, `rotation_step_in_one_wave`, `wide_merge`, `merge_heads`
// and `cluster_merge` its plan (kernels::DecodePlan), `int8_steps` the int8
// kernel's steps (32 or 64 tokens); with --exact-blocks-first, where the
// queries are rotated first and the few exact blocks run behind the int8
// kernel in their kept slots (the default beside a matrix key rotation),
// the same decode with the exact blocks first, each block rotating its own
// queries (DecodeParams::rotate_before_exact_blocks off:
// exact_blocks_first_time_us, _splits, _speedup_vs_sdpa; and its decoding
// steps, whose appends then run on their own:
// exact_blocks_first_step_device_us, _step_fused,
// _step_two_launches_device_us, _step_decode_device_us, each round of steps
// timed right after the default's); a whole decoding step
// (QuantizedKVCache::decode_step, fused where the layout allows:
// step_device_us, step_fused; as two launches: step_two_launches_device_us)
// against the decode alone at the same lengths (step_decode_device_us, at
// step_decode_tokens: the steps run past `tokens`), their difference the
// append's share (append_in_step_us, append_in_two_launch_step_us) and the
// decode's rate over it (append_in_step_over_decode_rate, ..._two_launch_...;
// none where the step took no longer); with --bf16-tensor-cores also the bf16 tensor-core
// kernel's time where the int8 kernel is the default (bf16_tc_time_us,
// bf16_tc_splits, bf16_tc_speedup_vs_sdpa), the int8 kernel's predecessor;
// with --general also the general kernel's where the lookup kernel is the
// default (general_time_us, general_splits, general_speedup_vs_sdpa);
// with --int8-other-steps, where the int8 kernel's 64-token steps read the
// layout (kernels::Int8Steps), the time of its step choices other than the
// default's in the same run: 32-token steps (steps32_time_us, _splits,
// _speedup_vs_sdpa) and 64-token steps with three stages a warp
// (steps64_stages3_*; the default takes four); with --tokens-per-split T,...,
// where a tensor-core kernel runs, the default plan with T tokens a split
// instead of its own (split_T_time_us, split_T_splits): the planner's split
// choice against its neighbours in the same run; with --exact-chunks T,...,
// where exact blocks run beside a tensor-core kernel, the default with T
// tokens an exact block (exact_chunk_T_time_us, exact_chunk_T_splits: the
// exact blocks per sequence and KV head, exact_chunk_T_speedup_vs_sdpa).
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench/busy_wait.h"
#include "bench/decode_bench_config.h"
#include "bench/l2_flush.h"
#include "bench/launch_floor.h"
#include "kernels/cuda_backend.h"
#include "kernels/cuda_graph.h"
#include "kernels/cuda_runtime_check.h"
#include "kernels/cuda_stream.h"
#include "kernels/decode_attention_launch.h"
#include "kernels/quantized_kv_cache.h"

namespace kvforge {
namespace {

constexpr int64_t kHeads = kDecodeBenchHeads, kKvHeads = kDecodeBenchKvHeads, kHeadDim = kDecodeBenchHeadDim;

// The plan rotates the queries before the few exact blocks, which run
// behind the int8 kernel in their kept slots (what --exact-blocks-first
// compares against the exact blocks first).
bool rotation_before_exact_blocks(const kernels::DecodePlan& plan, const kernels::DecodeParams& params) {
  return plan.exact_slots_reserved && !plan.exact_first && params.key_rotation.kind == kernels::RotationKind::kMatrix;
}

// The middle element (the upper one of an even count).
double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

// Median microseconds of `work` on the current device (CUDA events around
// it on the default stream). Each repeat is queued behind a busy kernel, so
// that the events time the device side of the work back to back: without
// it a launch whose host side (planning, enqueueing) outlasts its kernels,
// as at batch 1, would be timed at the host's pace. The host side is
// measured on its own (decode_host_us). With `flush`, each repeat starts
// from a cold L2 (bench/l2_flush.h: the flush runs before the busy kernel,
// outside the events).
double median_us(const std::function<void()>& work, int repeats, cudaStream_t stream = nullptr,
                 const L2Flush* flush = nullptr) {
  for (int i = 0; i < 3; ++i) work();
  KVFORGE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> times;
  cudaEvent_t start, stop;
  KVFORGE_CUDA_CHECK(cudaEventCreate(&start));
  KVFORGE_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < repeats; ++i) {
    if (flush != nullptr) flush->run(stream);
    busy_wait_on(stream, 300'000);  // 300 us: longer than any enqueue here
    KVFORGE_CUDA_CHECK(cudaEventRecord(start, stream));
    work();
    KVFORGE_CUDA_CHECK(cudaEventRecord(stop, stream));
    KVFORGE_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    KVFORGE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms * 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(std::move(times));
}

// The planned decode replayed from a CUDA graph (kernels::CapturedGraph,
// a server's decoding step): the replay's device time (median_us on the
// capture's stream) and cudaGraphLaunch's host side, as columns; a capture
// or replay the runtime refuses is reported (graph_error) and the other
// columns kept.
nlohmann::json graph_replay_columns(const kernels::DecodeParams& params, int repeats, const L2Flush* flush) {
  try {
    const kernels::CudaStream stream;
    kernels::DecodePlanner planner;
    planner.plan(params);  // the device's facts asked before the capture, as a server's planner has them
    const kernels::CapturedGraph graph = kernels::CapturedGraph::capture(
        stream.get(), [&](cudaStream_t capturing) { planner.launch(params, capturing); });
    const double time_us = median_us([&] { graph.launch(stream.get()); }, repeats, stream.get(), flush);
    std::vector<double> host_us;
    for (int i = 0; i < repeats; ++i) {
      busy_wait_on(stream.get(), 2'000'000);
      const auto begin = std::chrono::steady_clock::now();
      graph.launch(stream.get());
      host_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - begin).count());
      KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    }
    return {{"graph_time_us", time_us}, {"graph_host_us", median(std::move(host_us))}};
  } catch (const std::exception& e) {
    cudaDeviceSynchronize();  // the refused work drained, its error (not a sticky one) cleared below
    cudaGetLastError();
    return {{"graph_error", e.what()}};
  }
}

// A comma-separated list option of positive multiples of `multiple`,
// refused at parsing (before any GPU work) otherwise.
void add_multiples_option(CLI::App& app, const std::string& name, std::vector<int64_t>& values, int64_t multiple,
                          const std::string& description) {
  const CLI::Validator multiples(
      [multiple](std::string& text) {
        int64_t value = 0;
        if (!CLI::detail::lexical_cast(text, value) || value <= 0 || value % multiple != 0) {
          return text + ": expected a positive multiple of " + std::to_string(multiple);
        }
        return std::string();
      },
      "multiple of " + std::to_string(multiple));
  app.add_option(name, values, description)->delimiter(',')->check(multiples);
}

// Median wall-clock microseconds of `work` (host calls that end in a sync):
// what a serving loop waits.
double median_wall_us(const std::function<void()>& work, int repeats) {
  for (int i = 0; i < 2; ++i) work();
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    work();
    times.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
  }
  return median(std::move(times));
}

// Decoding steps whose appends the throughput measurement queues back to
// back, at least.
constexpr int kAppendRun = 16;

// The steps of one queued run: kAppendRun rounded up to a multiple of every
// per_channel_tokens group (KIVI's keys: G = 32), so that each run completes
// the same number of groups and its mean is the steady rate. With runs of 16
// and G = 32, every other run held a group's completion and the median of
// three picked either side (the grids before 2026-12-06: kivi's
// append_device_us ~25 us at every batch).
int append_run_steps(const QuantizerConfig& config) {
  int64_t groups = 1;
  for (const TensorQuantizerSettings* t : {&config.settings.keys, &config.settings.values}) {
    if (t->grouping == Grouping::kPerChannelTokens && t->group > 1) groups = std::lcm(groups, t->group);
  }
  return static_cast<int>((kAppendRun + groups - 1) / groups * groups);
}
// Distinct tokens the decode-step appends cycle through by default: more
// than a decode kernel's step of 32 tokens, so that no step holds one token
// twice.
constexpr int64_t kDefaultStepTokens = 64;

struct Row {
  nlohmann::json json;
};

// Appends random tokens until every sequence holds `context` tokens.
void fill(kernels::QuantizedKVCache& cache, const std::vector<int32_t>& sequences, int64_t context) {
  const int64_t chunk = 4096;
  while (cache.length(sequences.front(), 0) < context) {
    const int64_t have = cache.length(sequences.front(), 0), tokens = std::min(chunk, context - have);
    const int64_t rows = tokens * static_cast<int64_t>(sequences.size());
    const at::Tensor keys = at::randn({rows, kKvHeads, kHeadDim}, at::TensorOptions().device(at::kCUDA));
    const at::Tensor values = at::randn({rows, kKvHeads, kHeadDim}, at::TensorOptions().device(at::kCUDA));
    kernels::AppendBatch batch;
    batch.sequences = sequences;
    for (const int32_t s : sequences) {
      batch.positions.push_back(cache.length(s, 0));
      batch.tokens.push_back(tokens);
    }
    batch.keys = keys.data_ptr<float>();
    batch.values = values.data_ptr<float>();
    batch.backend_memory = true;
    KVFORGE_CUDA_CHECK(cudaDeviceSynchronize());
    cache.append(0, batch);
  }
}

int run(int argc, char** argv) {
  CLI::App app{"Decode attention of the runtime kernels against bf16 SDPA (Llama-3-8B attention shapes)"};
  std::vector<int64_t> contexts = {4096, 8192, 16384, 32768, 65536, 131072};
  std::vector<int64_t> batches = {1, 8, 32};
  std::vector<std::string> methods = {"int2-rot", "rtn", "kivi", "kvquant"};
  std::vector<int> bits = {2, 4};
  int repeats = 20;
  std::string out, baselines, commit, command;
  app.add_option("--contexts", contexts)->delimiter(',');
  app.add_option("--batches", batches)->delimiter(',');
  app.add_option("--methods", methods)->delimiter(',');
  app.add_option("--bits", bits)->delimiter(',');
  app.add_option("--repeats", repeats);
  bool bf16_tensor_cores = false;
  app.add_flag("--bf16-tensor-cores", bf16_tensor_cores,
               "also time the bf16 tensor-core kernel where the int8 one is the default (bf16_tc_* columns)");
  bool general = false;
  app.add_flag("--general", general,
               "also time the general kernel where the lookup kernel is the default (general_* columns), the "
               "lookup kernel's predecessor on kvquant's layouts");
  bool exact_blocks_first = false;
  app.add_flag("--exact-blocks-first", exact_blocks_first,
               "where the queries are rotated first and the few exact blocks run behind the int8 kernel in their "
               "kept slots (batch 1, 2 at some layouts; a matrix key rotation), also time the exact blocks first "
               "(DecodeParams::rotate_before_exact_blocks off): exact_blocks_first_time_us, and with the appends "
               "exact_blocks_first_step_device_us, _step_fused, _step_two_launches_device_us, "
               "_step_decode_device_us");
  bool int8_other_steps = false;
  app.add_flag("--int8-other-steps", int8_other_steps,
               "where the int8 kernel's 64-token steps read the layout, also time its step choices other than the "
               "default's (steps32_*, steps64_stages3_*, steps64_stages4_* columns)");
  int64_t step_tokens = kDefaultStepTokens;
  app.add_option("--step-tokens", step_tokens,
                 "distinct random tokens the decode-step appends cycle through (1: one token appended at every step)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bool no_append = false;
  app.add_flag("--no-append", no_append,
               "leave the decode-step append's measurements out (no append_* columns): the cache then holds only "
               "the fill's chunks of 4096 tokens, never tokens appended one decoding step at a time");
  std::vector<int64_t> forced_splits, exact_chunks;
  add_multiples_option(app, "--tokens-per-split", forced_splits, 256,
                       "where a tensor-core kernel runs, also time the default plan with each of these tokens a split "
                       "(split_T_time_us, split_T_splits columns)");
  add_multiples_option(app, "--exact-chunks", exact_chunks, 64,
                       "where exact blocks run beside a tensor-core kernel, also time the default with each of these "
                       "tokens an exact block (exact_chunk_T_time_us, exact_chunk_T_splits columns)");
  bool warm_l2 = false;
  app.add_flag("--warm-l2", warm_l2,
               "time every repeat after the one before it with whatever L2 holds (the grids before 2026-12-05); by "
               "default each timed repeat starts from a cold L2, as a layer's decode does in a server, and the "
               "decode and SDPA are also timed warm (warm_l2_time_us, sdpa_warm_l2_time_us)");
  app.add_option("--out", out, "JSON report")->required();
  app.add_option("--baselines", baselines, "bench/decode_baselines.py's JSON of the same run (FlashInfer columns)");
  app.add_option("--commit", commit);
  app.add_option("--command", command);
  CLI11_PARSE(app, argc, argv);
  // The benchmark's own command line, next to the caller's (--command): the
  // report says which contexts, batches, methods and bits it ran.
  const std::vector<std::string> arguments(argv, argv + argc);
  if (kernels::cuda_device_count() == 0) {
    std::cerr << "kvforge_bench_decode_attention: no CUDA device\n";
    return 2;
  }
  std::sort(contexts.begin(), contexts.end());
  std::map<std::pair<int64_t, int64_t>, nlohmann::json> flashinfer;
  if (!baselines.empty()) {
    std::ifstream in(baselines);
    // Named: a range-for over a member of the temporary parse() returns
    // dangles (the temporary dies first before C++23), which left every
    // FlashInfer column out of the 2026-12-01 runs.
    const nlohmann::json report = nlohmann::json::parse(in);
    for (const nlohmann::json& row : report.at("rows")) {
      flashinfer[{row.at("context").get<int64_t>(), row.at("batch").get<int64_t>()}] = row;
    }
    std::cerr << "baselines: " << flashinfer.size() << " rows from " << baselines << "\n";
  }
  const L2Flush l2_flush(0);
  const L2Flush* const cold = warm_l2 ? nullptr : &l2_flush;
  ReadFloor read_floor;  // grown to each row's bytes_read
  // Device copy bandwidth: bytes read plus written per second.
  double copy_bandwidth = 0;
  {
    const int64_t n = int64_t{4} << 30;
    at::Tensor src = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
    at::Tensor dst = at::empty_like(src);
    copy_bandwidth = 2.0 * static_cast<double>(n) / (median_us([&] { dst.copy_(src); }, repeats) * 1e-6);
  }
  // The launch floor under the same timer: what a decode call pays before
  // it reads a byte (batch 1's fixed cost, bench/README.md).
  const double empty_kernel_us = median_us([] { launch_empty_kernel(nullptr); }, repeats);
  const double empty_dependent_pair_us = median_us([] { launch_empty_dependent_pair(nullptr); }, repeats);
  const double empty_dependent_pair_decode_params_us =
      median_us([] { launch_empty_dependent_pair_with_decode_params(nullptr); }, repeats);
  const kernels::ModelDimensions dims = decode_bench_dimensions();
  nlohmann::json rows = nlohmann::json::array();
  for (const int64_t batch : batches) {
    // SDPA per context, once per batch, after a quarter second of SDPA at
    // the first context: measured cold (the device's clocks still rising
    // after the host-side set-up), batch 1's times were up to 1.6x their
    // steady value (H200, 2026-12-01).
    std::map<int64_t, double> sdpa, sdpa_warm;
    for (const int64_t context : contexts) {
      const auto options = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
      const at::Tensor q = at::randn({batch, kHeads, 1, kHeadDim}, options);
      const at::Tensor k = at::randn({batch, kKvHeads, context, kHeadDim}, options);
      const at::Tensor v = at::randn({batch, kKvHeads, context, kHeadDim}, options);
      const auto step = [&] { at::scaled_dot_product_attention(q, k, v, {}, 0.0, false, std::nullopt, true); };
      if (context == contexts.front()) {
        const auto begin = std::chrono::steady_clock::now();
        while (std::chrono::steady_clock::now() - begin < std::chrono::milliseconds(250)) {
          for (int i = 0; i < 20; ++i) step();
          KVFORGE_CUDA_CHECK(cudaDeviceSynchronize());
        }
      }
      sdpa[context] = median_us(step, repeats, nullptr, cold);
      if (cold != nullptr) sdpa_warm[context] = median_us(step, repeats);
    }
    for (const std::string& method : methods) {
      for (const int b : bits) {
        const QuantizerConfig config = decode_bench_config(method, b);
        const int append_repeats = std::max(3, repeats / 4);
        const int append_run = append_run_steps(config);
        kernels::CacheOptions options;
        options.max_sequences = batch;
        // The append and step measurements add tokens: the appends
        // 2 x (append_repeats + 2 x append_repeats x append_run) (two
        // kernels), the steps 6 queued runs of (2 + append_repeats) x
        // append_run a setting, the exact blocks first a second setting.
        const int64_t step_settings = exact_blocks_first ? 2 : 1;
        options.max_context = contexts.back() + 2048 +
                              2 * (append_repeats + 2 * append_repeats * append_run) +
                              step_settings * 6 * (2 + append_repeats) * append_run;
        options.asynchronous_append = true;           // a serving loop's appends; decode syncs
        options.element = kernels::ElementType::kBFloat16;
        auto owned_backend = std::make_unique<kernels::CudaBackend>(0);
        const kernels::CudaBackend& backend = *owned_backend;
        const cudaStream_t append_stream = owned_backend->stream();
        kernels::QuantizedKVCache cache(config, dims, options, std::move(owned_backend));
        std::vector<int32_t> sequences;
        for (int64_t i = 0; i < batch; ++i) sequences.push_back(cache.add_sequence());
        int32_t* slots = nullptr;
        int64_t* lengths = nullptr;
        KVFORGE_CUDA_CHECK(cudaMalloc(&slots, batch * sizeof(int32_t)));
        KVFORGE_CUDA_CHECK(cudaMalloc(&lengths, batch * sizeof(int64_t)));
        // The steps' decode alone reads its own lengths (the cache's as they
        // stand then), so that `lengths` stays the context's for the columns
        // timed after the steps.
        int64_t* step_lengths = nullptr;
        KVFORGE_CUDA_CHECK(cudaMalloc(&step_lengths, batch * sizeof(int64_t)));
        KVFORGE_CUDA_CHECK(cudaMemcpy(slots, sequences.data(), batch * sizeof(int32_t), cudaMemcpyHostToDevice));
        const auto io = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
        const at::Tensor queries = at::randn({batch, kHeads, kHeadDim}, io);
        at::Tensor output = at::empty_like(queries);
        for (const int64_t context : contexts) {
          fill(cache, sequences, context);
          cache.synchronize();  // the appends are asynchronous; the decode below runs on another stream
          // Every sequence holds the same tokens: the context, plus the few
          // decode-step appends timed at the smaller contexts.
          const int64_t tokens = cache.length(sequences.front(), 0);
          const std::vector<int64_t> host_lengths(static_cast<size_t>(batch), tokens);
          KVFORGE_CUDA_CHECK(cudaMemcpy(lengths, host_lengths.data(), batch * sizeof(int64_t), cudaMemcpyHostToDevice));
          kernels::DecodeParams params = cache.decode_params(0);
          params.batch.count = static_cast<int32_t>(batch);
          params.batch.slots = slots;
          params.batch.lengths = lengths;
          params.queries = queries.data_ptr();
          params.output = output.data_ptr();
          params.io = kernels::ElementType::kBFloat16;
          params.batch.max_length = tokens;
          // Planned once, as a serving loop would: the workspace outlives the steps.
          const int64_t workspace_bytes = kernels::decode_workspace_bytes(params);
          const at::Tensor workspace =
              at::empty({workspace_bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
          params.workspace = workspace.data_ptr();
          params.workspace_bytes = workspace_bytes;
          int multiprocessors = 0;
          KVFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0));
          const kernels::DecodePlan plan = kernels::plan_decode_attention(params, multiprocessors);
          // The decode as QuantizedKVCache::decode_attention launches it: a
          // batch of at most kInlineBatchEntries sequences carries its slots
          // and lengths in the launch (InlineDecodeArrays: the kernels'
          // first loads are then the page table's), a larger one reads them
          // uploaded (`params`). Every decode column below times `launched`
          // but device_arrays_time_us (`params`, where they differ) and the
          // graph replay (a capture freezes inline arrays: a server's graph
          // takes the uploaded ones).
          kernels::DecodeParams launched = params;
          const bool inline_arrays = batch <= kernels::kInlineBatchEntries;
          if (inline_arrays) {
            launched.inline_arrays.count = static_cast<int32_t>(batch);
            std::copy(sequences.begin(), sequences.end(), launched.inline_arrays.slots);
            std::copy(host_lengths.begin(), host_lengths.end(), launched.inline_arrays.lengths);
            launched.batch.slots = nullptr;
            launched.batch.lengths = nullptr;
          }
          const auto decode = [&] { kernels::launch_decode_attention(launched, nullptr); };
          const double time_us = median_us(decode, repeats, nullptr, cold);
          const double device_arrays_time_us =
              inline_arrays ? median_us([&] { kernels::launch_decode_attention(params, nullptr); }, repeats, nullptr, cold)
                            : time_us;
          // The same with the L2 as the repeat before left it (what the
          // grids before 2026-12-05 timed), beside the cold time.
          const double warm_l2_time_us = cold == nullptr ? time_us : median_us(decode, repeats);
          // The decode launch's host side (the enqueue's wall clock, queued
          // behind a busy kernel so that it never waits for the device):
          // through a DecodePlanner that asked the device once (a server's
          // path: decode_host_us) and through launch_decode_attention, which
          // asks again on every call (decode_host_us_replanning).
          std::vector<double> planned_host_us, replanning_host_us;
          {
            kernels::DecodePlanner planner;
            planner.launch(launched, nullptr);  // its occupancy queries, once
            for (int i = 0; i < repeats; ++i) {
              busy_wait_on(nullptr, 2'000'000);
              auto begin = std::chrono::steady_clock::now();
              planner.launch(launched, nullptr);
              planned_host_us.push_back(
                  std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - begin).count());
              begin = std::chrono::steady_clock::now();
              kernels::launch_decode_attention(launched, nullptr);
              replanning_host_us.push_back(
                  std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - begin).count());
              KVFORGE_CUDA_CHECK(cudaDeviceSynchronize());
            }
          }
          int64_t bytes = 0;
          for (const int32_t s : sequences) {
            int64_t shared_page_table = std::numeric_limits<int64_t>::max();
            for (const kernels::TensorKind kind : {kernels::TensorKind::kKeys, kernels::TensorKind::kValues}) {
              const kernels::TensorBytes b =
                  kernels::bytes_read(cache.layout(kind), tokens, cache.outlier_entries(0, kind, s));
              bytes += b.total();
              shared_page_table = std::min(shared_page_table, b.page_table);
            }
            // Keys and values read one page table (docs/runtime-layout.md 7):
            // the entries of the longer quantized range.
            bytes -= shared_page_table;
          }
          bytes += static_cast<int64_t>(batch) * kHeads * kHeadDim * 2 * 2;  // queries in, output out (bf16)
          // The same bytes read by one plain kernel under the same timer:
          // the least time any one launch could take for this call.
          read_floor.reserve(bytes);
          const double read_floor_us = median_us([&] { read_floor.run(bytes, nullptr); }, repeats, nullptr, cold);
          // One decoding step's append: a token for every sequence, each
          // step the next of step_tokens distinct ones (a serving loop's
          // tokens differ; one token appended again and again, as
          // --step-tokens 1 does, puts its outliers on the same channels of
          // every later step's tokens, which the decode of the larger
          // contexts reads: the worst case of colliding corrections).
          const at::Tensor step_keys =
              at::randn({step_tokens, batch, kKvHeads, kHeadDim}, at::TensorOptions().device(at::kCUDA));
          const at::Tensor step_values = at::randn_like(step_keys);
          KVFORGE_CUDA_CHECK(cudaDeviceSynchronize());  // made on torch's stream, read on the cache's
          kernels::AppendBatch step;
          step.sequences = sequences;
          for (const int32_t s : sequences) {
            step.positions.push_back(cache.length(s, 0));
            step.tokens.push_back(1);
          }
          step.backend_memory = true;
          int64_t step_index = 0;
          // One decoding step's append (a token for every sequence): its
          // latency (the append, then synchronize()) and its throughput
          // (append_run steps queued back to back, then one synchronize(),
          // per step), wall clock: the rate the decode must be kept up with
          // is the throughput's.
          const auto one_step = [&] {
            for (size_t i = 0; i < sequences.size(); ++i) step.positions[i] = cache.length(sequences[i], 0);
            const int64_t offset = (step_index++ % step_tokens) * batch * kKvHeads * kHeadDim;
            step.keys = step_keys.data_ptr<float>() + offset;
            step.values = step_values.data_ptr<float>() + offset;
            cache.append(0, step);
          };
          // The append kernel's measurements (the same as the step's kernel
          // choice's: the token-parallel kernel where the layout allows it,
          // then the block-per-sequence kernel as the baseline of the same run).
          struct AppendTimes {
            double latency_us = 0, time_us = 0, host_us = 0, device_us = 0;
          };
          // append_run calls of `one` queued behind a busy kernel on the
          // cache's stream, append_repeats times (after `warm_up` unrecorded
          // runs): a call's host side (the enqueue's wall clock) and its
          // device side (events around the run, which runs back to back).
          struct QueuedRun {
            double host_us = 0, device_us = 0;
          };
          const auto queued_run = [&](const std::function<void()>& one, int warm_up) {
            std::vector<double> host_us, device_us;
            cudaEvent_t start, stop;
            KVFORGE_CUDA_CHECK(cudaEventCreate(&start));
            KVFORGE_CUDA_CHECK(cudaEventCreate(&stop));
            for (int i = 0; i < warm_up + append_repeats; ++i) {
              if (cold != nullptr) cold->run(append_stream);
              busy_wait_on(append_stream, 5'000'000);
              KVFORGE_CUDA_CHECK(cudaEventRecord(start, append_stream));
              const auto begin = std::chrono::steady_clock::now();
              for (int r = 0; r < append_run; ++r) one();
              const double host = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - begin).count();
              KVFORGE_CUDA_CHECK(cudaEventRecord(stop, append_stream));
              cache.synchronize();
              float ms = 0;
              KVFORGE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
              if (i < warm_up) continue;
              host_us.push_back(host / append_run);
              device_us.push_back(ms * 1e3 / append_run);
            }
            cudaEventDestroy(start);
            cudaEventDestroy(stop);
            return QueuedRun{median(std::move(host_us)), median(std::move(device_us))};
          };
          const auto measure_append = [&](kernels::AppendKernel kernel) {
            cache.set_append_kernel(kernel);
            AppendTimes t;
            t.latency_us = median_wall_us(
                [&] {
                  one_step();
                  cache.synchronize();
                },
                append_repeats);
            t.time_us = median_wall_us(
                            [&] {
                              for (int i = 0; i < append_run; ++i) one_step();
                              cache.synchronize();
                            },
                            append_repeats) /
                        append_run;
            // Where a step's throughput goes: its host and device sides.
            const QueuedRun run = queued_run(one_step, 0);
            t.host_us = run.host_us;
            t.device_us = run.device_us;
            cache.set_append_kernel(kernels::AppendKernel::kAuto);
            return t;
          };
          // A whole decoding step (QuantizedKVCache::decode_step: the append
          // inside the decode's launch where the layout allows it, else the
          // append, then the decode behind it; and as those two launches
          // where it fuses, fused_decode_step off) against the decode alone,
          // each append_run times back to back behind a busy kernel on the
          // cache's stream (device time a step): what the append adds to a
          // step, the rate the decode must be kept up with being the
          // decode's own.
          struct StepTimes {
            double step_us = 0, two_launches_us = 0, decode_us = 0;
            bool fused = false;
          };
          // A setting of the steps: CacheOptions::rotate_before_exact_blocks
          // and the decode alone that goes with it.
          struct StepSetting {
            bool rotate_before_exact = true;
            kernels::DecodeParams decode_alone;
          };
          // The decode alone at the cache's lengths as they stand: by the
          // time the steps run, the append runs above and the steps before
          // have grown every sequence past `tokens` (by ~300-1000 tokens),
          // and a decode at `tokens` against steps at those lengths counted
          // the extra tokens' decode, and any change of the plan's splits
          // between the two lengths, as the append's (a decode at 32768
          // tokens takes 64 splits of 512 at batch 1, at 33,000 43 of 768).
          // Its workspace sized for its own plan, its lengths in the launch
          // or uploaded to step_lengths (outside the timed runs).
          at::Tensor step_workspace;
          const auto decode_at_cache_lengths = [&](kernels::DecodeParams alone) {
            const int64_t now = cache.length(sequences.front(), 0);
            const std::vector<int64_t> now_lengths(static_cast<size_t>(batch), now);
            alone.batch.max_length = now;
            if (alone.inline_arrays.count > 0) {
              std::copy(now_lengths.begin(), now_lengths.end(), alone.inline_arrays.lengths);
            } else {
              KVFORGE_CUDA_CHECK(
                  cudaMemcpy(step_lengths, now_lengths.data(), batch * sizeof(int64_t), cudaMemcpyHostToDevice));
              alone.batch.lengths = step_lengths;
            }
            const int64_t bytes = kernels::decode_workspace_bytes(alone);
            if (!step_workspace.defined() || step_workspace.numel() < bytes) {
              step_workspace = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
            }
            alone.workspace = step_workspace.data_ptr();
            alone.workspace_bytes = step_workspace.numel();
            return alone;
          };
          std::vector<int64_t> step_decode_tokens;
          // Each setting's times, the settings taken in turn within each
          // round (so that they see the same contexts and clocks).
          const auto measure_steps = [&](const std::vector<StepSetting>& settings) {
            const auto run_steps = [&](bool fused) {
              cache.set_fused_decode_step(fused);
              const double us = queued_run([&] {
                for (size_t i = 0; i < sequences.size(); ++i) step.positions[i] = cache.length(sequences[i], 0);
                const int64_t offset = (step_index++ % step_tokens) * batch * kKvHeads * kHeadDim;
                step.keys = step_keys.data_ptr<float>() + offset;
                step.values = step_values.data_ptr<float>() + offset;
                cache.decode_step(0, step, queries.data_ptr(), output.data_ptr(), true, kernels::ElementType::kBFloat16);
              }, 2).device_us;
              cache.set_fused_decode_step(true);
              return us;
            };
            // Alternately, so that the device's clocks treat them alike.
            const size_t n = settings.size();
            std::vector<std::vector<double>> steps(n), two_launches(n), decodes(n);
            std::vector<int64_t> fused(n, 0);
            for (int round = 0; round < 3; ++round) {
              for (size_t v = 0; v < n; ++v) {
                cache.set_rotate_before_exact_blocks(settings[v].rotate_before_exact);
                const int64_t fused_before = backend.fused_steps();
                steps[v].push_back(run_steps(true));
                fused[v] += backend.fused_steps() - fused_before;
                // Between the fused steps and the two launches: its length
                // the end of the first run's and the start of the second's.
                const kernels::DecodeParams alone = decode_at_cache_lengths(settings[v].decode_alone);
                step_decode_tokens.push_back(alone.batch.max_length);
                decodes[v].push_back(
                    queued_run([&] { kernels::launch_decode_attention(alone, append_stream); }, 2).device_us);
                two_launches[v].push_back(run_steps(false));
              }
            }
            cache.set_rotate_before_exact_blocks(settings.front().rotate_before_exact);
            std::vector<StepTimes> times;
            for (size_t v = 0; v < n; ++v) {
              times.push_back(StepTimes{median(std::move(steps[v])), median(std::move(two_launches[v])),
                                        median(std::move(decodes[v])), fused[v] > 0});
            }
            return times;
          };
          nlohmann::json row = {{"context", context},
                                {"tokens", tokens},
                                {"batch", batch},
                                {"method", method},
                                {"bits", b},
                                {"kernel", plan.int8 ? "int8_tensor_cores" : plan.tensor_cores ? "tensor_cores" : plan.lookup ? "lookup" : "general"},
                                {"splits", plan.splits},
                                {"exact_splits", plan.exact_splits},
                                {"exact_chunk", plan.exact_chunk},
                                {"exact_first", plan.exact_first},
                                {"exact_slots_reserved", plan.exact_slots_reserved},
                                {"exact_kernel", plan.exact_kernel},
                                {"rotate_queries_first", plan.rotate_queries_first},
                                {"rotation_step_in_one_wave", plan.rotation_step_in_one_wave},
                                {"wide_merge", plan.wide_merge},
                                {"merge_heads", plan.merge_heads},
                                {"cluster_merge", plan.cluster_merge},
                                {"int8_steps", plan.int8 ? (plan.int8_steps == kernels::Int8Steps::kSteps32 ? 32 : 64) : 0},
                                {"time_us", time_us},
                                {"inline_arrays", inline_arrays},
                                {"device_arrays_time_us", device_arrays_time_us},
                                {"sdpa_time_us", sdpa.at(context)},
                                {"speedup_vs_sdpa", sdpa.at(context) / time_us},
                                {"bytes_read", bytes},
                                {"achieved_bytes_per_s", static_cast<double>(bytes) / (time_us * 1e-6)},
                                {"bandwidth_fraction", static_cast<double>(bytes) / (time_us * 1e-6) / copy_bandwidth},
                                {"read_floor_us", read_floor_us},
                                {"floor_speedup_vs_sdpa", sdpa.at(context) / read_floor_us},
                                {"l2_cold", cold != nullptr},
                                {"warm_l2_time_us", warm_l2_time_us},
                                {"sdpa_warm_l2_time_us", cold != nullptr ? sdpa_warm.at(context) : sdpa.at(context)},
                                {"decode_host_us", median(planned_host_us)},
                                {"decode_host_us_replanning", median(replanning_host_us)}};
          // The decode-step appends, after the decode (each adds a token to
          // every sequence; the next context's fill tops it up).
          if (!no_append) {
            const AppendTimes appended = measure_append(kernels::AppendKernel::kAuto);
            const AppendTimes per_sequence = measure_append(kernels::AppendKernel::kPerSequence);
            row.update({{"append_run_steps", append_run},
                        {"append_time_us", appended.time_us},
                        {"append_latency_us", appended.latency_us},
                        {"append_host_us", appended.host_us},
                        {"append_device_us", appended.device_us},
                        {"append_over_decode_rate", time_us / appended.time_us},
                        {"append_per_sequence_time_us", per_sequence.time_us},
                        {"append_per_sequence_latency_us", per_sequence.latency_us},
                        {"append_per_sequence_host_us", per_sequence.host_us},
                        {"append_per_sequence_device_us", per_sequence.device_us}});
            // With --exact-blocks-first where the queries are rotated before
            // the few exact blocks: the exact blocks first as a second
            // setting (its decode alone in a workspace sized for its plan:
            // decode_at_cache_lengths).
            std::vector<StepSetting> settings{{launched.rotate_before_exact_blocks, launched}};
            const bool exact_first_too = exact_blocks_first && rotation_before_exact_blocks(plan, params);
            if (exact_first_too) {
              kernels::DecodeParams first = launched;
              first.rotate_before_exact_blocks = false;
              settings.push_back({false, first});
            }
            const std::vector<StepTimes> step_times = measure_steps(settings);
            const StepTimes& steps = step_times.front();
            const double added = steps.step_us - steps.decode_us;
            const double added_two = steps.two_launches_us - steps.decode_us;
            const auto rate = [&](double a) { return a > 0 ? nlohmann::json(steps.decode_us / a) : nlohmann::json(); };
            row.update({{"step_fused", steps.fused},
                        {"step_device_us", steps.step_us},
                        {"step_two_launches_device_us", steps.two_launches_us},
                        {"step_decode_device_us", steps.decode_us},
                        {"step_decode_tokens", median(std::vector<double>(step_decode_tokens.begin(),
                                                                          step_decode_tokens.end()))},
                        {"append_in_step_us", added},
                        {"append_in_step_over_decode_rate", rate(added)},
                        {"append_in_two_launch_step_us", added_two},
                        {"append_in_two_launch_step_over_decode_rate", rate(added_two)}});
            if (exact_first_too) {
              const StepTimes& first = step_times.back();
              row.update({{"exact_blocks_first_step_device_us", first.step_us},
                          {"exact_blocks_first_step_fused", first.fused},
                          {"exact_blocks_first_step_two_launches_device_us", first.two_launches_us},
                          {"exact_blocks_first_step_decode_device_us", first.decode_us}});
            }
          }
          row.update(graph_replay_columns(params, repeats, cold));
          // Another kernel choice on the same cache and queries: its time,
          // splits and speedup as the `prefix`ed columns; returns its plan.
          const auto time_choice = [&](kernels::DecodeParams other, const std::string& prefix) {
            const int64_t other_bytes = kernels::decode_workspace_bytes(other);
            const at::Tensor other_workspace =
                at::empty({other_bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
            other.workspace = other_workspace.data_ptr();
            other.workspace_bytes = other_bytes;
            const kernels::DecodePlan other_plan = kernels::plan_decode_attention(other, multiprocessors);
            const double other_us =
                median_us([&] { kernels::launch_decode_attention(other, nullptr); }, repeats, nullptr, cold);
            row[prefix + "_time_us"] = other_us;
            row[prefix + "_splits"] = other_plan.splits;
            row[prefix + "_speedup_vs_sdpa"] = sdpa.at(context) / other_us;
            return other_plan;
          };
          if (bf16_tensor_cores && plan.int8) {
            kernels::DecodeParams bf16_params = launched;
            bf16_params.kernel = kernels::DecodeKernel::kBf16TensorCores;
            time_choice(bf16_params, "bf16_tc");
          }
          if (general && plan.lookup) {
            kernels::DecodeParams general_params = launched;
            general_params.kernel = kernels::DecodeKernel::kGeneral;
            time_choice(general_params, "general");
          }
          if (int8_other_steps && plan.int8 && kernels::int8_wide_steps_supported(params)) {
            for (const auto& [steps, prefix] : {std::pair{kernels::Int8Steps::kSteps32, "steps32"},
                                                std::pair{kernels::Int8Steps::kSteps64Stages3, "steps64_stages3"},
                                                std::pair{kernels::Int8Steps::kSteps64Stages4, "steps64_stages4"}}) {
              if (steps == plan.int8_steps) continue;  // the row's own time
              kernels::DecodeParams other = launched;
              other.int8_steps = steps;
              time_choice(other, prefix);
            }
          }
          if (exact_blocks_first && rotation_before_exact_blocks(plan, params)) {
            kernels::DecodeParams other = launched;
            other.rotate_before_exact_blocks = false;
            time_choice(other, "exact_blocks_first");
          }
          for (const int64_t chunk : exact_chunks) {
            if (!plan.tensor_cores || plan.exact_splits == 0) break;
            kernels::DecodeParams other = launched;
            other.exact_chunk_tokens = static_cast<int32_t>(chunk);
            const std::string prefix = "exact_chunk_" + std::to_string(chunk);
            row[prefix + "_splits"] = time_choice(other, prefix).exact_splits;
          }
          for (const int64_t forced : forced_splits) {
            if (!plan.tensor_cores) break;
            kernels::DecodePlan other_plan = plan;
            other_plan.tokens_per_split = forced;
            other_plan.splits = static_cast<int32_t>((tokens + forced - 1) / forced);
            other_plan.states = other_plan.splits + other_plan.exact_splits;
            kernels::DecodeParams other = launched;
            const int64_t other_bytes = kernels::DecodePlanner::workspace_bytes(other, other_plan);
            const at::Tensor other_workspace =
                at::empty({other_bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
            other.workspace = other_workspace.data_ptr();
            other.workspace_bytes = other_bytes;
            kernels::DecodePlanner planner;
            const std::string prefix = "split_" + std::to_string(forced);
            row[prefix + "_time_us"] =
                median_us([&] { planner.launch(other, other_plan, nullptr); }, repeats, nullptr, cold);
            row[prefix + "_splits"] = other_plan.splits;
          }
          const auto fi = flashinfer.find({context, batch});
          if (fi != flashinfer.end()) {
            row["flashinfer_bf16_time_us"] = fi->second.value("flashinfer_bf16_time_us", nlohmann::json());
            row["flashinfer_fp8_time_us"] = fi->second.value("flashinfer_fp8_time_us", nlohmann::json());
            row["flashinfer_bf16_tensor_cores"] = fi->second.value("flashinfer_bf16_tensor_cores", nlohmann::json());
            row["flashinfer_fp8_tensor_cores"] = fi->second.value("flashinfer_fp8_tensor_cores", nlohmann::json());
          }
          std::cerr << row.dump() << "\n";
          rows.push_back(row);
        }
        cudaFree(slots);
        cudaFree(lengths);
        cudaFree(step_lengths);
      }
    }
  }
  cudaDeviceProp properties{};
  KVFORGE_CUDA_CHECK(cudaGetDeviceProperties(&properties, 0));
  const nlohmann::json report = {{"what", "decode attention of the runtime kernels vs bf16 SDPA, Llama-3-8B attention shapes"},
                                 {"machine", properties.name},
                                 {"commit", commit},
                                 {"command", command},
                                 {"arguments", arguments},
                                 {"step_tokens", no_append ? 0 : step_tokens},
                                 {"l2_bytes", l2_flush.l2_bytes()},
                                 {"l2_flush_bytes", cold != nullptr ? l2_flush.bytes() : 0},
                                 {"copy_bandwidth_bytes_per_s", copy_bandwidth},
                                 {"empty_kernel_us", empty_kernel_us},
                                 {"empty_dependent_pair_us", empty_dependent_pair_us},
                                 {"empty_dependent_pair_decode_params_us", empty_dependent_pair_decode_params_us},
                                 {"rows", rows}};
  std::ofstream(out) << report.dump(1) << "\n";
  return 0;
}

}  // namespace
}  // namespace kvforge

int main(int argc, char** argv) {
  try {
    return kvforge::run(argc, argv);
  } catch (const std::exception& error) {
    std::cerr << "kvforge_bench_decode_attention: " << error.what() << "\n";
    return 1;
  }
}
