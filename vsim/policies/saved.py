"""`plan`: carry out a plan saved by `vsim search` (`plan:file=PATH`).

The file (vsim/plan_io.py) holds the actions, the trace they were made for (its path, and a
digest of its ops and tensors) and the capacity. A plan is a list of op and tensor ids timed
against that trace's op times, so on any other trace it is refused (PolicyError: one line, exit
code 2): the digest of the trace given to plan() must equal the file's. The file is read when
the policy is built, so a missing or malformed file fails before anything is simulated.
Without a file (the default every registered policy must have) the plan is empty: nothing moves.

A capacity or hardware other than the search's is allowed (the plan still runs; it may no
longer fit or be the fastest): the report's notes say so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import PolicyError
from ..hardware import Hardware
from ..plan import Offload, Plan
from ..plan_io import SavedPlan, load_plan, trace_digest
from ..trace.schema import Trace
from ..units import format_size
from .base import Policy, register


@register
@dataclass(frozen=True)
class SavedPlanPolicy(Policy):
    name = "plan"
    description = ("a plan saved by `vsim search -o PLAN.json` (file=PATH); refused on a trace "
                   "other than the one it was searched on")
    file: str = ""

    def __post_init__(self) -> None:
        if self.file:
            self._load()  # bad files fail when the spec is parsed, before any simulation

    def _load(self) -> SavedPlan:
        return load_plan(self.file)

    def plan(self, trace: Trace, hw: Hardware, capacity_bytes: int) -> Plan:
        if not self.file:  # every policy has defaults (the registry's contract): this one's
            return Plan(notes=("plan: no file given (plan:file=PATH): nothing moved",))
        saved = self._load()
        digest = trace_digest(trace)
        if digest != saved.trace_digest:
            made_for = saved.trace_path or "another trace"
            other_hw = (f"; searched on {saved.hardware}, op times here are for {hw.name}"
                        if saved.hardware and saved.hardware != hw.name else "")
            raise PolicyError(
                f"plan made for {made_for} (digest {saved.trace_digest[:12]}), not for this "
                f"trace (digest {digest[:12]}{_model(trace)}{other_hw}): run `vsim search` on "
                "it", self.file)
        problem = _problem(saved.plan, trace)
        if problem is not None:
            raise PolicyError(problem, self.file)
        notes = [f"plan from {self.file} (searched for {saved.hardware} at "
                 f"{format_size(saved.capacity_bytes)})"]
        if saved.capacity_bytes and saved.capacity_bytes != capacity_bytes:
            notes.append(f"plan: searched at {format_size(saved.capacity_bytes)}, run at "
                         f"{format_size(capacity_bytes)}")
        if saved.hardware and saved.hardware != hw.name:
            notes.append(f"plan: searched on {saved.hardware}, run on {hw.name}")
        return dataclasses.replace(saved.plan, notes=(*saved.plan.notes, *notes))


def _problem(plan: Plan, trace: Trace) -> str | None:
    """The first action of a plan file that cannot apply to `trace` (an edited file): an op or
    tensor it does not have, or an offload before its tensor's producer has run."""
    n_ops = len(trace.ops)
    tensors = trace.tensor_by_id()
    for i, a in enumerate(plan.actions):
        at = f"plan.actions[{i}] ({type(a).__name__})"
        ops = [v for k in ("at_op", "after_op", "before_op", "needed_by", "release_after", "op")
               if (v := getattr(a, k, None)) is not None]
        ops += list(getattr(a, "ops", ()))
        bad = [o for o in ops if not 0 <= o < n_ops]
        if bad:
            return f"{at}: op {bad[0]} is not an op of this trace ({n_ops} ops)"
        ids = [a.tensor] if hasattr(a, "tensor") else list(getattr(a, "tensors", ()))
        missing = [t for t in ids if t not in tensors]
        if missing:
            return f"{at}: tensor {missing[0]} is not a tensor of this trace"
        if isinstance(a, Offload) and not a.after and tensors[a.tensor].producer == a.at_op:
            return (f"{at}: offloads tensor {a.tensor} before op {a.at_op}, its producer, has "
                    "made it (after: true offloads it once the op has run)")
    return None


def _model(trace: Trace) -> str:
    model, batch = trace.meta.get("model"), trace.meta.get("batch_size")
    return f", {model} batch {batch}" if model else ""
