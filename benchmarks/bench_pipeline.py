"""The whole decode step of one layer's KV side (sgl_dsv4_kernels.pipeline.KVLayer.decode_step) per layer kind at
batch 1, 64 and 256 under CUDA-graph replay, next to the sum of its ops' standalone times (each op recorded from
eager steps and replayed alone from its own graph, same arguments). A graph holds STEPS_PER_GRAPH decode batches of
distinct requests over one layer's caches, and every replay starts from an L2 holding only the steps' inputs (and,
for an op alone, the metadata its step's earlier kernels would have just written): the cache slots and ring rows
each step writes and reads come cold, as at a layer's next step in serving.
Target (issue 7): at batch 64 the step is within 1.5x of that sum, i.e. no hidden syncs, copies or allocations
between the kernels.

    python -m benchmarks.bench_pipeline
"""
from __future__ import annotations

import dataclasses
from typing import List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sgl_dsv4_kernels.pipeline import KVLayer, LayerKind, LayerRows, LayerWeights, RequestPool, StepBatch
from sgl_dsv4_kernels.pipeline.pool import PoolGeometry

from .harness import Bench, row

BATCHES = (1, 64, 256)
MAX_TOKENS = 4096  # request lengths are drawn from [256, MAX_TOKENS]
VERIFY_WIDTH = 4  # rings sized for 4-token verify, as a speculative deployment would
STEPS_PER_GRAPH = 8  # decode batches of distinct requests captured back to back in one graph


class _RecordOps(TorchDispatchMode):
    """Every op one call dispatches, with its arguments (the ops a kernel calls internally are not seen)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _decode_batches(kind: LayerKind, batch: int, seed: int, device="cuda") -> List[KVLayer]:
    """STEPS_PER_GRAPH decode batches of ``batch`` live requests each (random lengths, about 1/r of them emit),
    no request in two of them, all decoding into one layer's caches: each step writes its own slots and rows."""
    gen = torch.Generator().manual_seed(seed)
    requests = batch * STEPS_PER_GRAPH
    pool = RequestPool(PoolGeometry.for_requests(requests, MAX_TOKENS, swa_page_size=64), device=device, seed=seed)
    rids = [pool.admit() for _ in range(requests)]
    lengths = torch.randint(256, MAX_TOKENS, (requests,), generator=gen).tolist()
    for rid, length in zip(rids, lengths):
        pool.reserve(rid, length)
        pool.lengths[rid] = length - 1
    pool.sync_tables()
    weights = LayerWeights.random(kind, MAX_TOKENS, gen)
    layer = KVLayer(kind, pool.geometry, weights, (pool.device_req_to_token, pool.device_full_to_swa),
                    decode_batch=batch, verify_width=VERIFY_WIDTH, device=device)
    batches = [layer] + [layer.another_decode_batch() for _ in range(STEPS_PER_GRAPH - 1)]
    for i, b in enumerate(batches):
        part = rids[i * batch:(i + 1) * batch]
        step = StepBatch("decode", part, [pool.lengths[r] for r in part], [1] * batch)
        b.load_decode(pool.step_inputs(step).to(device), LayerRows.random(kind, batch, gen).to(device))
    return batches


def _tensors(obj) -> List[torch.Tensor]:
    """Every tensor in a tensor, dataclass or tuple, recursively."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _step_bytes(layer: KVLayer, batch: int) -> int:
    """A lower bound on the bytes one step moves: each request's activation rows read once, its SWA row and
    state row written, its output rows written, and 1/r of a compressed row (plus indexer row) written.
    Ring windows read on emitting steps and the metadata are not counted."""
    rows = layer.decode_rows
    spec = layer.spec
    read = sum(t[0].numel() * t.element_size() for t in (rows.kv, rows.projection, rows.index_projection)
               if t is not None)
    state = rows.projection[0].numel() * 4 if spec.has_state_ring else 0
    state += rows.index_projection[0].numel() * 4 if rows.index_projection is not None else 0
    out = 512 * (4 if spec.ratio in (4, 128) else 2) + (128 * 4 if spec.has_indexer else 0)
    compressed = spec.compressed_layout.bytes_per_token / spec.ratio
    compressed += layer.indexer_format.bytes_per_token / spec.ratio if spec.has_indexer else 0
    return int(batch * (read + spec.swa_layout.bytes_per_token + state + out + compressed))


def _op_name(func) -> str:
    return func.overloadpacket.__name__


def run(bench: Bench, results) -> None:
    print(f"{'layer':8s} {'batch':>5s} {'step us':>9s} {'sum of ops':>10s} {'ratio':>6s}  ops (standalone us)")
    for kind in LayerKind:
        for batch in BATCHES:
            batches = _decode_batches(kind, batch, seed=batch)
            # What serving's previous kernels have just written: the steps' inputs, and the layer's weights.
            hot = _tensors([[b.decode_inputs, b.decode_rows] for b in batches]) + _tensors(batches[0].weights)
            step_us = bench.time_graph([b.decode_step for b in batches], hot=hot)
            recorded = []
            for b in batches:
                with _RecordOps() as ops:
                    b.decode_step()
                recorded.append(ops.calls)
            assert len({len(calls) for calls in recorded}) == 1, "the batches' steps dispatch different ops"
            # Alone, an op finds the metadata its step's earlier kernels would have just written hot as well.
            hot_alone = hot + _tensors([b.decode_meta for b in batches])
            op_us = [(_op_name(calls[0][0]), bench.time_graph([lambda f=f, a=a, k=k: f(*a, **k) for f, a, k in calls],
                                                               hot=hot_alone))
                     for calls in zip(*recorded)]
            sum_us = sum(us for _, us in op_us)
            nbytes = _step_bytes(batches[0], batch)
            target = "<= 1.5x sum of ops" if batch == 64 else ""
            results.append(row(bench, family="pipeline", op="decode step", case=kind.value, n=batch, us=step_us,
                               nbytes=nbytes, baseline_us=sum_us, baseline_bytes=nbytes,
                               target=target + (f" ({step_us / sum_us:.2f}x)" if target else "")))
            results.append(row(bench, family="pipeline", op=f"sum of {len(op_us)} ops", case=kind.value, n=batch,
                               us=sum_us, nbytes=nbytes))
            print(f"{kind.value:8s} {batch:5d} {step_us:9.2f} {sum_us:10.2f} {step_us / sum_us:6.2f}  "
                  + ", ".join(f"{name} {us:.1f}" for name, us in op_us))
            del batches, recorded
            torch.cuda.empty_cache()


def main():
    from .run import summary

    bench = Bench()
    print(f"copy bandwidth {bench.copy_gbps:.0f} GB/s")
    results = []
    run(bench, results)
    print(summary(results))


if __name__ == "__main__":
    main()
