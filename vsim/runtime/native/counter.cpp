// vsim's native op tracker: counts the iteration's dispatcher calls in C++ and calls back into
// Python only at the calls where the executor acts (vsim/runtime/native/__init__.py).
//
// A boxed fallback on the TESTING_ONLY_GenericMode dispatch key, which no part of PyTorch uses
// outside its tests. The key is put in the thread's included dispatch keys while an iteration
// runs; PyTorch carries that thread-local set into the autograd engine's threads, so backward's
// calls are counted too. A Python TorchDispatchMode costs ~40 us per aten call on the host; this
// fallback costs ~0.4 us (measured on the development CPU, docs/design.md).
//
// Single iteration at a time: the forward thread and the autograd thread never dispatch at the
// same time in a training step (backward() blocks its caller), so the state is plain globals.

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr auto KEY = c10::DispatchKey::TESTING_ONLY_GenericMode;

enum Flag : uint8_t { PRE = 1, POST = 2 };

struct State {
  int64_t count = 0;
  bool paused = false;       // the executor's own calls (inside callbacks) are not counted
  bool calibrating = false;  // record every call's name and where it ended
  std::vector<std::string> names;  // calibrating: call c's operator name
  std::vector<uint8_t> flags;      // armed: PRE / POST per count
  std::unordered_map<int64_t, std::string> expect;  // armed: the name each target must have
  py::object callback;             // armed: callback(count, outputs or None, is_post)
  std::string diverged;            // armed: the first mismatch, empty if none
};

State S;

std::string name_of(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.name + "." + (n.overload_name.empty() ? std::string("default") : n.overload_name);
}

// The same operator, its in-place and out-of-place forms taken as one: autograd accumulates a
// gradient in place when nothing else holds the buffer, which a Python tracker's references
// (the calibration's) can change (aten::add.Tensor then, aten::add_.Tensor now).
std::string base_of(const std::string& name) {
  auto dot = name.find('.');
  std::string op = name.substr(0, dot);
  if (!op.empty() && op.back() == '_') op.pop_back();
  return op + (dot == std::string::npos ? std::string() : name.substr(dot));
}

void call_back(int64_t c, const c10::OperatorHandle& op, torch::jit::Stack* stack, bool post) {
  auto it = S.expect.find(c);
  if (it != S.expect.end()) {
    std::string got = name_of(op);
    if (got != it->second && base_of(got) != base_of(it->second)) {
      if (S.diverged.empty())
        S.diverged = "call " + std::to_string(c) + " is " + got + ", calibration's was " +
                     it->second;
      throw std::runtime_error("vsim native tracker: the run diverged: " + S.diverged);
    }
  }
  bool was = S.paused;
  S.paused = true;
  {
    c10::impl::ExcludeDispatchKeyGuard own(KEY);  // the executor's own calls
    py::gil_scoped_acquire gil;
    try {
      py::object out = py::none();
      if (post) {
        size_t n = op.schema().returns().size();
        if (n == 1) {
          out = torch::jit::toPyObject(stack->back());
        } else {
          py::tuple t(n);
          for (size_t i = 0; i < n; ++i)
            t[i] = torch::jit::toPyObject((*stack)[stack->size() - n + i]);
          out = t;
        }
      }
      S.callback(c, out, post);
    } catch (py::error_already_set& e) {
      // The Python side keeps the exception (vsim.runtime.native.Armed.error) and raises it
      // again where the step returns; here only the dispatch is stopped.
      S.paused = was;
      throw std::runtime_error(std::string("vsim native tracker: callback raised: ") + e.what());
    }
  }
  S.paused = was;
}

// Calls made while a counted call runs on the same thread (inside a composite, a kernel or
// autograd's own code) are not counted: the step's calls are the outermost ones. That is also
// what a Python dispatch mode sees of them once inside its handler, so a calibration under the
// Python tracker counts what a plain run counts.
thread_local int depth = 0;

struct Depth {
  Depth() { ++depth; }
  ~Depth() { --depth; }
};

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto after = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, KEY);
  if (S.paused || depth > 0 || op.operator_name().name.rfind("profiler::", 0) == 0) {
    op.redispatchBoxed(after, stack);
    return;
  }
  const int64_t c = S.count++;
  uint8_t f = 0;
  if (S.calibrating) {
    S.names.push_back(name_of(op));
    if (S.callback) f = POST;  // calibration sees every counted call's outputs
  } else if (c < static_cast<int64_t>(S.flags.size())) {
    f = S.flags[c];
  }
  if (f & PRE) call_back(c, op, stack, false);
  {
    Depth d;
    // calls made inside this one skip the key altogether: a boxed fallback costs every call it
    // sees a boxing and unboxing of its arguments, and inner calls are not counted anyway
    c10::impl::ExcludeDispatchKeyGuard inner(KEY);
    op.redispatchBoxed(after, stack);
  }
  if (f & POST) call_back(c, op, stack, true);
}

void do_begin() {
  S.count = 0;
  S.paused = false;
  S.diverged.clear();
  if (S.calibrating) S.names.clear();
  c10::impl::tls_set_dispatch_key_included(KEY, true);
}

void do_end() { c10::impl::tls_set_dispatch_key_included(KEY, false); }

bool do_pause(bool on) {
  bool was = S.paused;
  S.paused = on;
  return was;
}

int64_t do_count() { return S.count; }

int do_depth() { return depth; }

void do_calibrate(bool on) { S.calibrating = on; }


std::vector<std::string> do_recorded() { return S.names; }

void do_arm(py::bytes flags, std::unordered_map<int64_t, std::string> expect, py::object callback) {
  std::string f = flags;
  S.flags.assign(f.begin(), f.end());
  S.expect = std::move(expect);
  S.callback = std::move(callback);
}

void do_disarm() {
  S.flags.clear();
  S.expect.clear();
  S.callback = py::object();
}

std::string do_diverged() { return S.diverged; }

}  // namespace

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("begin", &do_begin, "count from 0 on this thread (and the autograd threads it starts)");
  m.def("end", &do_end);
  m.def("pause", &do_pause, "stop or resume counting; returns the previous state");
  m.def("count", &do_count);
  m.def("depth", &do_depth, "how many counted calls run on this thread (0 or 1)");
  m.def("calibrate", &do_calibrate);
  m.def("recorded", &do_recorded, "calibration: each counted call's operator name");
  m.def("arm", &do_arm);
  m.def("disarm", &do_disarm);
  m.def("diverged", &do_diverged);
}
