// The executor's offload and prefetch as one call each (vsim/runtime/executor.py): in Python
// each was a dozen torch calls through Python wrappers (views, events, stream switches, the
// copy, record_stream), 55-104 us of host time per offloaded tensor on the lent hosts
// (validation/runtime/README.md). Device-generic c10 calls only (c10::Event, StreamGuard,
// the device's guard implementation), so the extension builds without CUDA headers.
//
// Streams are torch.Stream objects (a torch.cuda.Stream is one) or None on the CPU, where the
// copy is synchronous and no event is made. Errors come back as PyTorch's own Python
// exceptions (torch.OutOfMemoryError from an allocation under a cap included).

#include "actions.h"

#include <torch/extension.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Event.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace {

using namespace vsim_actions;

const c10::Storage& storage_of(py::handle h) {
  if (!THPStorage_Check(h.ptr())) throw std::invalid_argument("an UntypedStorage");
  return THPStorage_Unpack(h.ptr());
}

std::optional<c10::Stream> stream_of(py::handle h) {
  if (h.is_none()) return std::nullopt;
  return h.cast<c10::Stream>();
}

// The torch.Events handed to Python (copy ends: prefetches, the pinned pool and `needs` wait
// for them), per device (an event is recorded on one device only); one that only this list
// still holds is recorded again instead of made anew. Never destroyed: a static list of Python
// objects would be released after the interpreter has finalized (an abort at exit, seen on
// the H100).
struct Handed {
  std::vector<py::object> events;
  size_t cursor = 0;
};
auto& handed = *new std::map<c10::DeviceIndex, Handed>();

// a torch.Event recorded on `stream` now
py::object event_on(const c10::Stream& stream) {
  Handed& h = handed[stream.device_index()];
  const size_t n = h.events.size();
  for (size_t k = 0; k < std::min<size_t>(n, 8); ++k) {
    const size_t i = (h.cursor + k) % n;
    py::object& ev = h.events[i];
    if (Py_REFCNT(ev.ptr()) == 1) {
      h.cursor = i + 1;
      reinterpret_cast<THPEvent*>(ev.ptr())->event.record(stream);
      return ev;
    }
  }
  PyObject* ev = THPEvent_new(stream.device_type(), c10::EventFlag::PYTORCH_DEFAULT);
  if (ev == nullptr) throw py::error_already_set();
  reinterpret_cast<THPEvent*>(ev)->event.record(stream);
  h.events.push_back(py::reinterpret_steal<py::object>(ev));
  return h.events.back();
}

// `dst` <- `src`: on the copy stream `on` where there is one (its end recorded as the event
// returned, the block of `st` marked as used there: the allocator reuses it only after the
// copy), else synchronously (the CPU: no event). Returns (the event or None, ns issuing the copy).
std::pair<py::object, int64_t> copy_bytes(at::Tensor& dst, const at::Tensor& src,
                                          const std::optional<c10::Stream>& on,
                                          const c10::Storage& st, bool non_blocking) {
  if (!on) {
    auto t0 = Clock::now();
    dst.copy_(src);
    return {py::none(), ns_since(t0)};
  }
  int64_t ns;
  {
    c10::StreamGuard guard(*on);
    auto t0 = Clock::now();
    dst.copy_(src, non_blocking);
    ns = ns_since(t0);
  }
  py::object done = event_on(*on);
  record_on(st, *on);
  return {done, ns};
}

// The copy stream of an action, having waited for the compute stream; none on the CPU.
std::optional<c10::Stream> copy_stream(py::handle compute, py::handle copy) {
  auto cs = stream_of(compute), s = stream_of(copy);
  if (!cs || !s) return std::nullopt;
  wait_for(*s, *cs);
  return s;
}

// Offload: the copy stream waits for the compute stream and the storage's bytes are copied into
// the host buffer from `offset` on it (copy_bytes). Returns (the copy's end event or None, ns
// issuing the copy, ns in all).
py::tuple offload(py::handle storage, const at::Tensor& buffer, int64_t offset,
                  py::handle compute, py::handle copy, bool non_blocking) {
  const auto start = Clock::now();
  const c10::Storage& st = storage_of(storage);
  at::Tensor src = bytes_of(st);
  at::Tensor host = host_bytes(buffer, offset, static_cast<int64_t>(st.nbytes()));
  auto on = copy_stream(compute, copy);
  auto [done, ns] = copy_bytes(host, src, on, st, non_blocking);
  return py::make_tuple(done, ns, ns_since(start));
}

// Prefetch: the released storage gets `n` bytes again (allocated on the current stream, the
// compute stream, whose order protects earlier users of the memory), the copy stream waits
// for the compute stream and for `after` (the offload's end event, or None), and the bytes come
// back from the host buffer at `offset` on it (copy_bytes). Returns (the copy's end event or
// None, ns in the allocation, ns issuing the copy, ns in all).
py::tuple prefetch(py::handle storage, int64_t n, const at::Tensor& buffer, int64_t offset,
                   py::handle compute, py::handle copy, py::handle after, bool non_blocking) {
  const auto start = Clock::now();
  const c10::Storage& st = storage_of(storage);
  c10::StorageImpl* impl = st.unsafeGetStorageImpl();
  if (impl->nbytes() != 0) throw std::invalid_argument("prefetch: the storage is not released");
  auto t0 = Clock::now();
  {
    // what resize_(n) does for a storage of 0 bytes (nothing to copy over)
    c10::DeviceGuard guard(impl->device());
    at::DataPtr data = impl->allocator()->allocate(static_cast<size_t>(n));
    impl->set_data_ptr_noswap(std::move(data));
    impl->set_nbytes(static_cast<size_t>(n));
  }
  const int64_t alloc_ns = ns_since(t0);
  at::Tensor host;
  try {
    host = host_bytes(buffer, offset, n);
  } catch (...) {  // the storage is left released, as a failed allocation leaves it
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
    impl->set_nbytes(0);
    throw;
  }
  at::Tensor dst = bytes_of(st);
  auto on = copy_stream(compute, copy);
  if (on && !after.is_none()) {
    if (!THPEvent_Check(after.ptr())) throw std::invalid_argument("prefetch: after is a torch.Event");
    reinterpret_cast<THPEvent*>(after.ptr())->event.block(*on);
  }
  auto [done, copy_ns] = copy_bytes(dst, host, on, st, non_blocking);
  return py::make_tuple(done, alloc_ns, copy_ns, ns_since(start));
}

// `stream` waits for a torch.Event; returns the ns it took
int64_t wait_event(py::handle event, py::handle stream) {
  const auto start = Clock::now();
  if (!THPEvent_Check(event.ptr())) throw std::invalid_argument("wait_event: a torch.Event");
  reinterpret_cast<THPEvent*>(event.ptr())->event.block(stream.cast<c10::Stream>());
  return ns_since(start);
}

// `waiter` waits for everything issued so far on `other`; returns the ns it took
int64_t wait_stream(py::handle waiter, py::handle other) {
  const auto start = Clock::now();
  wait_for(waiter.cast<c10::Stream>(), other.cast<c10::Stream>());
  return ns_since(start);
}

}  // namespace

void init_actions(py::module& m) {
  m.def("offload", torch::wrap_pybind_function(offload),
        "offload(storage, host buffer, offset, compute, copy, non_blocking) -> (event, copy ns, "
        "ns)");
  m.def("prefetch", torch::wrap_pybind_function(prefetch),
        "prefetch(storage, n, host buffer, offset, compute, copy, after, non_blocking) -> "
        "(event, alloc ns, copy ns, ns)");
  m.def("wait_event", torch::wrap_pybind_function(wait_event));
  m.def("wait_stream", torch::wrap_pybind_function(wait_stream));
}
