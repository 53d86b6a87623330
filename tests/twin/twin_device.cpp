// A "twin accelerator" for the CPU test suite: torch's PrivateUse1 device whose memory is host memory and
// whose kernels are the CPU's. Tensors on it compute like CPU tensors, but they are not CPU tensors: a
// process group that serves only this device rejects CPU tensors, as an NCCL group rejects them on a GPU.
#include <cstring>

#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: it pulls in the whole C++ frontend, most of the build time
#include <torch/library.h>

namespace {

constexpr c10::DeviceType kTwin = c10::DeviceType::PrivateUse1;

// Host memory tagged with the twin device.
struct TwinAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    return {data, data, &c10::free_cpu, c10::Device(kTwin, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &c10::free_cpu; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};
TwinAllocator twin_allocator;
REGISTER_ALLOCATOR(kTwin, &twin_allocator);

// One device, one stream, events that are always complete: work runs synchronously on the host.
struct TwinGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kTwin; }
  c10::Device exchangeDevice(c10::Device) const override { return {kTwin, 0}; }
  c10::Device getDevice() const override { return {kTwin, 0}; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream getNewStream(c10::Device device, int) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream exchangeStream(c10::Stream stream) const noexcept override { return stream; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, TwinGuard);

struct TwinHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  at::Device getDeviceFromPtr(void*) const override { return {kTwin, 0}; }
  // pinned host memory for non-blocking copies out (torch.distributed.checkpoint's writer): plain host memory
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);  // the twin's allocator is the storage's
  }
};

// The same memory seen as a CPU tensor (the twin's memory is host memory).
at::Tensor as_cpu(const at::Tensor& t) {
  if (t.device().type() == c10::DeviceType::CPU) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::kCPU));
}

at::Tensor twin_empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                      std::optional<at::Layout>, std::optional<at::Device>, std::optional<bool>,
                      std::optional<at::MemoryFormat> memory_format) {
  constexpr c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_generic(size, &twin_allocator, keys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor twin_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                              std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                              std::optional<at::Device>, std::optional<bool>) {
  constexpr c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, &twin_allocator, keys, c10::dtype_or_default(dtype));
}

at::Tensor twin_copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  as_cpu(dst).copy_(as_cpu(self));
  return dst;
}

at::Tensor twin_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    dst.resize_(self.sizes());
  }
  return twin_copy_from(self, dst, false);
}

// Attention picks the kernel the CPU would (its flash kernel; then run through the fallback below), not
// the device-agnostic math path torch takes for a device without a choice: the same numerics as the CPU.
int64_t twin_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                        std::optional<double> scale, bool enable_gqa) {
  std::optional<at::Tensor> cpu_mask = mask ? std::optional<at::Tensor>(as_cpu(*mask)) : std::nullopt;
  return at::_fused_sdp_choice(as_cpu(q), as_cpu(k), as_cpu(v), cpu_mask, dropout_p, is_causal, scale,
                               enable_gqa);
}

// Everything else runs as the CPU's kernel on copies (at::native::cpu_fallback). A view computed on a copy
// would not alias its base, so an unregistered view op fails loudly instead.
void twin_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  for (const auto& ret : op.schema().returns()) {
    TORCH_CHECK(!ret.alias_info() || ret.alias_info()->isWrite(), "twin device: view op ",
                op.schema().name(), " has no twin kernel");
  }
  at::native::cpu_fallback(op, stack);
}

// A process-group backend for the twin device only. It runs gloo on CPU views of the same host memory, so
// results are gloo's exactly; registered for the twin device alone, its group rejects CPU tensors the way a
// group whose only backend is NCCL does ("No backend type associated with device type cpu").
class TwinBackend final : public c10d::Backend {
 public:
  explicit TwinBackend(c10::intrusive_ptr<c10d::Backend> gloo)
      : c10d::Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)) {}

  const std::string getBackendName() const override { return "twin"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t,
                                           const c10d::BroadcastOptions& o) override {
    auto v = views(t);
    return gloo_->broadcast(v, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t,
                                           const c10d::AllreduceOptions& o) override {
    auto v = views(t);
    return gloo_->allreduce(v, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceCoalescedOptions& o) override {
    auto v = views(t);
    return gloo_->allreduce_coalesced(v, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    auto v = views(t);
    return gloo_->reduce(v, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out,
                                           std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o) override {
    auto vo = views(out);
    auto vi = views(in);
    return gloo_->allgather(vo, vi, o);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    auto vo = view(out);
    auto vi = view(in);
    return gloo_->_allgather_base(vo, vi, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::AllgatherOptions& o) override {
    auto vo = views(out);
    auto vi = views(in);
    return gloo_->allgather_into_tensor_coalesced(vo, vi, o);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& out,
                                        std::vector<at::Tensor>& in, const c10d::GatherOptions& o) override {
    auto vo = views(out);
    auto vi = views(in);
    return gloo_->gather(vo, vi, o);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& out,
                                         std::vector<std::vector<at::Tensor>>& in,
                                         const c10d::ScatterOptions& o) override {
    auto vo = views(out);
    auto vi = views(in);
    return gloo_->scatter(vo, vi, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out,
                                                std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override {
    auto vo = views(out);
    auto vi = views(in);
    return gloo_->reduce_scatter(vo, vi, o);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                     const c10d::ReduceScatterOptions& o) override {
    auto vo = view(out);
    auto vi = view(in);
    return gloo_->_reduce_scatter_base(vo, vi, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::ReduceScatterOptions& o) override {
    auto vo = views(out);
    auto vi = views(in);
    return gloo_->reduce_scatter_tensor_coalesced(vo, vi, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& o) override {
    auto vo = view(out);
    auto vi = view(in);
    return gloo_->alltoall_base(vo, vi, out_splits, in_splits, o);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    auto v = views(t);
    return gloo_->send(v, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    auto v = views(t);
    return gloo_->recv(v, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override { return gloo_->barrier(o); }

 private:
  // A CPU view of a twin tensor's memory that keeps the tensor alive while gloo works on it.
  static at::Tensor view(const at::Tensor& t) {
    TORCH_CHECK(t.device().type() == kTwin, "the twin backend serves twin tensors only, got one on ",
                t.device());
    return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [keep = t](void*) {},
                         t.options().device(c10::kCPU));
  }
  static std::vector<at::Tensor> views(const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> out;
    for (const auto& t : ts) out.push_back(view(t));
    return out;
  }
  static std::vector<std::vector<at::Tensor>> views(const std::vector<std::vector<at::Tensor>>& ts) {
    std::vector<std::vector<at::Tensor>> out;
    for (const auto& t : ts) out.push_back(views(t));
    return out;
  }

  c10::intrusive_ptr<c10d::Backend> gloo_;
};

}  // namespace

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &twin_sdp_choice)
}  // namespace at::native

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", twin_empty);
  m.impl("empty_strided", twin_empty_strided);
  m.impl("_copy_from", twin_copy_from);
  m.impl("_copy_from_and_resize", twin_copy_from_and_resize);
  m.impl("view", at::native::view);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("resize_", at::native::resize_);
  m.impl("set_.source_Storage", at::native::set_);
  m.impl("set_.source_Storage_storage_offset", at::native::set_storage_cpu_);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&twin_fallback>());
}

TORCH_LIBRARY_IMPL(_, AutogradPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  static TwinHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  py::class_<TwinBackend, c10d::Backend, c10::intrusive_ptr<TwinBackend>>(m, "TwinBackend")
      .def(py::init<c10::intrusive_ptr<c10d::Backend>>());
}
