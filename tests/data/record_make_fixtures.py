"""Make the importer fixtures on a CUDA machine: a torch.profiler Chrome export and a
torch.cuda.memory._dump_snapshot pickle of two training steps of a tiny CNN.

    python tests/data/record_make_fixtures.py OUTDIR
writes OUTDIR/record-kineto-cuda.json.gz and OUTDIR/record-snapshot-cuda.pickle (copy them to
tests/data/)."""

from __future__ import annotations

import gzip
import shutil
import sys
import tempfile
from pathlib import Path

import torch


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(inplace=True),
                                torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 8 * 8, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(4, 3, 16, 16, device="cuda"), torch.randint(0, 10, (4,), device="cuda")

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.json"
        with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU,
                            torch.profiler.ProfilerActivity.CUDA],
                profile_memory=True,
                schedule=torch.profiler.schedule(wait=0, warmup=1, active=1),
                on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
            for _ in range(2):
                step()
                torch.cuda.synchronize()
                prof.step()
        with open(path, "rb") as src, gzip.open(out / "record-kineto-cuda.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    torch.cuda.memory._record_memory_history("all", context=None, stacks="python")
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(str(out / "record-snapshot-cuda.pickle"))
    torch.cuda.memory._record_memory_history(None)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
