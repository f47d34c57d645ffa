"""Aten calls per trace op, by op name, from the runtime's op maps (issue 15: the engine charges
a recomputation's replay and recording per aten call the runtime replays or records, and a trace
op can be one call, `aten::conv2d`, or several, `aten::linear` under autocast: cast, transpose,
addmm, views). Reads the op maps that `python -m vsim.runtime.measure SUITE OUT --separate-maps`
writes (`OUT/map-MODEL-bBATCH.json`; the ones of the 2026-11-26 H100 and H200 runs are in
opmaps/), counts the calls each map gives each trace op (`call_op`), and prints the mean per
forward op name (`aten::...`, what recomputation re-runs) as YAML for hardware/host/NAME.yaml's
`executor.calls_per_op`, with the mean over every forward op as `default`. `--hold-out` leaves
models out (to check the table on them: `--check`). Writes nothing.

    python validation/host/calls_per_op.py validation/host/opmaps/*.json.gz [--hold-out M,...]

`--counted`: every trace op's calls by name (forward, backward, optimizer), for the native
tracker's cost per counted call (`executor.counted_calls`).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
from pathlib import Path


def per_op(path: Path, every: bool = False) -> tuple[str, list[tuple[str, int]]]:
    """(model, [(op name, the map's calls for that op)]) over the forward `aten::` ops, or
    every op (`every`)."""
    raw = path.read_bytes()
    doc = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    counts = collections.Counter(doc["call_op"])
    model = path.name.removeprefix("map-").split(".")[0].rsplit("-", 1)[0]
    return model, [(name, counts.get(i, 0)) for i, name in enumerate(doc["op_names"])
                   if every or name.startswith("aten::")]


def table(maps: list[tuple[str, list[tuple[str, int]]]]) -> tuple[dict[str, float], float]:
    by_name: dict[str, list[int]] = collections.defaultdict(list)
    for _, ops in maps:
        for name, n in ops:
            by_name[name].append(n)
    every = [n for v in by_name.values() for n in v]
    return ({k: round(statistics.mean(v), 2) for k, v in sorted(by_name.items())},
            round(statistics.mean(every), 2))


def counted_table(paths: list[Path]) -> tuple[dict[str, float], float, int]:
    """Aten calls the native tracker counts per trace op, by op name over every op (forward,
    backward, optimizer): the op map's calls are the counter's (design.md, the native
    tracker); one map per model (the last given)."""
    by_model = {path.name.removeprefix("map-").split(".")[0].rsplit("-h", 1)[0]: path
                for path in paths}
    names, default = table([per_op(path, every=True) for path in by_model.values()])
    return names, default, len(by_model)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("maps", nargs="+", type=Path)
    ap.add_argument("--hold-out", default="", help="models left out of the table")
    ap.add_argument("--counted", action="store_true",
                    help="every op's counted calls (the native tracker's), not forward ones")
    args = ap.parse_args()
    held = set(filter(None, args.hold_out.split(",")))
    if args.counted:
        names, default, models = counted_table(args.maps)
        print(f"  # aten calls the native tracker counts per trace op (validation/host/"
              f"calls_per_op.py --counted over {models} models' op maps)")
        print("  counted_calls:")
        print(f"    default: {default}")
        for name, v in names.items():
            print(f"    {name}: {v}")
        return
    maps = [per_op(p) for p in args.maps]
    fit = [m for m in maps if m[0].rsplit("-b", 1)[0] not in held]
    names, default = table(fit)
    print(f"  # aten calls per forward trace op (validation/host/calls_per_op.py over "
          f"{len(fit)} op maps)")
    print("  calls_per_op:")
    print(f"    default: {default}")
    for name, v in names.items():
        print(f"    {name}: {v}")
    for model, ops in maps:
        if model.rsplit("-b", 1)[0] not in held:
            continue
        true = sum(n for _, n in ops)
        est = sum(names.get(name, default) for name, _ in ops)
        print(f"# held out {model}: {true} calls on its forward ops, the table says "
              f"{est:.0f} ({100 * (est / true - 1):+.1f}%)")


if __name__ == "__main__":
    main()
