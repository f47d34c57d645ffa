// Helpers shared by the executor's actions (actions.cpp) and its core (core.cpp): storages as
// byte tensors, host buffer slices, stream waits, made without dispatcher calls where one would
// cost host time.

#pragma once

#include <torch/extension.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <map>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

namespace vsim_actions {

using Clock = std::chrono::steady_clock;

inline int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

// the storage's bytes as a 1-D uint8 tensor (what the Python executor's _view made), made
// directly: at::empty + set_ are two dispatcher calls
inline at::Tensor bytes_of(const c10::Storage& st) {
  auto key = c10::computeDispatchKey(at::kByte, at::kStrided, st.device());
  at::Tensor v = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(st), c10::DispatchKeySet(key), caffe2::TypeMeta::Make<uint8_t>());
  v.unsafeGetTensorImpl()->set_sizes_contiguous({static_cast<int64_t>(st.nbytes())});
  return v;
}

// `n` bytes of a 1-D uint8 host buffer from `offset`, made directly (slicing in Python cost a
// dispatcher call through Python per offload and per prefetch, 5-10 us of host time each)
inline at::Tensor host_bytes(const at::Tensor& buffer, int64_t offset, int64_t n) {
  if (buffer.scalar_type() != at::kByte || buffer.dim() != 1 || offset < 0 || n < 0 ||
      offset + n > buffer.numel())
    throw std::invalid_argument("a host buffer of uint8 holding offset + n bytes");
  auto key = c10::computeDispatchKey(at::kByte, at::kStrided, buffer.device());
  at::Tensor v = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(buffer.storage()), c10::DispatchKeySet(key), caffe2::TypeMeta::Make<uint8_t>());
  const int64_t size[1] = {n}, stride[1] = {1};
  v.unsafeGetTensorImpl()->set_sizes_and_strides(c10::IntArrayRef(size, 1),
                                                 c10::IntArrayRef(stride, 1),
                                                 buffer.storage_offset() + offset);
  return v;
}

// Events are made once and recorded again: creating and destroying a CUDA event per wait cost
// about 10 us of host time each on the H100 host (cProfile, 2026-11-27). Re-recording is safe:
// a stream's wait takes the event's record at the time of the wait.

// `waiter` waits for the work issued so far on `other` (one event per stream `other`)
inline void wait_for(const c10::Stream& waiter, const c10::Stream& other) {
  // never destroyed: destroying CUDA events after the CUDA context is gone at exit can fail
  static auto* marks =
      new std::map<std::pair<c10::DeviceIndex, c10::StreamId>, std::unique_ptr<c10::Event>>();
  auto& e = (*marks)[{other.device_index(), other.id()}];
  if (!e) e = std::make_unique<c10::Event>(other.device_type());
  e->record(other);
  e->block(waiter);
}

// An operator's returned value's leaves as Python's pytree gives them (vsim.runtime's
// _leaves: lists and tuples flattened, anything else a leaf), appended to `out`.
inline void leaves_of(const c10::IValue& v, std::vector<c10::IValue>& out) {
  if (v.isTensorList()) {
    for (const at::Tensor& x : v.toTensorList()) out.emplace_back(x);
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toListRef()) leaves_of(x, out);
  } else if (v.isTuple()) {
    for (const c10::IValue& x : v.toTupleRef().elements()) leaves_of(x, out);
  } else {
    out.push_back(v);
  }
}

inline void record_on(const c10::Storage& st, const c10::Stream& stream) {
  c10::impl::VirtualGuardImpl impl(st.device_type());
  impl.recordDataPtrOnStream(st.data_ptr(), stream);
}

}  // namespace vsim_actions
