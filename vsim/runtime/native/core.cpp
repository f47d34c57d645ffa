// The executor's plan carried out in C++ (vsim/runtime/executor.py's module docstring says what
// each action does; the Python methods there are the reference this follows step by step).
//
// Why: with the offloads, prefetches and waits already one C++ call each (actions.cpp), what
// was left of the runtime's own host time was Python around them: the op-boundary loop, the
// per-tensor state, finding storages, and registering the outputs the plan acts on at each
// call back of the native tracker (0.6-9.9 ms a step, 2-3x the crossings alone; a median own
// share of 8.2%, 14.7% at most, on the eight heaviest H100 cases: validation/runtime/callbacks/).
// Here the plan's tables, the tensors' state and the pinned pool live in C++; the native
// tracker (counter.cpp) registers outputs and advances at its counts without entering Python,
// which it does only for what stays there: recomputation (whose compiled replay is C++ too,
// replay.cpp) and the first iteration's squeezed convolutions (`hook(op, phase)`).
//
// One iteration at a time, as the counter: plain globals would do, but an executor owns its
// Core (a Python object), and the counter follows the one armed.

#include "actions.h"

#include <torch/extension.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Storage.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#ifndef VSIM_NO_REPLAY
namespace vsim_replay {  // replay.cpp: the compiled replay of recomputations
struct Program;
const Program* program_of(py::handle h);
std::vector<int> run(const Program& p,
                     const std::vector<std::pair<c10::StorageImpl*, int64_t>>& tg,
                     int64_t& calls, int64_t& ns);
}  // namespace vsim_replay
#endif

namespace vsim_core {

using namespace vsim_actions;
using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

// the Python executor's states, in its words (skipped-action reasons name them)
enum State : uint8_t { ABSENT = 0, DEVICE, OFFLOADING, HOST, DROPPED, RELEASED };
const char* const STATE_NAMES[] = {"absent", "device", "offloading", "host", "dropped",
                                   "released"};

// Python hooks at an op: recomputations before it (0), its squeeze after the start's actions
// (1), the squeeze's end before the end's actions (2)
enum Phase : uint8_t { RECOMPUTE = 1, SQUEEZE = 2, UNSQUEEZE = 4 };

struct Tensor {
  std::optional<WeakStorage> st;
  int64_t nbytes = 0;
  State state = ABSENT;
  bool input = false;      // the step's input: never freed, brought back at the end
  bool unlocated = false;  // the plan acts on it but no call returns it: frees skip it
  // the copies' end events, made once per tensor and recorded again; live: recorded in this
  // iteration (the Python executor's out_ev and in_ev entries)
  std::optional<c10::Event> out_ev, in_ev;
  bool out_live = false, in_live = false;
  at::Tensor host;          // its own host buffer, kept across iterations
  int64_t slot = -1, slot_size = 0;  // its pool slot in this iteration
};

struct OpActions {
  std::vector<int64_t> prefetch, needs, drop, release;
  std::vector<std::pair<int64_t, int64_t>> offload_at, offload_after;  // (tensor, release op)
  bool sync = false;
  uint8_t py = 0;  // Phase bits
};

#ifndef VSIM_NO_REPLAY
// A recomputation's compiled replay (recompute.py's _replay_compiled, here without Python)
struct Compiled {
  py::object holder;  // the Program's Python object, kept alive
  const vsim_replay::Program* program;
  std::vector<int64_t> tensors;  // the tensors the Recompute rebuilds
  std::vector<int64_t> targets;  // those it was compiled to rebuild (dropped then)
  int64_t extra;                 // in-place updates outside the chain it re-runs
  std::string what;              // the Recompute, for errors
};
#endif

// The time until the end of its scope added to `ns`, however the scope ends.
struct AddTime {
  int64_t& ns;
  Clock::time_point t0 = Clock::now();
  ~AddTime() { ns += ns_since(t0); }
};

struct Stats {
  int64_t offloads = 0, prefetches = 0, drops = 0, releases = 0, syncs = 0;
  int64_t recomputed_calls = 0, inplace_rerun = 0, recompute_ns = 0, replay_call_ns = 0;
  int64_t d2h_bytes = 0, h2d_bytes = 0, host_live = 0, host_peak = 0;
  int64_t host_ns = 0, alloc_ns = 0, copy_ns = 0, event_ns = 0, free_ns = 0, pool_wait_ns = 0;
  int64_t callback_timed_ns = 0;  // host_ns spent inside the counter's call backs
  std::map<std::string, int64_t> skipped;
};

// vDNN++'s pinned pool (vsim/runtime/hostmem.py's PinnedPool, the same first fit and merge):
// a slot comes back when its last copy has completed
struct Pool {
  at::Tensor buffer;
  int64_t size = 0;
  std::vector<std::pair<int64_t, int64_t>> free;  // (offset, size), sorted, merged
  struct Pending {
    int64_t tensor;  // whose event marks the copy's end (-1: none, the CPU)
    bool out;        // its out_ev, else its in_ev
    int64_t offset, size;
  };
  std::vector<Pending> pending;
};

class Core {
 public:
  Core(int64_t n_tensors, int64_t n_ops, bool gpu, bool pinned, py::object hook)
      : T(n_tensors), ops(n_ops + 1), gpu(gpu), pinned(pinned), hook(std::move(hook)) {}

  // ---------------------------------------------------------------- the plan

  OpActions& at(int64_t op) {
    if (op < 0 || op >= static_cast<int64_t>(ops.size()))
      throw std::out_of_range("vsim core: op " + std::to_string(op));
    return ops[op];
  }
  Tensor& tensor(int64_t t) {
    if (t < 0 || t >= static_cast<int64_t>(T.size()))
      throw std::out_of_range("vsim core: tensor " + std::to_string(t));
    return T[t];
  }
  void set_input(int64_t t) { tensor(t).input = true; }
  void set_unlocated(int64_t t) { tensor(t).unlocated = true; }
  void set_pool(at::Tensor buffer) {
    pool.buffer = std::move(buffer);
    pool.size = pool.buffer.numel();
    has_pool = true;
  }
  // the counter's tables: per count, the outputs to register (leaf index, tensor) and the op
  // to advance to (-1: none); post: after the call returns, else before it starts
  void arm_counts(std::unordered_map<int64_t, std::vector<std::pair<int64_t, int64_t>>> post,
                  std::unordered_map<int64_t, int64_t> after,
                  std::unordered_map<int64_t, int64_t> pre) {
    post_pairs = std::move(post);
    after_op = std::move(after);
    pre_op = std::move(pre);
  }
  // frames whose outputs alone the counter calls back with (counter.cpp's OUTS): per frame
  // key, the outputs to register; `python`: the keys Python must still see (a call the
  // executor records or keeps constants of)
  void arm_frames(std::unordered_map<int64_t, std::vector<std::pair<int64_t, int64_t>>> watch,
                  std::unordered_set<int64_t> python) {
    frame_watch = std::move(watch);
    frame_python = std::move(python);
  }

  // A frame flagged OUTS has returned: its watched outputs registered; whether that was all
  // (else the counter calls Python with them as before)
  bool frame_outputs(int64_t key, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    if (frame_python.count(key)) return false;
    auto it = frame_watch.find(key);
    if (it == frame_watch.end()) return false;
    register_outputs(it->second, op, stack);
    return true;
  }

#ifndef VSIM_NO_REPLAY
  // op's recomputations by their compiled replays, in the plan's order: (program, the
  // tensors the Recompute rebuilds, its targets, in-place re-runs, description) each
  void set_programs(int64_t op, py::list progs) {
    std::vector<Compiled> got;
    for (auto h : progs) {
      auto t = h.cast<py::tuple>();
      got.push_back(Compiled{py::reinterpret_borrow<py::object>(t[0]),
                             vsim_replay::program_of(t[0]), t[1].cast<std::vector<int64_t>>(),
                             t[2].cast<std::vector<int64_t>>(), t[3].cast<int64_t>(),
                             t[4].cast<std::string>()});
    }
    at(op);
    programs[op] = std::move(got);
  }
  void clear_programs() { programs.clear(); }
#endif
  // whether this iteration runs the compiled replays (else the hook, Python's replay)
  void use_programs(bool on) { programs_on = on; }

  // ---------------------------------------------------------------- the iteration

  void begin(py::handle compute, py::handle d2h_stream, py::handle h2d_stream) {
    for (auto& x : T) {
      x.st.reset();
      x.nbytes = 0;
      x.state = ABSENT;
      x.out_live = x.in_live = false;
      x.slot = -1;
    }
    pending_release.clear();
    stats = Stats();
    cur = -1;
    programs_on = false;
    if (gpu) {
      cs = compute.cast<c10::Stream>();
      d2h = d2h_stream.cast<c10::Stream>();
      h2d = h2d_stream.cast<c10::Stream>();
    }
    if (has_pool) {
      pool.free.assign(1, {0, pool.size});
      pool.pending.clear();
    }
  }

  void reg(int64_t t, const c10::Storage& st) {
    Tensor& x = tensor(t);
    x.st = WeakStorage(st.getWeakStorageImpl());
    x.nbytes = static_cast<int64_t>(st.nbytes());
    x.state = DEVICE;
  }

  void reg_py(int64_t t, py::handle storage) {
    if (!THPStorage_Check(storage.ptr())) throw std::invalid_argument("reg: an UntypedStorage");
    reg(t, THPStorage_Unpack(storage.ptr()));
  }

  // Every op before `op` has been launched: end them, start the ones in between and `op`.
  void advance(int64_t op) {
    AddTime add{stats.host_ns};  // counted where an action raises too
    const int64_t last = std::min<int64_t>(op, static_cast<int64_t>(ops.size()) - 1);
    while (cur < last) {
      if (cur >= 0) end(cur);
      ++cur;
      start(cur);
    }
    if (cur < op) cur = op;
  }

  // The native tracker's call back at count `c` (counter.cpp): the outputs on `stack` the plan
  // acts on registered, then the ops before the count's op ended.
  bool at_count(int64_t c, const c10::OperatorHandle& op, torch::jit::Stack* stack, bool post) {
    int64_t to = -1;
    if (post) {
      auto it = post_pairs.find(c);
      if (it != post_pairs.end()) register_outputs(it->second, op, stack);
      auto a = after_op.find(c);
      if (a != after_op.end()) to = a->second;
    } else {
      auto p = pre_op.find(c);
      if (p != pre_op.end()) to = p->second;
    }
    if (to > cur) {
      const int64_t before = stats.host_ns;
      advance(to);
      stats.callback_timed_ns += stats.host_ns - before;
    }
    return true;
  }

  // Bring back inputs an iteration left offloaded (executor.py's _restore_inputs); false
  // where one has no host copy.
  void restore_inputs() {
    for (size_t t = 0; t < T.size(); ++t) {
      Tensor& x = T[t];
      if (!x.input) continue;
      c10::Storage st = storage(static_cast<int64_t>(t));
      if (!st || static_cast<int64_t>(st.nbytes()) == x.nbytes) continue;
      allocate(st, x.nbytes);
      auto got = host_of(x);
      if (!got)
        throw std::runtime_error("vsim executor: input tensor " + std::to_string(t) +
                                 " was released without a host copy");
      at::Tensor host = host_bytes(got->first, got->second, x.nbytes);
      if (gpu) wait_for(*cs, *d2h);
      bytes_of(st).copy_(host);
      x.state = DEVICE;
      ++stats.skipped["input restored at the end"];
    }
  }

  // After an exception: forget the iteration's storages (an input's kept where `keep_inputs`).
  void forget(bool keep_inputs) {
    for (auto& x : T)
      if (!(keep_inputs && x.input)) x.st.reset();
  }

  // ---------------------------------------------------------------- for Python

  py::object storage_py(int64_t t) {
    c10::Storage st = storage(t);
    if (!st) return py::none();
    return py::reinterpret_steal<py::object>(THPStorage_Wrap(std::move(st)));
  }
  std::string state_of(int64_t t) { return STATE_NAMES[tensor(t).state]; }
  void set_device(int64_t t) { tensor(t).state = DEVICE; }
  int64_t nbytes_of(int64_t t) { return tensor(t).nbytes; }
  int64_t current() const { return cur; }
  void set_current(int64_t op) { cur = op; }
  int64_t host_allocated() const { return host_alloc; }
  int64_t pool_overflow() const { return overflow; }
  // the iteration's counters and timers (ns), for IterationStats
  py::dict stats_dict() const {
    py::dict d;
    d["offloads"] = stats.offloads;
    d["prefetches"] = stats.prefetches;
    d["drops"] = stats.drops;
    d["releases"] = stats.releases;
    d["syncs"] = stats.syncs;
    d["d2h_bytes"] = stats.d2h_bytes;
    d["h2d_bytes"] = stats.h2d_bytes;
    d["host_peak_bytes"] = stats.host_peak;
    d["host_ns"] = stats.host_ns;
    d["alloc_ns"] = stats.alloc_ns;
    d["copy_ns"] = stats.copy_ns;
    d["event_ns"] = stats.event_ns;
    d["free_ns"] = stats.free_ns;
    d["pool_wait_ns"] = stats.pool_wait_ns;
    d["callback_timed_ns"] = stats.callback_timed_ns;
    d["recomputed_calls"] = stats.recomputed_calls;
    d["inplace_rerun"] = stats.inplace_rerun;
    d["recompute_ns"] = stats.recompute_ns;
    d["replay_call_ns"] = stats.replay_call_ns;
    d["skipped"] = stats.skipped;
    return d;
  }

  std::vector<Tensor> T;
  Stats stats;

 private:
  std::vector<OpActions> ops;
  bool gpu, pinned;
  py::object hook;  // hook(op, phase): recomputation and squeezes, in Python
  int64_t cur = -1;
  std::optional<c10::Stream> cs, d2h, h2d;
  std::map<int64_t, std::vector<int64_t>> pending_release;
  Pool pool;
  bool has_pool = false;
  int64_t host_alloc = 0, overflow = 0;
  std::unordered_map<int64_t, std::vector<std::pair<int64_t, int64_t>>> post_pairs;
  std::unordered_map<int64_t, int64_t> after_op, pre_op;
  std::unordered_map<int64_t, std::vector<std::pair<int64_t, int64_t>>> frame_watch;
  std::unordered_set<int64_t> frame_python;
  bool programs_on = false;
#ifndef VSIM_NO_REPLAY
  std::unordered_map<int64_t, std::vector<Compiled>> programs;
#endif

  void skip(const std::string& why) { ++stats.skipped[why]; }

  void call_python(int64_t op, Phase phase) {
    py::gil_scoped_acquire gil;
    hook(op, static_cast<int>(phase));
  }

  void start(int64_t op) {
    OpActions& a = ops[op];
    for (int64_t t : a.prefetch) prefetch(t);
    for (int64_t t : a.needs) {
      Tensor& x = T[t];
      if (!x.in_live) continue;
      x.in_live = false;
      if (gpu) {
        const auto t0 = Clock::now();
        x.in_ev->block(*cs);
        stats.event_ns += ns_since(t0);
      }
    }
    if (a.py & RECOMPUTE) {
#ifndef VSIM_NO_REPLAY
      auto it = programs_on ? programs.find(op) : programs.end();
      if (it != programs.end()) replay(it->second);
      else call_python(op, RECOMPUTE);
#else
      call_python(op, RECOMPUTE);
#endif
    }
    for (auto [t, rel] : a.offload_at) offload(t, rel);
    if (a.py & SQUEEZE) call_python(op, SQUEEZE);
  }

  void end(int64_t op) {
    OpActions& a = ops[op];
    if (a.py & UNSQUEEZE) call_python(op, UNSQUEEZE);
    for (auto [t, rel] : a.offload_after) offload(t, rel);
    auto pr = pending_release.find(op);
    if (pr != pending_release.end()) {
      std::vector<int64_t> due = std::move(pr->second);
      pending_release.erase(pr);
      for (int64_t t : due) release_offloaded(t);
    }
    for (int64_t t : a.drop) free_tensor(t, DROPPED);
    for (int64_t t : a.release) free_tensor(t, RELEASED);
    if (a.sync && gpu) {
      const auto t0 = Clock::now();
      wait_for(*cs, *d2h);
      wait_for(*cs, *h2d);
      stats.event_ns += ns_since(t0);
      ++stats.syncs;
    }
  }

#ifndef VSIM_NO_REPLAY
  static std::string ids(const std::vector<int64_t>& xs) {
    std::string s = "[";
    for (size_t i = 0; i < xs.size(); ++i) s += (i ? ", " : "") + std::to_string(xs[i]);
    return s + "]";
  }

  // recompute.py's _replay_compiled for each: the targets must be the ones it was compiled
  // with (the plan's drops repeat)
  void replay(const std::vector<Compiled>& progs) {
    AddTime add{stats.recompute_ns};
    for (const Compiled& c : progs) {
      std::vector<int64_t> now;
      std::vector<std::pair<c10::StorageImpl*, int64_t>> tg;
      std::vector<c10::Storage> held;
      for (int64_t t : c.tensors) {
        if (T[t].state != DROPPED) continue;
        c10::Storage st = storage(t);
        if (!st) continue;
        now.push_back(t);
        tg.emplace_back(st.unsafeGetStorageImpl(), T[t].nbytes);
        held.push_back(std::move(st));
      }
      if (now != c.targets)
        throw std::runtime_error("vsim executor: recomputing " + c.what +
                                 ": the tensors to rebuild are " + ids(now) +
                                 ", the compiled replay's " + ids(c.targets));
      int64_t calls = 0, ns = 0;
      std::vector<int> rebuilt;
      try {
        rebuilt = vsim_replay::run(*c.program, tg, calls, ns);
      } catch (...) {
        stats.replay_call_ns += ns;
        throw;
      }
      for (int i : rebuilt) T[c.targets[i]].state = DEVICE;
      stats.recomputed_calls += calls;
      stats.inplace_rerun += c.extra;
      stats.replay_call_ns += ns;
    }
  }
#endif

  c10::Storage storage(int64_t t) {
    Tensor& x = tensor(t);
    if (x.st) {
      auto strong = x.st->lock();
      if (strong) return c10::Storage(std::move(strong));
    }
    skip("tensor not found");
    return c10::Storage();
  }

  // what resize_(n) does for a storage of 0 bytes (nothing to copy over)
  void allocate(const c10::Storage& st, int64_t n) {
    c10::StorageImpl* impl = st.unsafeGetStorageImpl();
    const auto t0 = Clock::now();
    c10::DeviceGuard guard(impl->device());
    at::DataPtr data = impl->allocator()->allocate(static_cast<size_t>(n));
    impl->set_data_ptr_noswap(std::move(data));
    impl->set_nbytes(static_cast<size_t>(n));
    stats.alloc_ns += ns_since(t0);
  }

  // what resize_(0) does: the block back to the allocator (which waits for the streams that
  // used it before handing it out again)
  void give_back(const c10::Storage& st) {
    const auto t0 = Clock::now();
    c10::StorageImpl* impl = st.unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
    impl->set_nbytes(0);
    stats.free_ns += ns_since(t0);
  }

  c10::Event& event(std::optional<c10::Event>& e) {
    if (!e) e.emplace(cs->device_type());
    return *e;
  }

  // ------------------------------------------------ host buffers

  std::optional<int64_t> pool_take(int64_t size) {
    size = (size + 511) / 512 * 512;
    while (true) {
      for (size_t n = 0; n < pool.free.size(); ++n) {
        auto [o, s] = pool.free[n];
        if (s >= size) {
          if (s == size) pool.free.erase(pool.free.begin() + n);
          else pool.free[n] = {o + size, s - size};
          return o;
        }
      }
      if (!pool_collect()) return std::nullopt;
    }
  }

  bool pool_done(const Pool::Pending& p) {
    if (p.tensor < 0) return true;
    Tensor& x = T[p.tensor];
    auto& e = p.out ? x.out_ev : x.in_ev;
    return !e || e->query();
  }

  bool pool_collect() {
    std::vector<Pool::Pending> left, done;
    for (auto& p : pool.pending) (pool_done(p) ? done : left).push_back(p);
    if (done.empty() && !pool.pending.empty()) {
      const Pool::Pending& p = pool.pending.front();
      Tensor& x = T[p.tensor];
      (p.out ? x.out_ev : x.in_ev)->synchronize();
      done.push_back(p);
      left.assign(pool.pending.begin() + 1, pool.pending.end());
    }
    pool.pending = std::move(left);
    for (auto& p : done) pool_give_back(p.offset, p.size);
    return !done.empty();
  }

  void pool_give_back(int64_t offset, int64_t size) {
    pool.free.emplace_back(offset, size);
    std::sort(pool.free.begin(), pool.free.end());
    std::vector<std::pair<int64_t, int64_t>> merged;
    for (auto [o, s] : pool.free) {
      if (!merged.empty() && merged.back().first + merged.back().second == o)
        merged.back().second += s;
      else
        merged.emplace_back(o, s);
    }
    pool.free = std::move(merged);
  }

  // tensor t's slot back to the pool once the copy whose end `out` names (its out_ev, else
  // its in_ev; none on the CPU or where it was not recorded) has completed
  void give_slot(int64_t t, bool out) {
    Tensor& x = T[t];
    if (x.slot < 0) return;
    const bool live = gpu && (out ? x.out_live : x.in_live);
    pool.pending.push_back({live ? t : -1, out, x.slot, (x.slot_size + 511) / 512 * 512});
    x.slot = -1;
  }

  // where tensor t's n bytes go on the host: a pool slot, else its own buffer
  std::pair<at::Tensor, int64_t> host_buffer(int64_t t, int64_t n) {
    Tensor& x = T[t];
    if (has_pool) {
      const auto t0 = Clock::now();
      auto got = pool_take(n);
      stats.pool_wait_ns += ns_since(t0);
      if (got) {
        x.slot = *got;
        x.slot_size = n;
        return {pool.buffer, *got};
      }
      ++overflow;
    }
    if (!x.host.defined() || x.host.numel() < n) {
      x.host = at::empty({n}, at::TensorOptions().dtype(at::kByte).pinned_memory(gpu && pinned));
      host_alloc += n;
    }
    return {x.host, 0};
  }

  std::optional<std::pair<at::Tensor, int64_t>> host_of(const Tensor& x) {
    if (x.slot >= 0) return std::make_pair(pool.buffer, x.slot);
    if (x.host.defined()) return std::make_pair(x.host, int64_t{0});
    return std::nullopt;
  }

  // ------------------------------------------------ actions

  // `dst` <- `src` on copy stream `on` once it has waited for the compute stream (and for
  // `after`, where given), its end recorded in `ev` (`live` set), the block of `st` marked as
  // used there; synchronous on the CPU. Returns the ns issuing the copy took.
  int64_t copy(at::Tensor& dst, const at::Tensor& src, const std::optional<c10::Stream>& on,
               std::optional<c10::Event>& ev, bool& live, const c10::Storage& st,
               const c10::Event* after) {
    if (!gpu) {
      const auto tc = Clock::now();
      dst.copy_(src);
      return ns_since(tc);
    }
    wait_for(*on, *cs);
    if (after != nullptr) after->block(*on);
    int64_t ns;
    {
      c10::StreamGuard guard(*on);
      const auto tc = Clock::now();
      dst.copy_(src, pinned);
      ns = ns_since(tc);
    }
    event(ev).record(*on);
    live = true;
    record_on(st, *on);
    return ns;
  }

  void offload(int64_t t, int64_t rel) {
    Tensor& x = T[t];
    if (x.state != DEVICE) {
      skip("offload of a tensor not on the device");
      return;
    }
    c10::Storage st = storage(t);
    if (!st || st.nbytes() == 0) return;
    const int64_t n = static_cast<int64_t>(st.nbytes());
    auto [buf, off] = host_buffer(t, n);
    const auto t0 = Clock::now();
    at::Tensor src = bytes_of(st);
    at::Tensor host = host_bytes(buf, off, n);
    const int64_t copy_ns = copy(host, src, d2h, x.out_ev, x.out_live, st, nullptr);
    stats.copy_ns += copy_ns;
    stats.event_ns += ns_since(t0) - copy_ns;
    x.state = OFFLOADING;
    ++stats.offloads;
    stats.d2h_bytes += n;
    stats.host_live += n;
    stats.host_peak = std::max(stats.host_peak, stats.host_live);
    if (rel < cur) release_offloaded(t);
    else pending_release[rel].push_back(t);
  }

  void release_offloaded(int64_t t) {
    Tensor& x = T[t];
    if (x.state != OFFLOADING) return;
    c10::Storage st = storage(t);
    if (st) give_back(st);
    x.state = HOST;
  }

  void unpend(int64_t t) {
    for (auto& [op, lst] : pending_release) {
      auto it = std::find(lst.begin(), lst.end(), t);
      if (it != lst.end()) lst.erase(it);
    }
  }

  void prefetch(int64_t t) {
    Tensor& x = T[t];
    if (x.state == OFFLOADING) {  // still on the device: keep it there
      unpend(t);
      x.state = DEVICE;
      stats.host_live -= x.nbytes;
      give_slot(t, true);
      skip("prefetch before the release: kept on the device");
      return;
    }
    if (x.state != HOST) {
      if (x.state != DEVICE && x.state != ABSENT)
        skip(std::string("prefetch of a ") + STATE_NAMES[x.state] + " tensor");
      return;
    }
    c10::Storage st = storage(t);
    if (!st) return;
    const int64_t n = x.nbytes;
    auto got = host_of(x);
    if (!got) throw std::logic_error("vsim core: tensor on the host without a host buffer");
    const auto t0 = Clock::now();
    const int64_t alloc_before = stats.alloc_ns;
    if (st.nbytes() != 0) throw std::logic_error("vsim core: prefetch of a storage not released");
    allocate(st, n);
    at::Tensor host;
    try {
      host = host_bytes(got->first, got->second, n);
    } catch (...) {
      give_back(st);
      throw;
    }
    at::Tensor dst = bytes_of(st);
    const int64_t copy_ns = copy(dst, host, h2d, x.in_ev, x.in_live, st, x.out_live ? &*x.out_ev
                                                                                   : nullptr);
    stats.copy_ns += copy_ns;
    stats.event_ns += ns_since(t0) - copy_ns - (stats.alloc_ns - alloc_before);
    give_slot(t, false);
    x.state = DEVICE;
    ++stats.prefetches;
    stats.h2d_bytes += n;
    stats.host_live -= n;
  }

  void free_tensor(int64_t t, State how) {
    Tensor& x = T[t];
    if (x.unlocated) return;
    const char* word = how == DROPPED ? "dropped" : "released";
    if (x.input) {  // the batch is the training loop's, used again next iteration
      skip(std::string(word) + " input kept");
      return;
    }
    if (x.state == OFFLOADING) {
      unpend(t);
    } else if (x.state != DEVICE) {
      skip(std::string(word) + " tensor not on the device");
      return;
    }
    c10::Storage st = storage(t);
    if (!st) return;
    give_back(st);
    x.state = how;
    ++(how == DROPPED ? stats.drops : stats.releases);
  }

  // ------------------------------------------------ outputs

  // the outputs of the call on `stack` as the Python executor's _leaves sees them
  void register_outputs(const std::vector<std::pair<int64_t, int64_t>>& pairs,
                        const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    const size_t n = op.schema().returns().size();
    std::vector<c10::IValue> leaves;
    for (size_t i = 0; i < n; ++i) leaves_of((*stack)[stack->size() - n + i], leaves);
    for (auto [j, t] : pairs) {
      if (j < 0 || j >= static_cast<int64_t>(leaves.size()) || !leaves[j].isTensor())
        throw std::runtime_error("vsim executor: output " + std::to_string(j) + " of " +
                                 op.operator_name().name + " is not a tensor (trace tensor " +
                                 std::to_string(t) + ")");
      reg(t, leaves[j].toTensor().storage());
    }
  }
};

Core* armed = nullptr;  // the Core the counter calls into (arm_core), or none

bool is_armed() { return armed != nullptr; }

void at_count(int64_t c, const c10::OperatorHandle& op, torch::jit::Stack* stack, bool post) {
  armed->at_count(c, op, stack, post);
}

void saved(int64_t t, const at::Tensor& x) { armed->reg(t, x.storage()); }

bool frame_outputs(int64_t key, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  return armed->frame_outputs(key, op, stack);
}

void init_core(py::module& m) {
  py::class_<Core>(m, "Core")
      .def(py::init<int64_t, int64_t, bool, bool, py::object>(),
           "Core(tensors, ops, gpu, pinned, hook): hook(op, phase) runs what stays in Python")
      .def("add", [](Core& c, int64_t op, const std::string& what, int64_t t, int64_t rel) {
             OpActions& a = c.at(op);
             if (what == "prefetch") a.prefetch.push_back(t);
             else if (what == "needs") a.needs.push_back(t);
             else if (what == "drop") a.drop.push_back(t);
             else if (what == "release") a.release.push_back(t);
             else if (what == "offload_at") a.offload_at.emplace_back(t, rel);
             else if (what == "offload_after") a.offload_after.emplace_back(t, rel);
             else if (what == "sync") a.sync = true;
             else if (what == "recompute") a.py |= RECOMPUTE;
             else if (what == "squeeze") a.py |= SQUEEZE | UNSQUEEZE;
             else throw std::invalid_argument("vsim core: no action " + what);
           }, "add(op, what, tensor, release op): one action of the plan, in the plan's order")
      .def("set_input", &Core::set_input)
      .def("set_unlocated", &Core::set_unlocated)
      .def("set_pool", &Core::set_pool)
      .def("arm_counts", &Core::arm_counts)
      .def("arm_frames", &Core::arm_frames)
#ifndef VSIM_NO_REPLAY
      .def("set_programs", &Core::set_programs)
      .def("clear_programs", &Core::clear_programs)
#endif
      .def("use_programs", &Core::use_programs)
      .def("begin", &Core::begin)
      .def("register", &Core::reg_py)
      .def("advance", &Core::advance, py::call_guard<py::gil_scoped_release>())
      .def("restore_inputs", &Core::restore_inputs, py::call_guard<py::gil_scoped_release>())
      .def("forget", &Core::forget)
      .def("storage", &Core::storage_py)
      .def("state", &Core::state_of)
      .def("set_device", &Core::set_device)
      .def("nbytes", &Core::nbytes_of)
      .def_property("cur", &Core::current, &Core::set_current)
      .def_property_readonly("host_allocated", &Core::host_allocated)
      .def_property_readonly("pool_overflow", &Core::pool_overflow)
      .def("stats", &Core::stats_dict);
  m.def("arm_core", [](Core* c) { armed = c; }, py::arg("core").none(true),
        "the Core the native tracker registers outputs into and advances at its counts "
        "(None: call back into Python as before)");
}

}  // namespace vsim_core

void init_core(py::module& m) { vsim_core::init_core(m); }
