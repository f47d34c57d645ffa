"""Summarise recorded traces (for checking recordings on the GPU machine):
    python tests/data/record_gpu_check.py TRACE..."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vsim.record.selfcheck import describe  # noqa: E402
from vsim.trace import load_trace  # noqa: E402

for path in sys.argv[1:]:
    t = load_trace(path)
    phases = Counter(op.phase for op in t.ops)
    with_reads = Counter(op.phase for op in t.ops if op.reads)
    kinds = Counter(x.kind for x in t.tensors)
    kind_bytes = Counter()
    for x in t.tensors:
        kind_bytes[x.kind] += x.size_bytes
    types = Counter(op.layer_type for op in t.ops)
    print(f"== {path} ({Path(path).stat().st_size / 1e6:.2f} MB)")
    print(f"  ops {dict(phases)}; with reads {dict(with_reads)}; streams "
          f"{dict(Counter(op.stream for op in t.ops))}")
    print(f"  layer types {dict(types)}")
    print(f"  tensors {dict(kinds)}")
    print("  MiB by kind " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in kind_bytes.items()))
    print(f"  mem_events {len(t.mem_events)} {dict(Counter(e.action for e in t.mem_events))}; "
          f"joined {sum(e.op is not None for e in t.mem_events)}")
    print(f"  timing {t.meta.get('timing')}")
    print(f"  join {t.meta.get('join')} check {t.meta.get('structure_check')}")
    print(f"  {describe(t)}")
