// The recomputation's replay in C++ (vsim/runtime/recompute.py, "The compiled replay" in
// docs/design.md). In Python, each recorded call cost the host 40-60 us to record (its
// arguments converted to Python objects, then walked) and 50-65 us to replay around the call
// itself (resolving each argument's state, views, outputs) on the lent H100 host: a quarter of
// the iteration of host-bound plans that recompute.
//
// Split: the Python replay decides once, in the first armed iteration, where each argument of
// each replayed call comes from (a `Program` per recomputation, built by recompute.py's
// `_ProgramLog`); the calls and their data flow repeat every iteration, so later iterations
// only capture, at the frames the programs replay (counter.cpp's run_frame), each frame's
// arguments (tensors weakly: a capture must not keep an activation alive) and RNG state, and
// run the programs here without Python.

#include "actions.h"

#include <torch/extension.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>

#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

void vsim_swap_storages(c10::StorageImpl* x, c10::StorageImpl* y);  // counter.cpp

namespace vsim_replay {

using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// A tensor argument as captured: its storage and the tensor itself, both weakly.
struct Ref {
  WeakStorage st;
  WeakTensor t;
  explicit Ref(const at::Tensor& x)
      : st(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
            x.storage().unsafeGetStorageImpl())),
        t(x.getIntrusivePtr()) {}
};

// How an argument of the captured stack is rebuilt: as it was (no tensor in it), one tensor,
// a tensor list, or a list of optional tensors (aten.index's indices).
enum Kind : uint8_t { PLAIN, TENSOR, TLIST, OTLIST };

struct Layout {
  Kind kind;
  int first;                  // its first tensor slot
  std::vector<bool> present;  // TLIST / OTLIST: per element, whether it holds a tensor
};

struct Capture {
  std::optional<c10::OperatorHandle> op;
  std::vector<c10::IValue> args;  // tensors taken out (slots)
  std::vector<Layout> layout;
  std::vector<Ref> in;            // the tensor slots, in argument order
  at::Tensor rng;                 // the RNG state before the call, where it is random
};

// Made once and never destroyed: a static holding tensors would be released after the
// interpreter and CUDA are torn down at exit (an abort; see counter.cpp's Packs).
std::unordered_map<int64_t, Capture>& captures() {
  static auto* c = new std::unordered_map<int64_t, Capture>();
  return *c;
}

struct Stats {
  int64_t captured = 0;
  int64_t ns = 0;
} CS;

std::optional<c10::Device> rng_device;  // the device whose generator random calls draw from

void clear() {
  captures().clear();
  CS = Stats();
}

using vsim_actions::Clock;  // actions.h
using vsim_actions::ns_since;

at::Tensor rng_now() {
  if (!rng_device) return at::Tensor();
  auto gen = at::globalContext().defaultGenerator(*rng_device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng(const at::Tensor& state) {
  auto gen = at::globalContext().defaultGenerator(*rng_device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Called by counter.cpp's run_frame after a captured frame ran: `args` are the arguments it
// was called with.
void capture(int64_t key, const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
             at::Tensor rng) {
  const auto t0 = Clock::now();
  Capture& c = captures()[key];
  c.op = op;
  c.args.clear();
  c.layout.clear();
  c.in.clear();
  c.rng = std::move(rng);
  for (const auto& v : args) {
    Layout l{PLAIN, static_cast<int>(c.in.size()), {}};
    // a wrapped number (a Python scalar made a 0-dim tensor) reaches Python as the number:
    // kept as it is
    if (v.isTensor() && v.toTensor().defined() &&
        !v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) {
      l.kind = TENSOR;
      c.in.emplace_back(v.toTensor());
      c.args.emplace_back();
    } else if (v.isTensorList()) {
      l.kind = TLIST;
      for (const at::Tensor& x : v.toTensorVector()) {
        l.present.push_back(true);
        c.in.emplace_back(x);
      }
      c.args.emplace_back();
    } else if (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList()) {
      bool tensors = false;
      for (const auto& e : v.toListRef()) tensors = tensors || e.isTensor();
      if (tensors) {
        l.kind = OTLIST;
        for (const auto& e : v.toListRef()) {
          const bool has = e.isTensor() && e.toTensor().defined();
          l.present.push_back(has);
          if (has) c.in.emplace_back(e.toTensor());
        }
        c.args.emplace_back();
      } else {
        c.args.push_back(v);
      }
    } else {
      c.args.push_back(v);
    }
    c.layout.push_back(std::move(l));
  }
  ++CS.captured;
  CS.ns += ns_since(t0);
}

// ------------------------------------------------------------------ programs

enum Source : uint8_t { ENV = 0, OWN = 1, ASIS = 2 };
enum Protect : uint8_t { NONE = 0, SCRATCH = 1, CLONE = 2 };
enum OutKind : uint8_t { OUT_ENV = 0, OUT_TARGET = 1 };

struct ArgPlan {
  int slot;
  Source source;
  int step, leaf;  // ENV: the output of an earlier step
  bool live;       // OWN: the storage must hold bytes (else the tensor is gone)
  bool fresh;      // a new view even where a tensor at hand is that view (the call writes it)
  Protect protect;
  at::Tensor scratch;
  at::ScalarType dtype;
  int64_t offset;
  std::vector<int64_t> size, stride;
};

struct OutPlan {
  int leaf;
  OutKind kind;
  int target;
};

struct Step {
  int64_t key;
  bool random;
  std::vector<ArgPlan> args;
  std::vector<OutPlan> outs;
  std::string what;  // for errors: the call and its op
};

// Owned by the Python executor that built it (its scratch tensors with it).
struct Program {
  std::vector<Step> steps;
};

[[noreturn]] void fail(const std::string& why) { throw std::runtime_error("vsim replay: " + why); }

bool is_view(const at::Tensor& t, const c10::StorageImpl* st, const ArgPlan& a) {
  return t.defined() && t.has_storage() && t.storage().unsafeGetStorageImpl() == st &&
         t.scalar_type() == a.dtype && t.storage_offset() == a.offset && t.sizes().equals(a.size) &&
         t.strides().equals(a.stride);
}

at::Tensor view_of(const c10::intrusive_ptr<c10::StorageImpl>& st, const ArgPlan& a,
                   const Step& s) {
  const size_t item = c10::elementSize(a.dtype);
  if (at::detail::computeStorageNbytes(a.size, a.stride, item, static_cast<size_t>(a.offset)) >
      st->nbytes())
    fail(s.what + " reads a view its storage is too small for (" + std::to_string(st->nbytes()) +
         " bytes)");
  auto key = c10::computeDispatchKey(a.dtype, at::kStrided, st->device());
  at::Tensor v = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(st), c10::DispatchKeySet(key), c10::scalarTypeToTypeMeta(a.dtype));
  v.unsafeGetTensorImpl()->set_sizes_and_strides(a.size, a.stride, a.offset);
  return v;
}


struct Env {
  c10::intrusive_ptr<c10::StorageImpl> st;
  at::Tensor made;  // the tensor the step returned there (none once swapped into a target)
};

at::Tensor resolve(const ArgPlan& a, const Capture& cap, const std::vector<std::vector<Env>>& env,
                   const Step& s) {
  if (a.slot < 0 || a.slot >= static_cast<int>(cap.in.size()))
    fail(s.what + ": argument slot " + std::to_string(a.slot) + " not captured");
  const Ref& ref = cap.in[a.slot];
  at::Tensor x;
  if (a.source == ASIS) {
    auto t = ref.t.lock();
    if (!t) fail(s.what + " reads a constant that is gone");
    x = at::Tensor(std::move(t));
  } else {
    c10::intrusive_ptr<c10::StorageImpl> st;
    at::Tensor made;
    if (a.source == ENV) {
      if (a.step < 0 || a.step >= static_cast<int>(env.size()) ||
          a.leaf >= static_cast<int>(env[a.step].size()) || !env[a.step][a.leaf].st)
        fail(s.what + " reads an output the replay did not make");
      st = env[a.step][a.leaf].st;
      made = env[a.step][a.leaf].made;
    } else {
      st = ref.st.lock();
      if (!st || (a.live && st->nbytes() == 0))
        fail(s.what + " reads a tensor that is no longer on the GPU");
    }
    if (!a.fresh) {
      if (is_view(made, st.get(), a)) {
        x = made;
      } else if (auto t = ref.t.lock()) {
        at::Tensor own(std::move(t));
        if (is_view(own, st.get(), a)) x = own;
      }
    }
    if (!x.defined()) x = view_of(st, a, s);
  }
  if (a.protect == SCRATCH) return a.scratch;
  if (a.protect == CLONE) return x.clone();
  return x;
}

// Runs program `p`; `tg`: per target of the program, (its storage or null, its size when it
// holds its bytes). Returns the targets rebuilt; adds the calls made to `calls` and the ns
// inside them to `ns`. Also the executor's core's (core.cpp), without Python.
std::vector<int> run(const Program& p,
                     const std::vector<std::pair<c10::StorageImpl*, int64_t>>& tg,
                     int64_t& calls, int64_t& ns) {
  std::vector<std::vector<Env>> env(p.steps.size());
  std::vector<int> rebuilt;
  auto& caps = captures();
  for (size_t i = 0; i < p.steps.size(); ++i) {
    const Step& s = p.steps[i];
    auto it = caps.find(s.key);
    if (it == caps.end() || !it->second.op) fail(s.what + " was not captured this iteration");
    const Capture& cap = it->second;
    std::vector<at::Tensor> slots(cap.in.size());
    for (const ArgPlan& a : s.args) slots.at(a.slot) = resolve(a, cap, env, s);
    torch::jit::Stack stack;
    stack.reserve(cap.args.size());
    for (size_t j = 0; j < cap.layout.size(); ++j) {
      const Layout& l = cap.layout[j];
      if (l.kind == PLAIN) {
        stack.push_back(cap.args[j]);
      } else if (l.kind == TENSOR) {
        if (!slots[l.first].defined()) fail(s.what + ": a tensor argument has no plan");
        stack.emplace_back(slots[l.first]);
      } else if (l.kind == TLIST) {
        c10::List<at::Tensor> xs;
        for (size_t e = 0; e < l.present.size(); ++e) xs.push_back(slots.at(l.first + e));
        stack.emplace_back(std::move(xs));
      } else {
        c10::List<std::optional<at::Tensor>> xs;
        int k = l.first;
        for (bool has : l.present) {
          if (has) {
            xs.push_back(slots.at(k++));
          } else {
            xs.push_back(std::nullopt);
          }
        }
        stack.emplace_back(std::move(xs));
      }
    }
    at::Tensor saved;
    if (s.random) {
      if (!cap.rng.defined()) fail(s.what + " is random and its RNG state was not captured");
      saved = rng_now();
      set_rng(cap.rng);
    }
    const auto t0 = Clock::now();
    try {
      at::AutoDispatchBelowADInplaceOrView below;
      cap.op->callBoxed(&stack);
    } catch (...) {
      if (s.random) set_rng(saved);
      throw;
    }
    ns += ns_since(t0);
    ++calls;
    if (s.random) set_rng(saved);
    // the outputs' leaves, in the order Python's _leaves gives them (lists flattened)
    std::vector<c10::IValue> leaves;
    for (const auto& v : stack) vsim_actions::leaves_of(v, leaves);
    for (const OutPlan& o : s.outs) {
      if (o.leaf >= static_cast<int>(leaves.size()) || !leaves[o.leaf].isTensor())
        fail(s.what + ": output " + std::to_string(o.leaf) + " is not a tensor");
      at::Tensor x = leaves[o.leaf].toTensor();
      if (env[i].size() <= static_cast<size_t>(o.leaf)) env[i].resize(o.leaf + 1);
      if (o.kind == OUT_ENV) {
        env[i][o.leaf] = Env{c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
                                 x.storage().unsafeGetStorageImpl()),
                             x};
        continue;
      }
      auto [tst, n] = tg.at(o.target);
      if (tst == nullptr) continue;
      if (tst->nbytes() == 0) {
        c10::StorageImpl* ost = x.storage().unsafeGetStorageImpl();
        if (static_cast<int64_t>(ost->nbytes()) != n)
          fail(s.what + " rebuilt a tensor of " + std::to_string(ost->nbytes()) +
               " bytes for one of " + std::to_string(n));
        vsim_swap_storages(tst, ost);
        rebuilt.push_back(o.target);
      }
      env[i][o.leaf] = Env{c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(tst), at::Tensor()};
    }
  }
  return rebuilt;
}

// run() for Python: `targets` as [(storage or None, nbytes)]; returns (targets rebuilt, calls
// made, ns inside the calls).
py::tuple replay(const Program& p, py::list targets) {
  std::vector<std::pair<c10::StorageImpl*, int64_t>> tg;
  for (auto h : targets) {
    auto pair = h.cast<py::tuple>();
    c10::StorageImpl* st = nullptr;
    if (!pair[0].is_none()) {
      if (!THPStorage_Check(pair[0].ptr())) throw std::invalid_argument("replay: UntypedStorages");
      st = THPStorage_Unpack(pair[0].ptr()).unsafeGetStorageImpl();
    }
    tg.emplace_back(st, pair[1].cast<int64_t>());
  }
  int64_t calls = 0, ns = 0;
  std::vector<int> rebuilt = run(p, tg, calls, ns);
  return py::make_tuple(rebuilt, calls, ns);
}

// The Program a Python object holds (for the core, where Program is an incomplete type).
const Program* program_of(py::handle h) { return &h.cast<const Program&>(); }

// A program from recompute.py's _ProgramLog: per step (frame key, random, description, args,
// outs); args (slot, source, step, leaf, live, fresh, protect, scratch or None, dtype, offset,
// sizes, strides); outs (leaf, kind, target).
Program make_program(py::list steps) {
  Program p;
  for (auto hs : steps) {
    auto t = hs.cast<py::tuple>();
    Step s;
    s.key = t[0].cast<int64_t>();
    s.random = t[1].cast<bool>();
    s.what = t[2].cast<std::string>();
    for (auto ha : t[3].cast<py::list>()) {
      auto a = ha.cast<py::tuple>();
      ArgPlan ap;
      ap.slot = a[0].cast<int>();
      ap.source = static_cast<Source>(a[1].cast<int>());
      ap.step = a[2].cast<int>();
      ap.leaf = a[3].cast<int>();
      ap.live = a[4].cast<bool>();
      ap.fresh = a[5].cast<bool>();
      ap.protect = static_cast<Protect>(a[6].cast<int>());
      if (!a[7].is_none()) ap.scratch = a[7].cast<at::Tensor>();
      if (!THPDtype_Check(a[8].ptr())) throw std::invalid_argument("add_program: a torch.dtype");
      ap.dtype = reinterpret_cast<THPDtype*>(a[8].ptr())->scalar_type;
      ap.offset = a[9].cast<int64_t>();
      ap.size = a[10].cast<std::vector<int64_t>>();
      ap.stride = a[11].cast<std::vector<int64_t>>();
      s.args.push_back(std::move(ap));
    }
    for (auto ho : t[4].cast<py::list>()) {
      auto o = ho.cast<py::tuple>();
      s.outs.push_back(OutPlan{o[0].cast<int>(), static_cast<OutKind>(o[1].cast<int>()),
                               o[2].cast<int>()});
    }
    p.steps.push_back(std::move(s));
  }
  return p;
}

void set_rng_device(py::object device) {
  if (device.is_none()) {
    rng_device.reset();
  } else {
    rng_device = device.cast<c10::Device>();
  }
}

std::pair<int64_t, int64_t> captured() { return {CS.captured, CS.ns}; }

}  // namespace vsim_replay

void init_replay(py::module& m) {
  using namespace vsim_replay;
  py::class_<Program>(m, "Program");
  m.def("program", torch::wrap_pybind_function(make_program),
        "a compiled replay from recompute.py's _ProgramLog");
  m.def("replay", torch::wrap_pybind_function(replay),
        "replay(program, [(storage or None, nbytes)] per target) -> (targets rebuilt, calls, ns)");
  m.def("set_rng_device", &set_rng_device, "the device whose RNG random calls draw from");
  m.def("captured", &captured, "(frames captured, ns capturing) this iteration");
}
