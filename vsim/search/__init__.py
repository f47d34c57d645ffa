"""`vsim search`: the fastest plan that fits a capacity, with the simulator as the cost model.

Modules: problem.py (genomes, plans, the cost model), local.py (greedy and local search),
bound.py (the lower bound), run.py (the verb: search, built-in policies, bound, plan file).

**Decisions** (a Genome). For every saved feature map t of at least MIN_CANDIDATE_BYTES
(layers.TraceView.saved: activation or input, read again in backward), one of
- keep: it stays on the device;
- swap: copied out as soon as its content is final (after its producer and the forward ops that
  modify it in place; the network input while its first reader runs), the device copy given back
  after its last forward reader, and prefetched at a chosen op (a gene: its position in trace
  order) for its first backward reader;
- drop: released after its last forward reader and rebuilt by re-running its producer (and its
  in-place ops) before its first backward reader. Dropped maps whose chains share an op, or one
  of which another's chain reads, are rebuilt by one recomputation (the union of their chains)
  before the first of them is needed. What a recomputation reads from outside must still be on
  the device (a swapped map is prefetched for it; one the trace has freed by then forbids the
  drop).
Besides: which convolutions run their workspace-free algorithm (planning's algo=memory times),
and whether an allocation that does not fit waits for offloads in flight
(Plan.wait_for_memory). Every plan frees tensors after their last reader where the trace kept
them longer (planning.liveness_releases).

**Cost model**: one simulated iteration (vsim.engine.run_plan, the run's allocator) per
genome, cached, run as `vsim run` runs it: under an allocator that models PyTorch's (caching),
after a first iteration and with the workspace fallback (issue 14; before, neither, and on
resnet50-b64 at 4 GiB the search's best plan then ran out of memory as run). Feasible = no
out of memory and no PlanError; the objective is the iteration time.

**1. Greedy start** (local.greedy). From "keep everything; only the convolutions that cannot fit
their workspace in any plan run without it" (bound.forced_workspace_free): simulate; where it runs
out of memory at op X, first issue later the prefetches that hold memory at X for a later reader,
then evict maps that would be away at X, best first by bytes per microsecond of expected cost
(swap: the part of its two copies the gap between last forward and first backward use cannot
hide, plus the copy interference it causes; drop: the ops its recomputation adds), until the
shortfall is covered; if nothing covers X, X's convolution gives up its workspace. New swaps are
prefetched as early as the static profile (planning.Evictions) leaves room for. Repeat until it
fits (the same loop repairs plans during the local search).

**2. Local search** (local.search), first improvement, from the greedy plan. Moves, in order:
(a) prefetches of maps whose reader, or an op between issue and reader, stalled: 1..16 ops
earlier (the most stalled one repaired when it no longer fits); (b) each moved map the other way
(swap <-> drop), or back on the device, and when that no longer fits, exchanged for up to
EXCHANGES maps that would be away where it runs out (those that alone cover the shortfall
cheapest first), each repaired by a few greedy steps; the maps of one recomputation all back at
once; (c) prefetches later, just in time (planning.jit_prefetch_slots) or as early as
possible; (d) a convolution back to its recorded algorithm (repaired), or, while something
stalls, to its workspace-free one; (e) wait_for_memory; (f) last, one more of the
MAX_TOGGLE_CANDIDATES largest maps away. A move is kept when its plan fits and is strictly
faster. At a local optimum, `kicks` perturbations (three random decision changes, then the
greedy repair) restart it; the best plan is kept. Move order is shuffled by a seeded generator:
a search is a pure function of (trace, hardware, capacity, allocator, seed, kicks) unless the
time budget cuts it short, which the result reports (`converged: false`). The result is never
slower than the greedy start.

**3. Built-in starts** (run.py, unless --no-builtin-starts): the local search runs again from the
plans of the three fastest fitting built-in policies (local.search's `starts`), each read as a
genome (Problem.genome_of: its swaps with their prefetch ops, drops, workspace-free
convolutions; syncs and maps under MIN_CANDIDATE_BYTES left out, repaired when that no longer
fits). The result names the start its plan came from (`origin`) and keeps what the search from
the greedy start alone reached.

**Lower bound** (bound.lower_bound): max(compute, link):
- compute: the iteration with nothing moved and ample memory (launch gaps included), each
  convolution at its fastest algorithm whose working set can fit (forced_workspace_free);
- link = M / d2h bandwidth + M / h2d bandwidth. M, the bytes that must leave the GPU, is the
  largest excess over the capacity, over all ops, of the least the device must hold while that
  op runs: every tensor the trace has alive then (freed after its last reader), without the
  saved feature maps the op does not touch and without workspaces a workspace-free algorithm
  avoids. Those bytes are copied out before the op and back after it (every saved map is read
  again in backward), so the two copies cannot overlap each other.
Recomputation takes bytes off without the link, so `recompute_bound_us` is the bound that holds
for every plan vsim can express: at each op, the least over how many of its M bytes are dropped
instead (cheapest first: each producer's fastest time over the bytes of its outputs that are
away) of max(compute + recomputation, link time of the rest); the largest over all ops.
"""

from __future__ import annotations

from .bound import forced_workspace_free, lower_bound
from .local import SearchResult, greedy, repair, search
from .problem import MIN_CANDIDATE_BYTES, Genome, Outcome, Problem

__all__ = ["MIN_CANDIDATE_BYTES", "Genome", "Outcome", "Problem", "SearchResult",
           "forced_workspace_free", "greedy", "lower_bound", "repair", "search"]
