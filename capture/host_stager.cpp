#include "capture/host_stager.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

namespace kvforge {

struct HostStager::Impl {
  struct Item {
    at::Tensor host;
    std::optional<at::cuda::CUDAEvent> done;
    std::function<void(const at::Tensor&)> consume;
  };
  std::optional<c10::cuda::CUDAStream> copy_stream;
  std::deque<Item> items;
};

HostStager::HostStager(c10::Device device) : impl_(std::make_unique<Impl>()) {
  if (device.is_cuda()) impl_->copy_stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
}

HostStager::~HostStager() = default;

void HostStager::stage(const at::Tensor& values, std::function<void(const at::Tensor&)> consume) {
  Impl::Item item;
  item.consume = std::move(consume);
  const at::Tensor source = values.detach();
  if (!source.is_cuda()) {
    item.host = source.contiguous().clone();
    impl_->items.push_back(std::move(item));
    return;
  }
  const c10::cuda::CUDAGuard device_guard(source.device());
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(source.device().index());
  const c10::cuda::CUDAStream copy = *impl_->copy_stream;
  at::cuda::CUDAEvent produced;
  produced.record(compute);
  produced.block(copy);
  // The caching allocator must not hand the source's memory to new compute
  // work until the side stream has read it.
  c10::cuda::CUDACachingAllocator::recordStream(source.storage().data_ptr(), copy);
  item.host = at::empty(source.sizes(), source.options().device(at::kCPU).pinned_memory(true));
  {
    const c10::cuda::CUDAStreamGuard stream_guard(copy);
    item.host.copy_(source, /*non_blocking=*/true);
  }
  item.done.emplace();
  item.done->record(copy);
  impl_->items.push_back(std::move(item));
}

void HostStager::drain() {
  while (!impl_->items.empty()) {
    Impl::Item item = std::move(impl_->items.front());
    impl_->items.pop_front();
    if (item.done) item.done->synchronize();
    item.consume(item.host);
  }
}

void HostStager::drain_ready() {
  while (!impl_->items.empty() && (!impl_->items.front().done || impl_->items.front().done->query())) {
    Impl::Item item = std::move(impl_->items.front());
    impl_->items.pop_front();
    item.consume(item.host);
  }
}

size_t HostStager::pending() const { return impl_->items.size(); }

}  // namespace kvforge
