// The replay's views of recorded arguments (vsim/runtime/recompute.py, `_resolve`): a tensor
// argument is passed as the view the call read (storage, dtype, offset, sizes, strides). In
// Python, checking whether a tensor at hand is that view took five calls into torch, and making
// it took two dispatcher calls (empty + set_); one call each here.

#include <torch/extension.h>
#include <ATen/EmptyTensor.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Storage.h>

#include <vector>

namespace {

const c10::Storage& storage_arg(py::handle h) {
  if (!THPStorage_Check(h.ptr())) throw std::invalid_argument("an UntypedStorage");
  return THPStorage_Unpack(h.ptr());
}

at::ScalarType dtype_arg(py::handle h) {
  if (!THPDtype_Check(h.ptr())) throw std::invalid_argument("a torch.dtype");
  return reinterpret_cast<THPDtype*>(h.ptr())->scalar_type;
}

// Whether `t` is the view (storage, dtype, offset, sizes, strides) of the storage.
bool is_view(const at::Tensor& t, py::handle storage, py::handle dtype, int64_t offset,
             const std::vector<int64_t>& size, const std::vector<int64_t>& stride) {
  const c10::Storage& st = storage_arg(storage);
  return t.has_storage() && t.storage().unsafeGetStorageImpl() == st.unsafeGetStorageImpl() &&
         t.scalar_type() == dtype_arg(dtype) && t.storage_offset() == offset &&
         t.sizes().equals(size) && t.strides().equals(stride);
}

// The view, or None where the storage is too small for it (then `set_` would resize it, which
// the Python path does).
py::object view_of(py::handle storage, py::handle dtype, int64_t offset,
                   const std::vector<int64_t>& size, const std::vector<int64_t>& stride) {
  const c10::Storage& st = storage_arg(storage);
  const at::ScalarType type = dtype_arg(dtype);
  const size_t item = c10::elementSize(type);
  if (offset < 0 || size.size() != stride.size() ||
      at::detail::computeStorageNbytes(size, stride, item, static_cast<size_t>(offset)) >
          st.nbytes())
    return py::none();
  auto key = c10::computeDispatchKey(type, at::kStrided, st.device());
  at::Tensor v = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(st), c10::DispatchKeySet(key), c10::scalarTypeToTypeMeta(type));
  v.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride, offset);
  return py::cast(v);
}

}  // namespace

void init_views(py::module& m) {
  m.def("is_view", &is_view, "is_view(tensor, storage, dtype, offset, sizes, strides)");
  m.def("view_of", &view_of,
        "view_of(storage, dtype, offset, sizes, strides) -> the view, or None if it does not fit");
}
