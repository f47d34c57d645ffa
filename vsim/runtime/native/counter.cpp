// vsim's native op tracker: counts the iteration's dispatcher calls in C++ and calls back into
// Python only at the calls where the executor acts (vsim/runtime/native/__init__.py).
//
// A boxed fallback on the TESTING_ONLY_GenericMode dispatch key, which no part of PyTorch uses
// outside its tests. The key is put in the thread's included dispatch keys while an iteration
// runs; PyTorch carries that thread-local set into the autograd engine's threads, so backward's
// calls are counted too. A Python TorchDispatchMode costs ~40 us per aten call on the host; this
// fallback 1.2-3.6 us on the lent hosts (validation/host/waits/; a RecordFunction observer, the
// profiler's hook, was tried in its place and cost as much or more: waits/observer/).
//
// Single iteration at a time: the forward thread and the autograd thread never dispatch at the
// same time in a training step (backward() blocks its caller), so the state is plain globals.

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/autograd/function.h>
#include <torch/library.h>
#include <ATen/Operators.h>
#include <ATen/core/boxing/impl/boxing.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#ifndef VSIM_NO_REPLAY
namespace vsim_replay {  // replay.cpp
void clear();
at::Tensor rng_now();
void capture(int64_t key, const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
             at::Tensor rng);
}  // namespace vsim_replay
#endif

namespace vsim_core {  // core.cpp: the executor's plan in C++, where an executor armed one
bool is_armed();
void at_count(int64_t c, const c10::OperatorHandle& op, torch::jit::Stack* stack, bool post);
void saved(int64_t t, const at::Tensor& x);
bool frame_outputs(int64_t key, const c10::OperatorHandle& op, torch::jit::Stack* stack);
}  // namespace vsim_core

// Swaps two storages' memory (data pointer and size); also the compiled replay's (replay.cpp).
void vsim_swap_storages(c10::StorageImpl* x, c10::StorageImpl* y) {
  const size_t nx = x->nbytes(), ny = y->nbytes();
  at::DataPtr py_ = y->set_data_ptr(at::DataPtr(nullptr, y->device()));
  at::DataPtr px_ = x->set_data_ptr(std::move(py_));
  y->set_data_ptr(std::move(px_));
  x->set_nbytes(ny);
  y->set_nbytes(nx);
}

namespace {

constexpr auto KEY = c10::DispatchKey::TESTING_ONLY_GenericMode;

// OFF: a gated backward node's last count the executor acts at; its calls after it run without
// the tracker (Gate)
enum Flag : uint8_t { PRE = 1, POST = 2, FRAMES = 4, SAVES = 8, OFF = 16 };
// frame flags of the compiled replay (replay.cpp): capture the frame's arguments, and its RNG
// state before it runs; OUTS: call back after it with its outputs alone (a frame watched only
// for the trace tensors it returns, such as batch norm's saved statistics: its arguments made
// into Python objects were most of a call back's cost)
enum CaptureFlag : uint8_t { CAPTURE = 8, CAPTURE_RNG = 16, OUTS = 32 };

// Frames: within a counted call, the calls made above autograd (the counted call itself, the
// calls a composite decomposes into, autocast's casts): the calls a Python dispatch mode sees,
// and the composites they come from. Numbered per counted call in the order they start; a
// recording executor is called back at some of them with their arguments (recomputation
// replays them; docs/design.md, "The native op tracker").
inline int64_t frame_key(int64_t c, int64_t j) { return (c << 20) | j; }

struct State {
  int64_t count = 0;
  bool paused = false;       // the executor's own calls (inside callbacks) are not counted
  bool fast = false;         // the unboxed kernels of common operators count their calls (Fast)
  bool calibrating = false;  // record every call's name and where it ended
  std::vector<std::string> names;  // calibrating: call c's operator name
  std::vector<uint8_t> flags;      // armed: PRE / POST per count
  std::unordered_map<int64_t, std::string> expect;  // armed: the name each target must have
  py::object callback;             // armed: callback(count, outputs or None, is_post)
  std::string diverged;            // armed: the first mismatch, empty if none
  // calibrating: every frame as (count, number, operator name, parent frame or -1)
  std::vector<std::tuple<int64_t, int64_t, std::string, int64_t>> frames;
  std::unordered_map<int64_t, uint8_t> frame_flags;         // armed: frame_key -> PRE | POST
  std::unordered_map<int64_t, int64_t> frame_count;         // armed: count -> its frames
  std::unordered_map<int64_t, std::string> frame_expect;    // armed: frame_key -> its name
  py::object frame_callback;  // armed: frame_callback(count, frame, name, args, kwargs, outputs,
                              // post)
};

State S;

std::string name_of(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.name + "." + (n.overload_name.empty() ? std::string("default") : n.overload_name);
}

// The same operator, its in-place and out-of-place forms taken as one: autograd accumulates a
// gradient in place when nothing else holds the buffer, which a Python tracker's references
// (the calibration's) can change (aten::add.Tensor then, aten::add_.Tensor now).
//
// And where PyTorch's backward takes another path when a Python dispatch mode is on (its
// composite-compliance checks count a mode as a tensor subclass): index's backward calls
// aten::index_put under the calibration's mode, aten::_index_put_impl_ without it (swin_t on
// the H100).
std::string base_of(const std::string& name) {
  auto dot = name.find('.');
  std::string op = name.substr(0, dot);
  if (!op.empty() && op.back() == '_') op.pop_back();
  if (op == "aten::_index_put_impl" || op == "aten::index_put") return "aten::index_put";
  // reshape's view: `_reshape_alias` natively, `view` under a Python dispatch mode (which
  // reshape treats as a tensor subclass), the calibrating iteration's (torch 2.11; maxvit_t)
  if (op == "aten::_reshape_alias") return "aten::view.default";
  return op + (dot == std::string::npos ? std::string() : name.substr(dot));
}

py::object outputs_of(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  size_t n = op.schema().returns().size();
  if (n == 1) return torch::jit::toPyObject(stack->back());
  py::tuple t(n);
  for (size_t i = 0; i < n; ++i)
    t[i] = torch::jit::toPyObject((*stack)[stack->size() - n + i]);
  return t;
}

void fail(const std::string& why) {
  if (S.diverged.empty()) S.diverged = why;
  throw std::runtime_error("vsim native tracker: the run diverged: " + S.diverged);
}

// `got` is the operator calibration saw as `want` (in-place and out-of-place as one), else the
// run diverged; `what` names the place.
void expect_name(const c10::OperatorHandle& op, const std::string& want, const std::string& what) {
  std::string got = name_of(op);
  if (got != want && base_of(got) != base_of(want))
    fail(what + " is " + got + ", calibration's was " + want);
}

// Runs `call` (a call into Python) as the executor's own: uncounted, the key excluded for what
// it dispatches, the GIL held. A Python exception stops the dispatch; the Python side keeps it
// (vsim.runtime.nativerun) and raises it again where the step returns.
// The count paused while the executor's own work runs, resumed as it was however it ends.
struct Paused {
  bool was = S.paused;
  Paused() { S.paused = true; }
  ~Paused() { S.paused = was; }
};

template <typename F>
void in_python(F&& call) {
  Paused paused;
  c10::impl::ExcludeDispatchKeyGuard own(KEY);
  py::gil_scoped_acquire gil;
  try {
    call();
  } catch (py::error_already_set& e) {
    throw std::runtime_error(std::string("vsim native tracker: callback raised: ") + e.what());
  }
}

// call backs at counts this iteration and the nanoseconds they took: the crossing into Python
// (the GIL, the outputs made Python objects, the call) with the executor's work inside it, which
// the executor times on its side (its `callback_py_us`): the difference is what the crossings
// alone cost, outside every other timer
int64_t cb_n = 0, cb_ns = 0;

// A call back counted in `n` and its nanoseconds added to `ns`, where it raises too.
struct Timed {
  int64_t& n;
  int64_t& ns;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~Timed() {
    ++n;
    ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
              std::chrono::steady_clock::now() - t0).count();
  }
};

// Runs `call` (the executor's core, core.cpp) as the executor's own: uncounted, the key
// excluded for what it dispatches. The core enters Python itself where a hook of the plan's
// runs there; a Python exception there stops the dispatch as in in_python.
template <typename F>
void in_core(F&& call) {
  Paused paused;
  c10::impl::ExcludeDispatchKeyGuard own(KEY);
  try {
    call();
  } catch (py::error_already_set& e) {
    std::string what;
    {
      py::gil_scoped_acquire gil;
      what = e.what();
    }
    throw std::runtime_error("vsim native tracker: callback raised: " + what);
  }
}

void call_back(int64_t c, const c10::OperatorHandle& op, torch::jit::Stack* stack, bool post) {
  auto it = S.expect.find(c);
  if (it != S.expect.end()) expect_name(op, it->second, "call " + std::to_string(c));
  Timed timed{cb_n, cb_ns};
  if (vsim_core::is_armed()) {  // outputs registered and ops advanced in C++
    in_core([&] { vsim_core::at_count(c, op, stack, post); });
    return;
  }
  in_python([&] { S.callback(c, post ? outputs_of(op, stack) : py::none(), post); });
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

// An argument as a Python dispatch mode receives it: dtypes, layouts and memory formats (ints in
// an IValue) as their Python objects.
py::object argument(const c10::Argument& a, const c10::IValue& v) {
  if (v.isInt()) {
    c10::TypePtr t = a.real_type();
    if (auto o = t->cast<c10::OptionalType>()) t = o->getElementType();
    switch (t->kind()) {
      case c10::TypeKind::ScalarTypeType:
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt()))));
      case c10::TypeKind::LayoutType:
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<at::Layout>(v.toInt()))));
      case c10::TypeKind::MemoryFormatType:
        return py::reinterpret_borrow<py::object>(
            torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt())));
      default:
        break;
    }
  }
  return torch::jit::toPyObject(v);
}

std::pair<py::tuple, py::dict> arguments(const c10::OperatorHandle& op,
                                         const std::vector<c10::IValue>& values) {
  const auto& schema = op.schema().arguments();
  std::vector<py::object> positional;
  py::dict kwargs;
  for (size_t i = 0; i < schema.size() && i < values.size(); ++i) {
    if (schema[i].kwarg_only())
      kwargs[py::str(schema[i].name())] = argument(schema[i], values[i]);
    else
      positional.push_back(argument(schema[i], values[i]));
  }
  py::tuple args(positional.size());
  for (size_t i = 0; i < positional.size(); ++i) args[i] = positional[i];
  return {args, kwargs};
}

// Frames of the counted call running on this thread (see FRAMES): the counted call, its number,
// the next frame's number, the frames running.
thread_local bool framing = false;
thread_local int64_t frame_c = -1;
thread_local int64_t next_frame = 0;
thread_local std::vector<int64_t> running;

// frame call backs this iteration and the nanoseconds they took (their arguments made into
// Python objects and the Python call)
int64_t frame_cb_n = 0, frame_cb_ns = 0;

void frame_call_back(int64_t c, int64_t j, const c10::OperatorHandle& op,
                     const std::vector<c10::IValue>* args, torch::jit::Stack* stack) {
  Timed timed{frame_cb_n, frame_cb_ns};
  in_python([&] {
    if (args == nullptr) {
      S.frame_callback(c, j, py::none(), py::none(), py::none(), py::none(), false);
      return;
    }
    // as a Python dispatch mode receives them: positional and keyword-only arguments, and the
    // operator that ran (its in-place form where calibration saw the out-of-place one: linear
    // adds its bias in place without a mode, out of place under one)
    auto ak = arguments(op, *args);
    S.frame_callback(c, j, name_of(op), ak.first, ak.second, outputs_of(op, stack), true);
  });
}

// After a frame flagged OUTS: its outputs alone, name and arguments None.
void outputs_call_back(int64_t c, int64_t j, const c10::OperatorHandle& op,
                       torch::jit::Stack* stack) {
  Timed timed{frame_cb_n, frame_cb_ns};
  if (vsim_core::is_armed()) {  // its watched outputs registered in C++, where that is all
    bool done = false;
    in_core([&] { done = vsim_core::frame_outputs(frame_key(c, j), op, stack); });
    if (done) return;
  }
  in_python([&] {
    S.frame_callback(c, j, py::none(), py::none(), py::none(), outputs_of(op, stack), true);
  });
}

struct Running {
  explicit Running(int64_t j) { running.push_back(j); ++depth; }
  ~Running() { running.pop_back(); --depth; }
};

// One frame: numbered, called back where armed, run. Calls it makes above autograd are frames
// of their own (a composite's parts); below autograd (its kernels' own calls, what a Python mode
// never sees) they are not. A call without autograd keys (a factory function) has no frames
// inside: a Python mode sees it whole.
void run_frame(const c10::OperatorHandle& op, c10::DispatchKeySet ks, c10::DispatchKeySet after,
               torch::jit::Stack* stack) {
  const int64_t c = frame_c;
  const int64_t j = next_frame++;
  uint8_t ff = 0;
  if (S.calibrating) {
    S.frames.emplace_back(c, j, name_of(op), running.empty() ? -1 : running.back());
  } else if (!S.frame_flags.empty()) {
    auto it = S.frame_flags.find(frame_key(c, j));
    if (it != S.frame_flags.end()) {
      ff = it->second;
      expect_name(op, S.frame_expect[frame_key(c, j)],
                  "frame " + std::to_string(j) + " of call " + std::to_string(c));
    }
  }
  std::vector<c10::IValue> args;
  if (ff & (POST | CAPTURE)) {
    const size_t n = op.schema().arguments().size();
    args.assign(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  }
  if (ff & PRE) frame_call_back(c, j, op, nullptr, stack);
#ifndef VSIM_NO_REPLAY
  at::Tensor rng;
  if (ff & CAPTURE_RNG) rng = vsim_replay::rng_now();
#endif
  {
    Running r(j);
    if (!ks.has_any(c10::autograd_dispatch_keyset)) {
      c10::impl::ExcludeDispatchKeyGuard inner(KEY);
      op.redispatchBoxed(after, stack);
    } else {
      op.redispatchBoxed(after, stack);
    }
  }
#ifndef VSIM_NO_REPLAY
  if (ff & CAPTURE) vsim_replay::capture(frame_key(c, j), op, args, std::move(rng));
#endif
  if (ff & POST) {
    frame_call_back(c, j, op, &args, stack);
  } else if (ff & OUTS) {
    outputs_call_back(c, j, op, stack);
  }
}

struct Framing {
  explicit Framing(int64_t c) {
    framing = true;
    frame_c = c;
    next_frame = 0;
  }
  ~Framing() { framing = false; }
};

// The saved-tensor hooks of armed iterations, in C++: a Python pack hook cost 4-9 us per saved
// tensor on the lent hosts (executed.executor_pack_us: 12 ms of a 143 ms resnet101 iteration),
// and even this C++ one costs 4.6-8.6 us per save, since autograd calls it through its Python
// hook machinery (validation/host/waits/). So they are on only from the start of a counted call
// whose count has a save the plan acts on (flag SAVES) until the next counted call starts
// (hooks_at), or, with VSIM_NATIVE_HOOKS=always, throughout (pushed from Python). A save is
// numbered within the count it happens at, as calibration saw it (frame_key(count, number)).
// Pack calls back into Python only at the saves where calibration found a tensor the plan acts
// on (callback(trace tensor, tensor)), and returns the tensor detached (a saved output kept with
// its grad_fn is a reference cycle only backward breaks; see executor.py). Unpack returns what
// pack returned.
struct Packs {
  int64_t n = 0;
  int64_t ns = 0;
  int64_t at = -1;  // the count of the saves being numbered, and the next one's number
  int64_t k = 0;
  std::unordered_map<int64_t, int64_t> flagged;  // frame_key(count, number) -> trace tensor
  bool per_call = true;  // hooks on around the calls flagged SAVES, else throughout (Python's)
  bool at_zero = false;  // a flagged save before the first counted call
  bool hooked = false;   // per call: the hooks are on, pushed on thread `thread`
  std::thread::id thread;
  py::object callback, on, off;  // on(): push the hooks; off(): pop them
};

Packs P;

void set_hooks(bool on) {
  py::gil_scoped_acquire gil;
  try {
    if (on) P.on(); else P.off();
  } catch (py::error_already_set& e) {
    throw std::runtime_error(std::string("vsim native tracker: saved-tensor hooks: ") + e.what());
  }
  P.hooked = on;
  if (on) P.thread = std::this_thread::get_id();
}

// A counted call with flags f starts: the hooks of the count before (if on) off, those of its
// own count on where the plan acts on a save there (SAVES). Hooks pushed on the forward thread
// stay on through backward (the autograd thread holds a copy; there are no saves there) until
// end() pops them.
void hooks_at(uint8_t f) {
  if (!P.per_call) return;
  if (P.hooked) {
    if (P.thread != std::this_thread::get_id()) return;
    set_hooks(false);
  }
  if (f & SAVES) set_hooks(true);
}

at::Tensor do_pack(const at::Tensor& t) {
  const auto t0 = std::chrono::steady_clock::now();
  ++P.n;
  if (P.at != S.count) {
    P.at = S.count;
    P.k = 0;
  }
  const int64_t i = frame_key(S.count, P.k++);
  const bool was = S.paused;
  S.paused = true;  // what the hook dispatches is not the step's
  at::Tensor out;
  try {
    c10::impl::ExcludeDispatchKeyGuard own(KEY);
    if (!P.flagged.empty()) {
      auto it = P.flagged.find(i);
      if (it != P.flagged.end()) {
        if (vsim_core::is_armed()) vsim_core::saved(it->second, t);
        else P.callback(it->second, t);
      }
    }
    out = t.detach();
  } catch (...) {
    S.paused = was;
    throw;
  }
  S.paused = was;
  P.ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
              std::chrono::steady_clock::now() - t0).count();
  return out;
}

at::Tensor do_unpack(const at::Tensor& t) { return t; }

void do_arm_packs(std::unordered_map<int64_t, int64_t> flagged, py::object callback,
                  py::object on, py::object off, bool per_call) {
  P.n = 0;
  P.ns = 0;
  P.at = -1;
  P.k = 0;
  P.flagged = std::move(flagged);
  P.callback = std::move(callback);
  P.on = std::move(on);
  P.off = std::move(off);
  P.per_call = per_call;
  P.at_zero = false;
  for (const auto& kv : P.flagged)
    if ((kv.first >> 20) == 0) P.at_zero = true;
}

// (saves, nanoseconds inside pack) since arm_packs; the callbacks are dropped
std::pair<int64_t, int64_t> do_disarm_packs() {
  P.flagged.clear();
  P.callback = py::object();
  P.on = py::object();
  P.off = py::object();
  return {P.n, P.ns};
}


// Backward's nodes gated (docs/design.md, "The gated backward"): most of a training step's
// counted calls are backward's (densenet201: 4,155 of 5,114), and few of its nodes hold a call
// the executor acts at. At backward's first counted call inside a node (its root, the loss's
// node) the graph is walked from that node in a fixed order (depth first along next_edges), and
// every other node gets a C++ pre-hook. Calibrating, the hooks note each node's span of counts
// (pre-hook to post-hook). Armed with a gate, a node holding a flagged count starts counting at
// its calibrated count with the key included; every other node runs with the key excluded, so
// its calls never pass the tracker. The autograd engine sets each node's task's thread-local
// dispatch keys from backward's caller, so a pre-hook's choice lasts that node's task only. The
// first counted call outside every node after backward (the optimizer's) resumes at
// calibration's count. A graph of another size than calibration's is counted whole, as before.
// Within a gated node, the calls after its last flagged count (OFF) run without the key too.
struct Gate {
  int phase = 0;     // 0 before backward, 1 in it (walked), 2 after
  bool armed = false;
  bool active = false;                // this iteration gates its backward
  std::vector<int64_t> start;         // armed: per node, its first count where gated, else -1
  std::vector<int64_t> sync;          // armed: per node, the count its end syncs to, else -1
  int64_t after = -1;                 // armed: calibration's count after backward
  int64_t through = 0;                // calls through the key this iteration
  // calibrating: each node's (first count, count after), -1 where it did not run
  std::vector<std::pair<int64_t, int64_t>> spans;
  int64_t backward_at = -1, after_at = -1, nodes = 0, backwards = 0;
};

Gate G;

struct GatePre : torch::autograd::FunctionPreHook {
  size_t i;
  explicit GatePre(size_t i) : i(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& g) override {
    if (S.calibrating) {
      if (i < G.spans.size()) G.spans[i].first = S.count;
    } else if (i < G.start.size()) {
      const bool on = G.start[i] >= 0;
      if (on) S.count = G.start[i];
      c10::impl::tls_set_dispatch_key_included(KEY, on);
    }
    return g;
  }
};

struct SpanPost : torch::autograd::FunctionPostHook {
  size_t i;
  explicit SpanPost(size_t i) : i(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& out,
                                            const torch::autograd::variable_list&) override {
    if (i < G.spans.size()) G.spans[i].second = S.count;
    return out;
  }
};

// A node followed by a flagged count outside every node (the engine's gradient sums, made
// after the node's post hooks in its task): at its end the count is calibration's there and
// the key on, whether the node ran counted or not, so those sums are counted as calibrated.
struct GateSync : torch::autograd::FunctionPostHook {
  size_t i;
  explicit GateSync(size_t i) : i(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& out,
                                            const torch::autograd::variable_list&) override {
    if (G.active && i < G.sync.size() && G.sync[i] >= 0) {
      S.count = G.sync[i];
      c10::impl::tls_set_dispatch_key_included(KEY, true);
    }
    return out;
  }
};

// The graph from backward's root, depth first along next_edges, root first.
std::vector<torch::autograd::Node*> walk(torch::autograd::Node* root) {
  std::vector<torch::autograd::Node*> order;
  std::unordered_set<torch::autograd::Node*> seen{root};
  std::vector<torch::autograd::Node*> stack{root};
  while (!stack.empty()) {
    auto* n = stack.back();
    stack.pop_back();
    order.push_back(n);
    const auto& edges = n->next_edges();
    for (auto e = edges.rbegin(); e != edges.rend(); ++e) {
      auto* m = e->function.get();
      if (m != nullptr && seen.insert(m).second) stack.push_back(m);
    }
  }
  return order;
}

// At every counted call of a calibrating or gate-armed iteration: where backward starts (the
// first call inside a node) and ends (the first call outside every node after it).
void gate_at_call() {
  if (!S.calibrating && !G.armed) return;
  auto node = torch::autograd::get_current_node();
  if (G.phase == 0) {
    if (!node) return;
    G.phase = 1;
    auto order = walk(node.get());
    if (S.calibrating) {
      G.backward_at = S.count;
      G.nodes = static_cast<int64_t>(order.size());
      G.spans.assign(order.size(), {-1, -1});
      G.spans[0].first = S.count;
      for (size_t i = 0; i < order.size(); ++i) {
        if (i > 0) order[i]->add_pre_hook(std::make_unique<GatePre>(i));
        order[i]->add_post_hook(std::make_unique<SpanPost>(i));
      }
      return;
    }
    G.active = static_cast<int64_t>(order.size()) == G.nodes;
    if (G.active)
      for (size_t i = 0; i < order.size(); ++i) {
        if (i > 0) order[i]->add_pre_hook(std::make_unique<GatePre>(i));
        if (i < G.sync.size() && G.sync[i] >= 0)
          order[i]->add_post_hook(std::make_unique<GateSync>(i));
      }
  } else if (G.phase == 1) {
    if (node) return;
    G.phase = 2;
    if (S.calibrating) G.after_at = S.count;
    else if (G.active) S.count = G.after;
  } else if (node && S.calibrating) {
    ++G.backwards;  // a second backward: calibration says so, and nothing is gated
    G.phase = 1;
  }
}

uint8_t flags_of(int64_t c) {
  return c < static_cast<int64_t>(S.flags.size()) ? S.flags[c] : 0;
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto after = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, KEY);
  if (S.paused || op.operator_name().name.rfind("profiler::", 0) == 0) {
    op.redispatchBoxed(after, stack);
    return;
  }
  if (depth > 0) {
    if (framing && !c10::impl::tls_is_dispatch_key_excluded(
                       c10::DispatchKey::AutogradFunctionality)) {
      run_frame(op, ks, after, stack);
    } else {
      op.redispatchBoxed(after, stack);
    }
    return;
  }
  gate_at_call();
  ++G.through;
  const int64_t c = S.count++;
  uint8_t f = 0;
  if (S.calibrating) {
    S.names.push_back(name_of(op));
    f = FRAMES;
    if (S.callback) f |= POST;  // calibration sees every counted call's outputs
  } else {
    f = flags_of(c);
  }
  hooks_at(f);
  if (f & PRE) call_back(c, op, stack, false);
  if (f & FRAMES) {
    int64_t n;
    {
      Framing fr(c);
      run_frame(op, ks, after, stack);
      n = next_frame;
    }
    if (!S.calibrating) {
      auto it = S.frame_count.find(c);
      if (it != S.frame_count.end() && it->second != n)
        fail("call " + std::to_string(c) + " (" + name_of(op) + ") made " + std::to_string(n) +
             " frames, calibration's " + std::to_string(it->second));
    }
  } else {
    Depth d;
    // calls made inside this one skip the key altogether: a boxed fallback costs every call it
    // sees a boxing and unboxing of its arguments, and inner calls are not counted anyway
    c10::impl::ExcludeDispatchKeyGuard inner(KEY);
    op.redispatchBoxed(after, stack);
  }
  if (f & POST) call_back(c, op, stack, true);
  if ((f & OFF) && G.active) c10::impl::tls_set_dispatch_key_included(KEY, false);
}

// The common operators' calls counted without boxing (opt-in: set_fast): an unboxed kernel per
// operator on the same key counts a call the executor does not act at and redispatches it as
// it came, where the boxed fallback boxes and unboxes its arguments (1.2-3.6 us per call on the
// lent hosts, validation/host/waits/). Everything else (a call the executor acts at, framing,
// calibration, and every operator not listed) goes to the fallback, boxed as the dispatcher
// boxes for any boxed kernel.
template <class Op, class Sig>
struct Fast;

template <class Op, class R, class... A>
struct Fast<Op, R(A...)> {
  static R call(c10::DispatchKeySet ks, A... a) {
    const auto after = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, KEY);
    if (S.fast && depth == 0 && !S.paused && !S.calibrating) gate_at_call();
    const uint8_t f = S.fast ? flags_of(S.count) : 0;
    if (S.fast && depth == 0 && !S.paused && !S.calibrating && !(f & (PRE | POST | FRAMES))) {
      ++S.count;
      ++G.through;
      hooks_at(f);
      Depth d;
      c10::impl::ExcludeDispatchKeyGuard inner(KEY);
      return Op::redispatch(after, std::forward<A>(a)...);
    }
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
    return c10::impl::BoxedKernelWrapper<R(A...)>::call(
        c10::BoxedKernel::makeFromFunction<&fallback>(), op, ks, std::forward<A>(a)...);
  }
};

template <class Op>
void fast(torch::Library& m, const char* name) {
  m.impl(name, &Fast<Op, typename Op::schema>::call);
}

void do_set_fast(bool on) { S.fast = on; }

// Forward gated by module hooks (vsim.runtime.fwdgate; opt-in, VSIM_NATIVE_FWD_GATE=modules): a
// module call in which the executor acts at no count runs with the tracker's key excluded, its
// count set to calibration's after it. Entered only at calibration's first count of the call,
// outside every counted call, with the key included (else the call is counted as before: a run
// that diverged shows it at its flagged counts). The saved-tensor hooks of the count before
// go off first: a save inside the call would be numbered as that count's.
bool do_gate_forward(int64_t start) {
  if (S.paused || depth > 0 || S.count != start ||
      !c10::impl::tls_is_dispatch_key_included(KEY))
    return false;
  hooks_at(0);
  c10::impl::tls_set_dispatch_key_included(KEY, false);
  return true;
}

void do_ungate_forward(int64_t end) {
  S.count = end;
  c10::impl::tls_set_dispatch_key_included(KEY, true);
}

void do_begin() {
#ifndef VSIM_NO_REPLAY
  vsim_replay::clear();
#endif
  S.count = 0;
  S.paused = false;
  S.diverged.clear();
  G.phase = 0;
  G.active = false;
  G.through = 0;
  frame_cb_n = frame_cb_ns = 0;
  cb_n = cb_ns = 0;
  if (S.calibrating) {
    G.spans.clear();
    G.backward_at = G.after_at = -1;
    G.nodes = G.backwards = 0;
    S.names.clear();
    S.frames.clear();
  }
  P.hooked = false;
  c10::impl::tls_set_dispatch_key_included(KEY, true);
  if (P.per_call && P.at_zero) set_hooks(true);
}

void do_end() {
  c10::impl::tls_set_dispatch_key_included(KEY, false);
  if (P.hooked && P.thread == std::this_thread::get_id()) set_hooks(false);
  P.hooked = false;
}

bool do_pause(bool on) {
  bool was = S.paused;
  S.paused = on;
  return was;
}

int64_t do_count() { return S.count; }

int do_depth() { return depth; }

void do_calibrate(bool on) { S.calibrating = on; }


std::vector<std::string> do_recorded() { return S.names; }

std::vector<std::tuple<int64_t, int64_t, std::string, int64_t>> do_frames() { return S.frames; }

// The frame running on this thread (count, number), or (-1, -1).
std::pair<int64_t, int64_t> do_frame() {
  if (!framing || running.empty()) return {-1, -1};
  return {frame_c, running.back()};
}

void do_arm_frames(std::unordered_map<int64_t, uint8_t> flags,
                   std::unordered_map<int64_t, int64_t> count,
                   std::unordered_map<int64_t, std::string> expect, py::object callback) {
  S.frame_flags = std::move(flags);
  S.frame_count = std::move(count);
  S.frame_expect = std::move(expect);
  S.frame_callback = std::move(callback);
}

void do_arm(py::bytes flags, std::unordered_map<int64_t, std::string> expect, py::object callback) {
  std::string f = flags;
  S.flags.assign(f.begin(), f.end());
  S.expect = std::move(expect);
  S.callback = std::move(callback);
}

// Gate backward's nodes (see Gate): per node (walk order) its first count where it holds a
// call the executor acts at, else -1; calibration's count after backward.
void do_arm_gate(std::vector<int64_t> start, int64_t after, std::vector<int64_t> sync) {
  G.nodes = static_cast<int64_t>(start.size());
  G.start = std::move(start);
  G.sync = std::move(sync);
  G.after = after;
  G.armed = true;
}

// calibration: (each node's (first count, count after), backward's first count, the count after
// it, further backwards)
std::tuple<std::vector<std::pair<int64_t, int64_t>>, int64_t, int64_t, int64_t> do_nodes() {
  return {G.spans, G.backward_at, G.after_at, G.backwards};
}

// (frame call backs, nanoseconds in them) this iteration
std::pair<int64_t, int64_t> do_frame_calls() { return {frame_cb_n, frame_cb_ns}; }

// (call backs at counts, ns in them) this iteration
std::pair<int64_t, int64_t> do_callbacks() { return {cb_n, cb_ns}; }

// (whether this iteration gated its backward, calls through the key)
std::pair<bool, int64_t> do_gated() { return {G.active, G.through}; }

void do_disarm() {
  G.armed = false;
  G.active = false;
  G.start.clear();
  G.sync.clear();
  S.frame_flags.clear();
  S.frame_count.clear();
  S.frame_expect.clear();
  S.frame_callback = py::object();
  S.flags.clear();
  S.expect.clear();
  S.callback = py::object();
}

std::string do_diverged() { return S.diverged; }

// Swaps the memory (data pointer and size) of two storages of one device: a recomputation
// rebuilds a dropped tensor in place this way, where autograd's saved tensors hold its
// storage, without a copy. What UntypedStorage._swap_data_ptr_ does in recent PyTorch; the
// H100's torch 2.11 has no such method, and a copy costs an allocation and a device copy per
// rebuilt tensor.
void do_swap_storages(py::handle a, py::handle b) {
  if (!THPStorage_Check(a.ptr()) || !THPStorage_Check(b.ptr()))
    throw std::invalid_argument("swap_storages: two UntypedStorages");
  c10::StorageImpl* x = THPStorage_Unpack(a.ptr()).unsafeGetStorageImpl();
  c10::StorageImpl* y = THPStorage_Unpack(b.ptr()).unsafeGetStorageImpl();
  if (x->device() != y->device())
    throw std::invalid_argument("swap_storages: storages on different devices");
  vsim_swap_storages(x, y);
}

}  // namespace

void init_actions(py::module& m);  // actions.cpp
void init_core(py::module& m);     // core.cpp
#ifndef VSIM_NO_VIEWS
void init_views(py::module& m);    // views.cpp
#endif
#ifndef VSIM_NO_REPLAY
void init_replay(py::module& m);   // replay.cpp
#endif

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// the operators counted unboxed (Fast): the outermost calls that are most of a CNN's or a
// transformer's training step, forward, backward (autograd's nodes) and optimizer
TORCH_LIBRARY_IMPL(aten, TESTING_ONLY_GenericMode, m) {
  using namespace at::_ops;
  fast<conv2d>(m, "conv2d");
  fast<batch_norm>(m, "batch_norm");
  fast<relu_>(m, "relu_");
  fast<relu>(m, "relu");
  fast<add_Tensor>(m, "add.Tensor");
  fast<add__Tensor>(m, "add_.Tensor");
  fast<mul_Tensor>(m, "mul.Tensor");
  fast<mul__Tensor>(m, "mul_.Tensor");
  fast<mul_Scalar>(m, "mul.Scalar");
  fast<sub_Tensor>(m, "sub.Tensor");
  fast<div_Scalar>(m, "div.Scalar");
  fast<cat>(m, "cat");
  fast<linear>(m, "linear");
  fast<matmul>(m, "matmul");
  fast<mm>(m, "mm");
  fast<bmm>(m, "bmm");
  fast<addmm>(m, "addmm");
  fast<t>(m, "t");
  fast<max_pool2d>(m, "max_pool2d");
  fast<adaptive_avg_pool2d>(m, "adaptive_avg_pool2d");
  fast<avg_pool2d>(m, "avg_pool2d");
  fast<flatten_using_ints>(m, "flatten.using_ints");
  fast<dropout>(m, "dropout");
  fast<layer_norm>(m, "layer_norm");
  fast<gelu>(m, "gelu");
  fast<silu>(m, "silu");
  fast<silu_>(m, "silu_");
  fast<sigmoid>(m, "sigmoid");
  fast<hardtanh_>(m, "hardtanh_");
  fast<hardswish_>(m, "hardswish_");
  fast<hardsigmoid_>(m, "hardsigmoid_");
  fast<softmax_int>(m, "softmax.int");
  fast<scaled_dot_product_attention>(m, "scaled_dot_product_attention");
  fast<embedding>(m, "embedding");
  fast<cross_entropy_loss>(m, "cross_entropy_loss");
  fast<ones_like>(m, "ones_like");
  fast<mean_dim>(m, "mean.dim");
  fast<sum_dim_IntList>(m, "sum.dim_IntList");
  fast<view>(m, "view");
  fast<reshape>(m, "reshape");
  fast<transpose_int>(m, "transpose.int");
  fast<permute>(m, "permute");
  fast<contiguous>(m, "contiguous");
  fast<unsqueeze>(m, "unsqueeze");
  fast<select_int>(m, "select.int");
  fast<slice_Tensor>(m, "slice.Tensor");
  fast<narrow>(m, "narrow");
  fast<expand>(m, "expand");
  fast<split_Tensor>(m, "split.Tensor");
  fast<chunk>(m, "chunk");
  fast<detach>(m, "detach");
  fast<convolution_backward>(m, "convolution_backward");
  fast<native_batch_norm_backward>(m, "native_batch_norm_backward");
  fast<cudnn_batch_norm_backward>(m, "cudnn_batch_norm_backward");
  fast<threshold_backward>(m, "threshold_backward");
  fast<max_pool2d_with_indices_backward>(m, "max_pool2d_with_indices_backward");
  fast<avg_pool2d_backward>(m, "avg_pool2d_backward");
  fast<_adaptive_avg_pool2d_backward>(m, "_adaptive_avg_pool2d_backward");
  fast<nll_loss_backward>(m, "nll_loss_backward");
  fast<_log_softmax_backward_data>(m, "_log_softmax_backward_data");
  fast<gelu_backward>(m, "gelu_backward");
  fast<silu_backward>(m, "silu_backward");
  fast<sigmoid_backward>(m, "sigmoid_backward");
  fast<hardtanh_backward>(m, "hardtanh_backward");
  fast<native_layer_norm_backward>(m, "native_layer_norm_backward");
  fast<native_dropout_backward>(m, "native_dropout_backward");
  fast<fill__Scalar>(m, "fill_.Scalar");
  fast<zero_>(m, "zero_");
  fast<copy_>(m, "copy_");
  fast<to_dtype>(m, "to.dtype");
  fast<_to_copy>(m, "_to_copy");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("begin", &do_begin, "count from 0 on this thread (and the autograd threads it starts)");
  m.def("end", &do_end);
  m.def("pause", &do_pause, "stop or resume counting; returns the previous state");
  m.def("count", &do_count);
  m.def("gate_forward", &do_gate_forward, "a module call untracked from calibration's count "
        "`start` (fwdgate); whether it is");
  m.def("ungate_forward", &do_ungate_forward, "the gated module call ended: the count is `end`");
  m.def("set_fast", &do_set_fast, "count the common operators' calls unboxed (Fast)");
  m.def("depth", &do_depth, "how many counted calls run on this thread (0 or 1)");
  m.def("calibrate", &do_calibrate);
  m.def("recorded", &do_recorded, "calibration: each counted call's operator name");
  m.def("arm", &do_arm);
  m.def("arm_frames", &do_arm_frames, "frames to call back at: frame_key(count, number) -> "
        "1 before / 2 after with arguments / 32 after with outputs only; each framed count's "
        "number of frames; names");
  m.def("frames", &do_frames, "calibration: every frame (count, number, name, parent)");
  m.def("frame", &do_frame, "the frame running on this thread: (count, number) or (-1, -1)");
  m.def("disarm", &do_disarm);
  m.def("diverged", &do_diverged);
  m.def("arm_gate", &do_arm_gate, "gate backward's nodes: per node its first count or -1; "
        "the count after backward; per node the count its end syncs to or -1");
  m.def("nodes", &do_nodes, "calibration: per node (first count, count after), backward's "
        "first count, the count after it, further backwards");
  m.def("frame_calls", &do_frame_calls, "(frame call backs, ns in them) this iteration");
  m.def("callbacks", &do_callbacks, "(call backs at counts, ns in them) this iteration");
  m.def("gated", &do_gated, "(whether the last iteration gated its backward, calls through "
        "the key)");
  m.def("pack", &do_pack, "saved-tensor pack hook of armed iterations (see Packs)");
  m.def("unpack", &do_unpack);
  m.def("arm_packs", &do_arm_packs, "frame_key(count, save number) -> trace tensor to call "
        "back with; callback; push and pop the hooks; per call (else the caller pushes them)");
  m.def("disarm_packs", &do_disarm_packs, "(saves, ns in pack) since arm_packs");
  m.def("swap_storages", &do_swap_storages, "swap two storages' memory (data pointer, size)");
  init_actions(m);
  init_core(m);
#ifndef VSIM_NO_VIEWS
  init_views(m);
#endif
#ifndef VSIM_NO_REPLAY
  init_replay(m);
#endif
}
