"""Shared model of an inference engine for the c4/c128 tests (compressors.md §2, §8): request and SWA
tables with page-aligned allocation, state owners with the dummy owner 0, committed row histories, and
one checked call of plan -> compress_forward against the fp64 truth and the exact state rows.
"""
from __future__ import annotations

import bisect
import zlib
from typing import Dict, List, Optional, Sequence

import pytest
import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import reference as ref

torch.set_flush_denormal(False)

HAS_CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]

ATOL = RTOL = 2e-5  # §4.5


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def window_of(ratio: int) -> int:
    return 8 if ratio == 4 else 128


def width_of(ratio: int, head_dim: int) -> int:
    return (4 if ratio == 4 else 2) * head_dim


def capacity(ratio: int, ring: int) -> int:
    return ring - window_of(ratio) + 2 if ring > window_of(ratio) else 1


class Engine:
    """Requests 1..num_requests (rid 0 is the dummy of padded rows) over one c4/c128 layer.

    Paged c4: request rid's position p lives at full loc rid*T + p and SWA loc
    page*sps + p % sps, with page = 1 + (rid - 1) * pages_per_request + p // sps (page 0 is the dummy
    page, req_to_token[0, :] = 0, full_to_swa[0] = 0). Request rings: owner rid.
    """

    def __init__(self, ratio: int, head_dim: int, ring: int, *, paged: bool, sps: int = 256,
                 num_requests: int = 4, max_tokens: int = 2048, state_dtype=torch.float32,
                 input_dtype=torch.float32, device="cpu", seed=("engine",)):
        self.ratio, self.D, self.ring = ratio, head_dim, ring
        self.W = width_of(ratio, head_dim)
        self.paged = ratio == 4 and paged
        self.sps = sps if self.paged else 0
        self.R = num_requests + 1
        self.T = max_tokens
        self.device = torch.device(device)
        self.state_dtype, self.input_dtype = state_dtype, input_dtype
        self.gen = gen(*seed)
        R, T = self.R, self.T
        if self.paged:
            self.pages_per_request = -(-T // sps)
            p = torch.arange(T)
            r2t = torch.zeros(R, T, dtype=torch.int64)
            f2s = torch.zeros(R * T, dtype=torch.int64)
            for rid in range(1, R):
                loc = rid * T + p
                r2t[rid] = loc
                f2s[loc] = (1 + (rid - 1) * self.pages_per_request + p // sps) * sps + p % sps
            owners = 1 + (R - 1) * self.pages_per_request
            self.req_to_token, self.full_to_swa = r2t, f2s
        else:
            owners = R
            self.req_to_token = torch.zeros(R, T, dtype=torch.int32)  # bounds only
            self.full_to_swa = None
        self.owners = owners
        self.ape = torch.randn(window_of(ratio), head_dim, generator=self.gen)
        self.state = dsv4.alloc_compress_state(ratio, head_dim, owners, ring, state_dtype, self.device)
        self.pad_page = self.state[-ratio:].clone()
        self.history: Dict[int, torch.Tensor] = {rid: torch.zeros(0, self.W) for rid in range(R)}

    # ---- addressing (§2.2), from the tables above ----

    def slot(self, rid: int, p: int) -> int:
        if self.paged:
            swa = int(self.full_to_swa[int(self.req_to_token[rid, p])])
            return (swa // self.sps) * self.ring + swa % self.ring
        return rid * self.ring + p % self.ring

    def owner0_rows(self) -> slice:
        return slice(0, self.ring)

    def share_prefix(self, dst: int, src: int, length: int) -> None:
        """dst starts from src's cached prefix of `length` tokens (length % sps == 0 in paged mode)."""
        assert not self.paged or length % self.sps == 0
        self.req_to_token[dst, :length] = self.req_to_token[src, :length]
        self.history[dst] = self.history[src][:length].clone()

    # ---- inputs ----

    def rows(self, n: int, bf16_exact: bool = False) -> torch.Tensor:
        x = torch.randn(n, self.W, generator=self.gen) * 2
        if bf16_exact or self.state_dtype == torch.bfloat16 or self.input_dtype == torch.bfloat16:
            x = x.bfloat16().float()
        return x

    def tables(self):
        r2t = self.req_to_token.to(self.device)
        f2s = self.full_to_swa.to(self.device) if self.full_to_swa is not None else None
        return r2t, f2s

    def plan_kwargs(self) -> dict:
        return dict(compress_ratio=self.ratio, ring_size=self.ring, swa_page_size=self.sps,
                    use_req_ring=not self.paged)

    # ---- one checked call ----

    def extend(self, rids: Sequence[int], extend_lens: Sequence[int], rows: Optional[List[torch.Tensor]] = None,
               prefixes: Optional[Sequence[int]] = None, accept: Optional[Sequence[int]] = None,
               padded_ok: bool = False, use_cuda_graph: bool = False, num_q_tokens: Optional[int] = None,
               check_reference_plan: bool = True, out_tol: Optional[float] = None) -> torch.Tensor:
        """A prefill / extend / verify call. Request b extends from `prefixes[b]` (default: its
        committed length) by extend_lens[b] rows; afterwards `accept[b]` rows (default all) are
        committed. Returns the op output. Checks plan bytes, outputs, state rows and the pad page."""
        B = len(rids)
        prefixes = [len(self.history[r]) for r in rids] if prefixes is None else list(prefixes)
        rows = [self.rows(e) for e in extend_lens] if rows is None else rows
        seq_lens = [p + e for p, e in zip(prefixes, extend_lens)]
        nq = sum(extend_lens) if num_q_tokens is None else num_q_tokens
        x = torch.cat(rows + [torch.zeros(nq - sum(extend_lens), self.W)]) if rows else torch.zeros(nq, self.W)
        r2t, f2s = self.tables()
        rid_t = torch.tensor(rids, dtype=torch.int64)
        L_t = torch.tensor(seq_lens, dtype=torch.int32)
        E_t = torch.tensor(extend_lens, dtype=torch.int64)
        plan = dsv4.plan_compress_prefill(rid_t.to(self.device), L_t.to(self.device), E_t.to(self.device), r2t, f2s,
                                          num_q_tokens=nq, use_cuda_graph=use_cuda_graph, **self.plan_kwargs())
        if check_reference_plan:
            graph_rows = use_cuda_graph or self.device.type == "cuda"
            rc, rw = ref.plan_compress_prefill(rid_t, L_t, E_t, self.req_to_token, self.full_to_swa, nq, self.ratio,
                                               self.sps, self.ring, not self.paged, graph_rows)
            assert torch.equal(plan.plan.cpu(), rc), "CompressPlan bytes differ from the reference planner"
            assert torch.equal(plan.plan_w.cpu(), rw), "WritePlan bytes differ from the reference planner"
        before = self.state.clone()
        x_dev = x.to(self.device, self.input_dtype)
        out = dsv4.compress_forward(self.state, x_dev, self.ape.to(self.device), plan, head_dim=self.D)
        # Expected outputs: the fp64 truth of each entry's request.
        offsets = [0]
        for e in extend_lens:
            offsets.append(offsets[-1] + e)
        full = [torch.cat([self.history[r][:p], rows[b]]) for b, (r, p) in enumerate(zip(rids, prefixes))]
        fields = ref.unpack_plan(plan.plan, "compress")
        expected = torch.zeros(plan.plan.shape[0], self.D, dtype=torch.float64)
        emitted = torch.zeros(plan.plan.shape[0], dtype=torch.bool)
        entries = {}  # request -> all its fp64 entries, computed once
        for k in range(plan.plan.shape[0]):
            if not bool(fields["valid"][k]):
                continue
            q = int(fields["ragged_id"][k])
            b = bisect.bisect_right(offsets, q) - 1  # the request whose ragged rows hold q
            g = int(fields["seq_len"][k]) // self.ratio - 1
            if b not in entries:
                entries[b] = ref.compress_entries_fp64(full[b], self.ape, self.ratio, self.D)
            expected[k] = entries[b][g]
            emitted[k] = True
        check_output(out, expected, emitted, self.input_dtype, out_tol)
        writes = ref.unpack_plan(plan.plan_w, "write")
        # the request of each WritePlan row, from its ragged id (invalid rows' ids are not looked up)
        write_rids = [rids[min(bisect.bisect_right(offsets, q) - 1, B - 1)] if valid else None
                      for q, valid in zip(writes["ragged_id"].tolist(), writes["valid"].tolist())]
        self._check_writes(before, x, writes, padded_ok, write_rids)
        accept = extend_lens if accept is None else accept
        for b, r in enumerate(rids):
            if r != 0 or not padded_ok:
                self.history[r] = full[b][: prefixes[b] + accept[b]]
        return out

    def decode(self, rids: Sequence[int], rows: Optional[torch.Tensor] = None, seq_lens: Optional[Sequence[int]] = None,
               padded_ok: bool = False, out_tol: Optional[float] = None) -> torch.Tensor:
        """One decode step of every request (seq_len = committed length + 1 unless given)."""
        B = len(rids)
        seq_lens = [len(self.history[r]) + 1 for r in rids] if seq_lens is None else list(seq_lens)
        x = self.rows(B) if rows is None else rows
        r2t, f2s = self.tables()
        rid_t = torch.tensor(rids, dtype=torch.int32)
        L_t = torch.tensor(seq_lens, dtype=torch.int64)
        plan = dsv4.plan_compress_decode(rid_t.to(self.device), L_t.to(self.device), r2t, f2s, **self.plan_kwargs())
        assert torch.equal(plan.plan.cpu(), ref.plan_compress_decode(rid_t, L_t, self.req_to_token, self.full_to_swa,
                                                                     self.ratio, self.sps, self.ring, not self.paged))
        before = self.state.clone()
        out = dsv4.compress_forward(self.state, x.to(self.device, self.input_dtype), self.ape.to(self.device), plan,
                                    head_dim=self.D)
        expected = torch.zeros(B, self.D, dtype=torch.float64)
        emitted = torch.zeros(B, dtype=torch.bool)
        full = []
        for b, (r, L) in enumerate(zip(rids, seq_lens)):
            full.append(torch.cat([self.history[r][: L - 1], x[b:b + 1]]))
            if L % self.ratio == 0 and not (padded_ok and r == 0):
                expected[b] = truth_entry(full[b], self.ape, self.ratio, self.D, L // self.ratio - 1)
                emitted[b] = True
        if padded_ok:  # padded rows' outputs are not compared
            keep = torch.tensor([r != 0 for r in rids])
            out_checked = out.cpu()[keep]
            check_output(out_checked, expected[keep], emitted[keep], self.input_dtype, out_tol)
        else:
            check_output(out, expected, emitted, self.input_dtype, out_tol)
        d = ref.unpack_plan(plan.plan, "decode")
        writes = dict(ragged_id=torch.arange(B), write_loc=d["write_loc"], valid=d["valid"])
        self._check_writes(before, x, writes, padded_ok, list(rids))
        for b, r in enumerate(rids):
            if r != 0 or not padded_ok:
                self.history[r] = full[b]
        return out

    def _check_writes(self, before: torch.Tensor, x: torch.Tensor, writes: dict, padded_ok: bool,
                      write_rids: Sequence[Optional[int]]) -> None:
        """The state equals `before` with each valid write applied (row = input row in the state dtype),
        the pad page is untouched, and no two live writes share a row. With padded rows (rid 0, §3.4), every
        write of a padded row lands in dummy owner 0's rows [0, ring) (or is an invalid lookup), and every row
        outside owner 0 that no live write targets is unchanged: the expected state applies the padded rows'
        writes too, so it alone would take a padded write into a live request's row for a correct one."""
        rows = before.shape[0]
        expected = before.cpu().clone()
        seen = set()
        o0 = self.owner0_rows()
        if padded_ok:
            live_rows = torch.zeros(rows, dtype=torch.bool)
            for rid, dst, valid in zip(write_rids, writes["write_loc"].tolist(), writes["valid"].tolist()):
                if not valid:
                    continue
                if rid == 0:
                    assert dst == -1 or o0.start <= dst < o0.stop, \
                        f"a padded row (rid 0) wrote state row {dst}, outside owner 0's rows [0, {o0.stop})"
                elif 0 <= dst < rows:
                    live_rows[dst] = True
            untouched = ~live_rows
            untouched[o0] = False
            got_rows, before_rows = self.state.cpu()[untouched], before.cpu()[untouched]
            as_int = torch.int16 if got_rows.dtype == torch.bfloat16 else torch.int32
            assert torch.equal(got_rows.view(as_int), before_rows.view(as_int)), \
                "a state row outside owner 0 and outside the live write set changed"
        for q, dst, valid in zip(writes["ragged_id"].tolist(), writes["write_loc"].tolist(), writes["valid"].tolist()):
            if not valid or not (0 <= dst < rows - self.ratio) or q >= x.shape[0]:
                continue
            if not (o0.start <= dst < o0.stop):
                assert dst not in seen, f"two writes of state row {dst} in one call"
                seen.add(dst)
            expected[dst] = x[q].to(self.state_dtype)
        got = self.state.cpu()
        if padded_ok:
            got, expected = got[o0.stop:], expected[o0.stop:]
        assert torch.equal(got.view(-1).view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                           expected.view(-1).view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32)), \
            "state rows differ from the input rows of the call's writes"
        assert torch.equal(self.state[-self.ratio:].cpu(), self.pad_page.cpu()), "the pad page was written"


def truth_entry(rows: torch.Tensor, ape: torch.Tensor, ratio: int, head_dim: int, g: int) -> torch.Tensor:
    """fp64 entry g of a request whose rows (positions 0..) are `rows`; uses only the rows it pools."""
    if ratio == 128:
        return ref.compress_entries_fp64(rows[128 * g:128 * g + 128], ape, ratio, head_dim)[0]
    if g == 0:
        return ref.compress_entries_fp64(rows[0:4], ape, ratio, head_dim)[0]
    return ref.compress_entries_fp64(rows[4 * g - 4:4 * g + 4], ape, ratio, head_dim)[1]


def check_output(out: torch.Tensor, expected: torch.Tensor, emitted: torch.Tensor, dtype, tol: Optional[float]):
    """Emitting rows against the fp64 truth (§4.5); every other row is exactly zero."""
    out = out.cpu()
    assert out.dtype == dtype
    assert torch.all(out[~emitted] == 0), "rows without an entry must be zero"
    got, want = out[emitted].double(), expected[emitted]
    if got.numel() == 0:
        return
    if tol is not None:
        err = (got - want).abs().max().item()
        assert err < tol, f"max |out - truth| = {err} >= {tol}"
    elif dtype == torch.bfloat16:
        # Within one bf16 ulp of the truth rounded to bf16. Outputs that cancel to near zero carry the
        # fp32 accumulation error of inputs ~100x larger, so the fp32 atol is the floor of the bound.
        t = want.float().bfloat16().double()
        ulp = (t.abs().clamp_min(2.0**-126).log2().floor() - 7).exp2()
        bound = torch.maximum(ulp, torch.full_like(ulp, ATOL))
        assert torch.all((got - t).abs() <= bound), f"bf16 output off by more than one ulp: {(got - t).abs().max()}"
    else:
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
