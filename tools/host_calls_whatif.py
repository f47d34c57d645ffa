"""What the host model by aten calls (validation/host/fit_calls.py) would do to the H100 cases'
time error with the plans held as they are: each case is planned as `vsim validate` plans it,
then that plan is run again with the calls model in place of the probe's per-name costs (not
re-planned: a first-order estimate; adopting it would move plans). Coefficients as fit_calls.py
printed them on 2026-11-26 (us per forward aten call, backward op, other op, weight). Prints the
MAPE of both over the cases both predict and measure to fit. Writes nothing.

    python tools/host_calls_whatif.py
"""

from __future__ import annotations

import dataclasses
import glob
import math

from host_whatif import HELD_OUT, rerun_with_host

from vsim.host import HostModel
from vsim.trace.schema import Op, Trace
from vsim.validate import load_cases, relative_error

FWD_CALL_US, BWD_OP_US, OTHER_OP_US, WEIGHT_US = 13.4, 65.8, 710.6, 9.9


class CallsHost(HostModel):
    def op_us(self, op: Op) -> float:
        if op.phase == "fwd":
            return FWD_CALL_US * self.calls(op)
        return BWD_OP_US if op.phase == "bwd" else OTHER_OP_US

    def iteration_us(self, trace: Trace) -> float:
        weights = sum(1 for t in trace.tensors if t.kind == "weight")
        return math.fsum(self.op_us(o) for o in trace.ops) + weights * WEIGHT_US


def main() -> None:
    def calls_model(host: HostModel) -> HostModel:
        return CallsHost(**{f.name: getattr(host, f.name) for f in dataclasses.fields(host)})

    errors: dict[str, list[tuple[str, float]]] = {"probe": [], "calls": []}
    for case in load_cases(sorted(glob.glob("validation/cases/*.yaml"))):
        if case.hardware != "h100-sxm":
            continue
        runs = rerun_with_host(case, calls_model)
        if runs is None:
            continue
        m, probe, (calls,) = runs
        if not (probe["fits"] and calls["fits"]):
            continue
        for name, report in (("probe", probe), ("calls", calls)):
            err = relative_error(report["iteration_time_us"], m["iteration_time_us"])
            errors[name].append((case.id, abs(err or 0.0)))
    for name, rows in errors.items():
        held = [e for i, e in rows if i.startswith(HELD_OUT)]
        mape = 100 * sum(e for _, e in rows) / len(rows)
        print(f"{name}: {len(rows)} cases, time MAPE {mape:.2f}%, held-out models "
              f"{100 * sum(held) / len(held):.2f}% ({len(held)}), over 15%: "
              f"{sum(e > 0.15 for _, e in rows)}")


if __name__ == "__main__":
    main()
