"""Checks of a trace's graph that must stay linear in its size: repeated ids in an op's list,
and happens-before across streams (used by vsim.trace.io's reader)."""

from __future__ import annotations

import bisect

from .schema import Op


def first_repeat(ids: tuple[int, ...]) -> int:
    """The index of the first id that an earlier one repeats, or -1 (linear, not quadratic)."""
    if len(ids) < 2:
        return -1
    seen: set[int] = set()
    for j, tid in enumerate(ids):
        if tid in seen:
            return j
        seen.add(tid)
    return -1


class StreamOrder:
    """Happens-before across streams: ops of one stream run in trace order, and `deps` (CUDA
    events) order ops of different streams. A tensor used on one stream must have been
    produced, and before it is freed, read, on its own stream or by an op this one depends on
    (directly or through others); otherwise the replay could run the use first, as the GPU
    could. Only traces with several streams pay for this.

    No vector clocks (they grow with ops x streams: 20,000 one-op streams made 2*10^8 entries):
    memory is one position per op and the deps of the ops that have any. A query "does op A
    happen before op B" on different streams searches backwards from B: a frontier of
    (stream, highest position known to run before B), raised through the deps of the ops below
    it, each such op expanded once per query; most queries end at B's own deps."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.where: dict[int, tuple[int, int]] = {}          # op -> (stream, position on it)
        self.length: dict[int, int] = {}                     # stream -> ops on it so far
        self.dep_pos: dict[int, list[int]] = {}              # stream -> positions of ops with deps
        self.dep_ops: dict[int, list[tuple[int, ...]]] = {}  # stream -> those ops' deps
        self.readers: dict[int, dict[int, int]] = {}         # tensor -> stream -> last reader

    def enter(self, op: Op) -> None:
        if not self.enabled:
            return
        pos = self.length.get(op.stream, 0)
        self.length[op.stream] = pos + 1
        self.where[op.id] = (op.stream, pos)
        if op.deps:
            self.dep_pos.setdefault(op.stream, []).append(pos)
            self.dep_ops.setdefault(op.stream, []).append(op.deps)

    def before(self, first: int, op: Op) -> bool:
        """Whether op `first` (entered earlier) happens before `op` (just entered)."""
        stream, pos = self.where[first]
        own_stream, own_pos = self.where[op.id]
        if stream == own_stream:
            return own_pos >= pos
        reached: dict[int, int] = {own_stream: own_pos}  # stream -> highest position before op
        done: dict[int, int] = {}                        # stream -> deps expanded below here
        todo = [own_stream]
        while todo:
            s = todo.pop()
            high, low = reached[s], done.get(s, -1)
            if high <= low:
                continue
            done[s] = high
            positions = self.dep_pos.get(s, [])
            start = bisect.bisect_right(positions, low)
            stop = bisect.bisect_right(positions, high)
            dep_ops = self.dep_ops.get(s, [])
            # Newest first, by index (a slice copies): the closure is the same in any order, and
            # the nearest deps end most searches at once; oldest first made a chain of k synced
            # ops cost k steps per query (a 1M-op trace with 8k all-reduces: quadratic).
            for k in range(stop - 1, start - 1, -1):
                for dep in dep_ops[k]:
                    ds, dp = self.where[dep]
                    if ds == stream and dp >= pos:
                        return True
                    if dp > reached.get(ds, -1):
                        reached[ds] = dp
                        todo.append(ds)
        return reached.get(stream, -1) >= pos

    def use(self, op: Op, tensor: int, producer: int | None, frees: bool) -> str | None:
        """Why this read or free of `tensor` by `op` is unordered, or None."""
        if not self.enabled:
            return None
        # (a producer on the op's own stream entered before it, so runs before it: no search)
        if producer is not None and producer != op.id \
                and self.where[producer][0] != op.stream and not self.before(producer, op):
            return (f"tensor {tensor} is produced by op {producer} on stream "
                    f"{self.where[producer][0]} and used on stream {op.stream} with no "
                    f"dependency on it (list op {producer} in deps)")
        readers = self.readers.get(tensor)
        if readers is None:  # (setdefault would build a dict on every call)
            readers = self.readers[tensor] = {}
        if frees:
            for stream, reader in (sorted(readers.items()) if len(readers) > 1
                                   else readers.items()):
                if stream != op.stream and not self.before(reader, op):
                    return (f"tensor {tensor} is freed on stream {op.stream} while op {reader} "
                            f"on stream {stream} reads it with no dependency on it (list op "
                            f"{reader} in deps)")
        else:
            readers[op.stream] = op.id
        return None
