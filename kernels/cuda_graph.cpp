#include "kernels/cuda_graph.h"

#include "kernels/cuda_runtime_check.h"

namespace kvforge::kernels {
namespace {

struct GraphDeleter {
  void operator()(CUgraph_st* graph) const { cudaGraphDestroy(graph); }
};
using Graph = std::unique_ptr<CUgraph_st, GraphDeleter>;

}  // namespace

void CapturedGraph::ExecDeleter::operator()(CUgraphExec_st* exec) const { cudaGraphExecDestroy(exec); }

void CapturedGraph::begin_capture(cudaStream_t stream) {
  KVFORGE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
}

void CapturedGraph::abandon_capture(cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream, &graph);  // its error, if any, is the capture's, already being thrown
  Graph released(graph);
}

CapturedGraph::Exec CapturedGraph::end_capture(cudaStream_t stream) {
  cudaGraph_t raw_graph = nullptr;
  KVFORGE_CUDA_CHECK(cudaStreamEndCapture(stream, &raw_graph));
  const Graph graph(raw_graph);
  cudaGraphExec_t exec = nullptr;
  KVFORGE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph.get(), 0));
  return Exec(exec);
}

void CapturedGraph::launch(cudaStream_t stream) const { KVFORGE_CUDA_CHECK(cudaGraphLaunch(exec_.get(), stream)); }

}  // namespace kvforge::kernels
