"""What the native op tracker costs the host with nothing to carry out (issue 15): per model,
the run under the tracker (`instrument: true`) against the same model's run without it, twice,
from one device call (runs/, suite.yaml). Left = host issue time tracked - plain - the
executor's timed time - the saved-tensor hook's; per counted aten call (the op map's calls,
maps/) and per trace op. Reads this folder; writes nothing.

    python validation/host/native-cost/native_cost.py
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from vsim.trace import load_trace

    per_call, per_op = [], []
    print("| run | calls | ops | plain host ms | tracked host ms | hook ms | left ms | us/call "
          "| us/op |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in sorted(HERE.glob("runs/*-tracked-r*.json")):
        t = json.loads(f.read_text())
        n = json.loads((f.parent / f.name.replace("-tracked", "")).read_text())
        ex = t["executed"]
        m = json.loads(gzip.decompress(
            (HERE / f"maps/map-{t['model']}-b{t['batch_size']}.json.gz").read_bytes()))
        calls, ops = len(m["call_op"]), len(load_trace(ROOT / t["trace"]).ops)
        left = t["host_issue_us"] - n["host_issue_us"] - ex["executor_host_us"] \
            - ex["executor_pack_us"]
        per_call.append(left / calls)
        per_op.append(left / ops)
        print(f"| {t['id']} | {calls} | {ops} | {n['host_issue_us'] / 1e3:.1f} | "
              f"{t['host_issue_us'] / 1e3:.1f} | {ex['executor_pack_us'] / 1e3:.1f} | "
              f"{left / 1e3:.2f} | {left / calls:.2f} | {left / ops:.2f} |")
    for name, v in (("per counted call", per_call), ("per trace op", per_op)):
        q = statistics.quantiles(v, n=4)
        print(f"{name}: median {statistics.median(v):.2f} us, quartiles {q[0]:.2f}..{q[2]:.2f} "
              f"over {len(v)} pairs")


if __name__ == "__main__":
    main()
