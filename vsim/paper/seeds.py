"""The other seed papers' figures (validation/paper/*.yaml with `figures:`) against the simulator.

Each figure is one published number with what to run for it: the network (a trace under
validation/paper/traces/, synthesized by make_traces.sh), the policy spec in the paper's
semantics, the allocator, the metric, and the published value. Traces are taken in vDNN's
semantics (vsim.paper.vdnn.vdnn_semantics: ReLU in place, no momentum or weight-gradient bytes,
no pooling indices), which is what the Caffe-era runtimes of these papers share; a paper file
says so in its `semantics` line. A figure whose input is missing (no trace, an unmeasured
compression ratio, a batch size the paper does not give) is a miss with that cause, never left
out.

A file's `transform` names the paper's semantics as a trace transform: vdnn (the default) or
superneurons (vsim.paper.superneurons: cuDNN's one-op LRN, SuperNeurons' backward reads and
in-place ACT/LRN backward, DATA tensors only); a figure's `offload: conv` adds the offload of
every CONV output to its policy's plan (SuperNeurons' Fig. 10 third step).

Metrics: peak_mib (peak allocated, MiB), network_wide_mib (every tensor of the trace at once:
no liveness), time_s (iteration time x `iterations`), speedup (1 - time of `policy` / time of
`against`), pinned_cut (1 - pinned host peak of `policy` / that of `against`), recompute_ops
(recomputed forward ops per iteration). Kinds: memory (tolerance.memory), time
(tolerance.time), count (exact).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..hardware import Hardware, load_hardware, parse_percent
from ..trace.schema import Trace

MIB = 2**20
METRICS = ("peak_mib", "network_wide_mib", "time_s", "speedup", "pinned_cut", "recompute_ops")


def _load_trace(folder: Path, net: str, hw: Hardware) -> Trace | None:
    from ..compute import with_model_times
    from ..trace import load_trace

    path = folder / "traces" / f"{net}.vsim.json.gz"
    return with_model_times(load_trace(path), hw) if path.is_file() else None


def _run(trace: Trace, hw: Hardware, spec: str, allocator: str,
         offload: str | None = None) -> dict[str, Any]:
    from ..allocator import make_allocator
    from ..engine import simulate
    from ..policies import make_policy
    from .superneurons import ConvOffload

    policy: Any = make_policy(spec)
    if offload == "conv":
        policy = ConvOffload(policy)
    elif offload is not None:
        raise ConfigError(f"unknown offload {offload!r} (conv)")
    return simulate(trace, hw, policy, make_allocator(allocator)).report


def _semantics(name: str) -> Any:
    from .superneurons import superneurons_semantics
    from .vdnn import vdnn_semantics

    known = {"vdnn": vdnn_semantics, "superneurons": superneurons_semantics}
    if name not in known:
        raise ConfigError(f"unknown transform {name!r} ({', '.join(known)})")
    return known[name]


def _predict(fig: dict[str, Any], trace: Trace, hw: Hardware,
             transform: str = "vdnn") -> tuple[float | None, str]:
    """(predicted value, note); None with the reason when the run does not fit."""
    t = _semantics(transform)(trace)
    metric = fig["metric"]
    if metric == "network_wide_mib":
        return sum(x.size_bytes for x in t.tensors) / MIB, ""
    alloc = str(fig.get("allocator", "exact"))
    r = _run(t, hw, str(fig.get("policy", "none")), alloc, fig.get("offload"))
    if not r["fits"]:
        return None, f"predicted out of memory under {fig.get('policy')} ({alloc})"
    if metric == "peak_mib":
        return r["peak_allocated_bytes"] / MIB, ""
    if metric == "time_s":
        return r["iteration_time_us"] * float(fig.get("iterations", 1)) / 1e6, ""
    if metric == "recompute_ops":
        from ..policies import make_policy
        from ..policies.base import Recompute

        plan = make_policy(str(fig.get("policy", "none"))).plan(t, hw, hw.capacity_bytes)
        return float(sum(len(a.ops) for a in plan.actions if isinstance(a, Recompute))), ""
    other = _run(t, hw, str(fig["against"]), alloc)
    if not other["fits"]:
        return None, f"{fig['against']} predicted out of memory"
    if metric == "speedup":
        return 1 - r["iteration_time_us"] / other["iteration_time_us"], ""
    if metric == "pinned_cut":
        base = other["pinned_host_peak_bytes"]
        return (1 - r["pinned_host_peak_bytes"] / base if base else 0.0), ""
    raise ConfigError(f"unknown metric {metric!r} (one of {', '.join(METRICS)})")


def check_figures(path: str | Path, doc: dict[str, Any],
                  say: Any = lambda _m: None) -> dict[str, Any]:
    """Every figure of a seed paper file: {paper, hardware, figures: [...], ok}."""
    where = str(path)
    folder = Path(path).parent
    hw = load_hardware(str(doc["hardware"]))
    tol = {k: parse_percent(v, f"{where}: tolerance") for k, v in doc["tolerance"].items()}
    traces: dict[str, Trace | None] = {}
    rows = []
    for i, fig in enumerate(doc["figures"]):
        for key in ("id", "metric", "published", "kind"):
            if key not in fig:
                raise ConfigError(f"figure {i} lacks {key!r}", where)
        if fig["metric"] not in METRICS:
            raise ConfigError(f"figure {fig['id']}: unknown metric {fig['metric']!r}", where)
        say(f"{doc.get('title', where)}: {fig['id']}")
        predicted: float | None = None
        cause = ""
        missing = [k for k in fig.get("inputs_required", []) if fig.get(k) is None]
        net = fig.get("network")
        if missing:
            cause = f"input not measured: {', '.join(missing)} ({fig.get('where_measured', '')})"
        elif net is None:
            cause = str(fig.get("cause", "no network given"))
        else:
            if net not in traces:
                traces[net] = _load_trace(folder, str(net), hw)
            trace = traces[net]
            if trace is None:
                cause = f"no trace {net} (validation/paper/make_traces.sh)"
            else:
                predicted, cause = _predict(fig, trace, hw, str(doc.get("transform", "vdnn")))
        published = float(fig["published"])
        error = None if predicted is None or not published else predicted / published - 1
        if fig["kind"] == "count":
            ok = predicted is not None and round(predicted) == round(published)
        elif fig.get("bound") == "at_least":
            ok = predicted is not None and predicted >= published * (1 - tol["memory"])
        else:
            ok = error is not None and abs(error) <= tol[str(fig["kind"])]
        if not ok:
            # the run's own note (e.g. out of memory) and the file's analysed cause, both:
            # a note must not hide the cause the paper file gives
            parts = [str(c) for c in dict.fromkeys((cause, fig.get("cause"))) if c]
            cause = "; ".join(parts) or "outside tolerance; cause not analysed yet"
        rows.append({"id": fig["id"], "source": fig.get("source", ""), "network": net,
                     "policy": fig.get("policy"), "metric": fig["metric"],
                     "kind": fig["kind"], "unit": fig.get("unit", ""),
                     "published": published, "predicted": predicted, "error": error,
                     "ok": ok, "cause": "" if ok else cause})
    return {"paper": where, "title": doc.get("title", ""), "hardware": hw.name,
            "figures": rows, "ok": all(r["ok"] for r in rows)}
