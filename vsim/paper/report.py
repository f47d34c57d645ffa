"""The text `vsim validate validation/paper` prints: every figure with predicted, published, error
and ok or MISS (a miss with its cause)."""

from __future__ import annotations

from typing import Any


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f}"


def format_result(r: dict[str, Any]) -> str:
    """One paper file's comparison as text."""
    return format_seed(r) if "figures" in r else format_vdnn(r)


def format_seed(r: dict[str, Any]) -> str:
    lines = [f"{r['paper']} ({r['title']}) on {r['hardware']}",
             f"{'figure':58} {'published':>11} {'predicted':>11} {'error':>8}  ok"]
    for f in r["figures"]:
        pred = "-" if f["predicted"] is None else f"{f['predicted']:.4g}"
        lines.append(f"{f['id'][:58]:58} {f['published']:>11.4g} {pred:>11} "
                     f"{_pct(f['error']):>8}  {'ok' if f['ok'] else 'MISS'}")
        if not f["ok"]:
            lines.append(f"{'':4}cause: {f['cause']}")
    n_miss = sum(not f["ok"] for f in r["figures"])
    lines.append(f"{len(r['figures']) - n_miss} of {len(r['figures'])} figures within tolerance")
    return "\n".join(lines)


def _headline(r: dict[str, Any]) -> list[str]:
    lines = ["", "Headline (cnmem at the card's capacity; fits* = without fragmentation; "
             "vDNN order = vDNN's per-layer allocation order through cnmem)"]
    for h in r["headline"]:
        if h["kind"] == "fits":
            order = {None: "-", True: "fits", False: "no"}[h["fits_vdnn_order"]]
            lines.append(f"  {h['figure']:44} published {h['published']:>5}  predicted "
                         f"{h['predicted']:>13}  fits* {'yes' if h['fits_exact'] else 'no':3} "
                         f"vDNN order {order:4}  {'ok' if h['ok'] else 'MISS'}")
        else:
            lines.append(f"  {h['figure']:44} published {h['published'] / 2**30:.2f} GiB  "
                         f"predicted {h['predicted'] / 2**30:.2f} GiB  {_pct(h['error'])}  "
                         f"{'ok' if h['ok'] else 'MISS'}")
        if not h["ok"]:
            lines.append(f"    cause: {h['cause']}")
    return lines


def format_vdnn(r: dict[str, Any]) -> str:
    """The paper comparison as tables: Fig. 1/4, Fig. 6, the policies, the deep VGGs."""
    lines = [f"{r['paper']} on {r['hardware']}", "",
             "Fig. 1 and 4: baseline memory (MiB), vDNN's semantics, predicted / paper"]
    lines.append(f"{'network':15} {'weights':>12} {'feature maps':>14} {'gradient maps':>14} "
                 f"{'workspace':>12} {'total':>13} {'error':>7} {'(fig4 ws)':>9}  ok")
    for row in r["fig1"]:
        p, f = row["predicted"], row["paper_mib"]
        lines.append(
            f"{row['network']:15} {_mib(p['weights']):>6}/{f['weights']:<5} "
            f"{_mib(p['feature_maps']):>7}/{f['feature_maps']:<6} "
            f"{_mib(p['gradient_maps']):>7}/{f['gradient_maps']:<6} "
            f"{_mib(p['workspace']):>6}/{f['workspace']:<5} "
            f"{_mib(p['total']):>6}/{row['fig1_total_mib']:<6} {_pct(row['error']):>7} "
            f"{_pct(row['error_with_fig4_workspace']):>9}  {'ok' if row['ok'] else 'MISS'}")
    f6 = r["fig6"]
    t = f6["totals"]
    lines += ["", "Fig. 6: VGG-16(64) per-layer time (ms), predicted / paper"]
    for row in f6["rows"]:
        pf = "-" if row["paper_fwd_ms"] is None else row["paper_fwd_ms"]
        pb = "-" if row["paper_bwd_ms"] is None else row["paper_bwd_ms"]
        lines.append(f"  {row['layer']:7} fwd {row['fwd_ms']:7.1f} / {pf:>6}   bwd "
                     f"{row['bwd_ms']:7.1f} / {pb:>6}")
    lines.append(f"  total   fwd {t['fwd_ms']:7.1f} / {t['paper_fwd_ms']:6.1f}   bwd "
                 f"{t['bwd_ms']:7.1f} / {t['paper_bwd_ms']:6.1f}   all {_pct(f6['error'])} "
                 f"{'ok' if f6['ok'] else 'MISS'}")
    if "policies" in r:
        lines += ["", "Predicted outcome of the paper's policies (cnmem at the card's capacity; "
                  "base = network-wide allocation; throughput of the feature-extraction layers "
                  "relative to base(p) on a GPU with room for it; fits* = also without "
                  "fragmentation)"]
        lines.append(f"{'network':15} {'policy':8} {'fits':>5} {'fits*':>5} {'peak GiB':>9} "
                     f"{'avg GiB':>8} {'offload GiB':>11} {'throughput':>10}")
        for net, rows in r["policies"].items():
            for p in rows:
                thr = "-" if p["feature_throughput"] is None else f"{p['feature_throughput']:.2f}"
                lines.append(f"{net:15} {p['policy']:8} {'yes' if p['fits'] else 'no':>5} "
                             f"{'yes' if p['fits_exact'] else 'no':>5} "
                             f"{p['peak_bytes'] / 2**30:9.2f} {p['avg_bytes'] / 2**30:8.2f} "
                             f"{p['offloaded_bytes'] / 2**30:11.2f} {thr:>10}")
                for note in p["notes"]:
                    lines.append(f"{'':25}{note}")
                net = ""
    if "deep" in r:
        lines += ["", "vDNN_dyn on the very deep VGGs, batch 32 (GiB)"]
        lines.append(f"{'network':12} {'baseline':>9} {'fits':>5} {'GPU peak':>9} "
                     f"{'host pinned':>12}  choice")
        for d in r["deep"]:
            lines.append(f"{d['network']:12} {d['baseline_bytes'] / 2**30:9.2f} "
                         f"{'yes' if d['fits'] else 'no':>5} {d['peak_bytes'] / 2**30:9.2f} "
                         f"{d['pinned_host_bytes'] / 2**30:12.2f}  {d['choice']}")
    if "headline" in r:
        lines += _headline(r)
    for row in r["fig1"]:
        if not row["ok"]:
            lines.append(f"MISS Fig. 1 {row['network']}: {_pct(row['error'])}; cause: cuDNN 4's "
                         "workspace (the error with Fig. 4's own workspace is "
                         f"{_pct(row['error_with_fig4_workspace'])}; see docs/design.md)")
    return "\n".join(lines)

