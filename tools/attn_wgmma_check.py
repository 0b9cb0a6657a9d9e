#!/usr/bin/env python3
"""Model checks of src/cuda/attention/prefill_wgmma.cu's index maps, written without a GPU.

Each check restates one map of the kernel (with the kernel's own constants and formulas) and
compares it exhaustively against what the hardware is documented to do (PTX ISA: the wgmma
fragment layouts and matrix descriptors, CUTLASS's canonical GMMA layouts; the TMA box layout and
its 128-byte swizzle):

  1. descriptors: the bit fields of desc_sw128 decode to the intended start / LBO / SBO / mode;
  2. operand addressing: every element wgmma reads for Q (A, K-major), K (B, K-major) and V
     (B, N-major, transposed) at every k-step is the element the tensor copies put there;
  3. fragments: S accumulators -> P A-fragments (make_p) give P's rows/keys; the mask's key index
     and the epilogue's column index match the accumulator layout;
  4. the algorithm: a numpy emulation of one block (row -> position/head, zero-filled rows past
     the tensor maps, the tile count, the diagonal mask condition, the loop's order of S_j,
     P_{j-1}·V_{j-1}, alpha and P_j, bf16 P) against plain softmax attention, many shapes;
  5. the mbarrier protocol: the producer and the two consumer warpgroups under random
     interleavings (parity waits as PTX defines them), with and without the ping-pong turns on
     named barriers: no deadlock, no stage overwritten while read, every tile read after it
     landed, no named-barrier phase left open;
  6. the grid: block -> (row tile, kv head) is a bijection, longest rows first.

Run: .venv/bin/python tools/attn_wgmma_check.py   (numpy; about a minute). It checks the model of
the code, not the compiled kernel: the GPU tests in tests/gpu/test_attention.cu do that.
"""
import random
import sys

import numpy as np

D, BM, STAGES, DBLK = 256, 128, 2, 4
Q_SLAB = BM * 128
Q_BYTES = DBLK * Q_SLAB


def set_tile(bn):
    """The kernel's Cfg<BN> (keys per tile)."""
    global BN, KV_SLAB, KV_BYTES, OFF_K, OFF_V
    BN = bn
    KV_SLAB = BN * 128
    KV_BYTES = DBLK * KV_SLAB
    OFF_K = Q_BYTES
    OFF_V = OFF_K + STAGES * KV_BYTES


def swz(addr):
    """The 128-byte swizzle on an absolute shared address: Swizzle<3,4,3> (bits 4-6 ^= bits 7-9)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def desc_sw128(addr, lbo):  # the kernel's desc_sw128
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((1024 >> 4) << 32) | (1 << 62)


def check_descriptors():
    for addr in (0, 1024, 65536 + 32, 196608 - 1024 + 96, 227 * 1024 - 1024):
        for lbo in (16, KV_SLAB):
            d = desc_sw128(addr, lbo)
            assert (d & 0x3FFF) << 4 == addr, "start address"
            assert ((d >> 16) & 0x3FFF) << 4 == lbo, "leading byte offset"
            assert ((d >> 32) & 0x3FFF) << 4 == 1024, "stride byte offset"
            assert (d >> 49) & 7 == 0, "base offset"
            assert d >> 62 == 1, "layout type 1 = 128-byte swizzle"
            assert (d >> 46) & 7 == 0 and (d >> 52) & 0x3FF == 0, "reserved bits"
    print("descriptors: ok")


def tma_phys(dst, box, idx):
    """Physical byte address of box element idx = (i0, i1, i2) in a tensor copy to dst (1024-aligned):
    the box is stored densely, innermost first, then swizzled."""
    b0, b1, _ = box
    i0, i1, i2 = idx
    assert dst % 1024 == 0 and b0 * 2 == 128
    return swz(dst + ((i2 * b1 + i1) * b0 + i0) * 2)


def kmajor_phys(start, sbo, m, k):
    """Element (m, k) of a K-major SW128 operand (m < 64 or N, k < 16), 16-bit elements:
    ((8,M/8),(8,2)):((64,SBO/2),(1,8)) elements, swizzled on the absolute address."""
    off = 2 * ((m % 8) * 64 + (k % 8) + 8 * (k // 8)) + (m // 8) * sbo
    return swz(start + off)


def nmajor_phys(start, lbo, sbo, k, n):
    """Element (k, n) of an N-major SW128 B operand (k < 16, n < N):
    ((8,8,N/64),(8,2)):((1,8,LBO/2),(64,SBO/2)) elements, swizzled."""
    off = 2 * ((n % 8) + 8 * ((n // 8) % 8) + 64 * (k % 8)) + (n // 64) * lbo + (k // 8) * sbo
    return swz(start + off)


def check_operands():
    base = 4096  # any 1024-aligned base
    for G in (1, 2, 4, 8, 16):
        # Q: copies (64 d, G heads, BM/G positions) to base + db*Q_SLAB; element (d, head h, pos p)
        where = {}
        for db in range(DBLK):
            for i2 in range(BM // G):
                for i1 in range(G):
                    for i0 in range(64):
                        a = tma_phys(base + db * Q_SLAB, (64, G, BM // G), (i0, i1, i2))
                        assert a not in where
                        where[a] = (i2 * G + i1, db * 64 + i0)  # (tile row, d)
        assert len(where) == Q_BYTES // 2
        for wg in range(2):
            q_addr = base + wg * 64 * 128
            for kk in range(D // 16):
                start = q_addr + (kk // 4) * Q_SLAB + (kk % 4) * 32
                for m in range(64):
                    for k in range(16):
                        got = where[kmajor_phys(start, 1024, m, k)]
                        assert got == (wg * 64 + m, 16 * kk + k), (G, wg, kk, m, k, got)
    # K and V stages: copies (64 d, 1 head, 64 keys) to stage + db*KV_SLAB
    for st in range(STAGES):
        for off, name in ((OFF_K, "K"), (OFF_V, "V")):
            stage = base + off + st * KV_BYTES
            where = {}
            for db in range(DBLK):
                for key in range(BN):
                    for i0 in range(64):
                        a = tma_phys(stage + db * KV_SLAB, (64, 1, BN), (i0, 0, key))
                        assert a not in where
                        where[a] = (key, db * 64 + i0)
            if name == "K":  # S = Q·Kᵀ: B(k = d, n = key), K-major: n plays the row
                for kk in range(D // 16):
                    start = stage + (kk // 4) * KV_SLAB + (kk % 4) * 32
                    for n in range(BN):
                        for k in range(16):
                            assert where[kmajor_phys(start, 1024, n, k)] == (n, 16 * kk + k)
            else:  # O += P·V: B(k = key, n = d), N-major
                for kc in range(BN // 16):
                    start = stage + kc * 16 * 128
                    for k in range(16):
                        for n in range(D):
                            assert where[nmajor_phys(start, KV_SLAB, 1024, k, n)] == (16 * kc + k, n)
    # regions: Q, K stages, V stages, barriers disjoint and 1024-aligned
    assert OFF_K % 1024 == 0 and OFF_V % 1024 == 0 and (OFF_V + STAGES * KV_BYTES) % 1024 == 0
    assert OFF_V + STAGES * KV_BYTES + 128 + 1024 <= 227 * 1024
    print("operand addressing (Q, K K-major; V N-major; TMA boxes, 128-byte swizzle): ok")


def acc_rc(warp, lane, i):
    """wgmma m64nNk16 f32 accumulator element i of (warp in group, lane): (row, col)."""
    g, c = lane // 4, lane % 4
    return 16 * warp + g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * c + (i & 1)


def afrag_rc(warp, lane, reg, half):
    """wgmma A-from-registers (m64k16, 16-bit) = mma.m16n8k16's A per warp: (row, k)."""
    g, c = lane // 4, lane % 4
    return 16 * warp + g + 8 * (reg & 1), 2 * c + half + 8 * (reg >> 1)


def check_fragments():
    rng = np.random.default_rng(1)
    S = rng.standard_normal((64, BN))
    for w in range(4):
        for lane in range(32):
            g, c = lane // 4, lane % 4
            s = [S[acc_rc(w, lane, i)] for i in range(BN // 2)]
            # the kernel's mask index: key 8*(i>>2) + 2c + (i&1), row h = (i>>1)&1
            for i in range(BN // 2):
                r, col = acc_rc(w, lane, i)
                assert col == 8 * (i >> 2) + 2 * c + (i & 1)
                assert r == 16 * w + g + 8 * ((i >> 1) & 1)
            # make_p: p[kc][0] = (s[8kc], s[8kc+1]), [1] = (s[8kc+2], s[8kc+3]), [2] = (4, 5), [3] = (6, 7)
            for kc in range(BN // 16):
                p = [(s[8 * kc + 0], s[8 * kc + 1]), (s[8 * kc + 2], s[8 * kc + 3]),
                     (s[8 * kc + 4], s[8 * kc + 5]), (s[8 * kc + 6], s[8 * kc + 7])]
                for reg in range(4):
                    for half in range(2):
                        r, k = afrag_rc(w, lane, reg, half)
                        assert p[reg][half] == S[r, 16 * kc + k]
            # softmax's per-row reductions: row h uses s[4b + 2h + e]
            for h in range(2):
                for b in range(BN // 8):
                    for e in range(2):
                        assert acc_rc(w, lane, 4 * b + 2 * h + e)[0] == 16 * w + g + 8 * h
            # epilogue (N = 256): o[4b + 2h + e] at row g + 8h, column 8b + 2c + e; rescale alpha[(i>>1)&1]
            for b in range(D // 8):
                for h in range(2):
                    for e in range(2):
                        assert acc_rc(w, lane, 4 * b + 2 * h + e) == (16 * w + g + 8 * h, 8 * b + 2 * c + e)
            for i in range(D // 2):
                assert acc_rc(w, lane, i)[0] == 16 * w + g + 8 * ((i >> 1) & 1)
    # each (row, col) of a 64 x 256 accumulator is held exactly once
    seen = {acc_rc(w, lane, i) for w in range(4) for lane in range(32) for i in range(D // 2)}
    assert len(seen) == 64 * D
    print("fragments (S -> P, mask keys, row reductions, epilogue columns): ok")


def bf16(x):
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def emulate(q, K, V, p0, n, G, kvh):
    """The kernel for one kv head: q [n, G, 256] (this head's group), K/V [p0+n(+pad), 256].
    Returns out [n, G, 256] (f32, before the bf16 store) and the number of tiles each block read."""
    kv_len = p0 + n
    n_rows = n * G
    row_tiles = (n_rows + BM - 1) // BM
    out = np.full((n, G, D), np.nan, dtype=np.float32)
    sl2 = np.float32(1.4426950408889634 / 16.0)
    for tile in range(row_tiles):
        row0 = tile * BM
        assert row0 % G == 0
        pos_lo = row0 // G
        pos_hi = min(n - 1, (row0 + BM - 1) // G)
        n_tiles = (p0 + pos_hi) // BN + 1
        # tensor copies: Q rows past n are zeros; keys past kv_len are zeros (the NaN pad is never read)
        Qt = np.zeros((BM, D), np.float32)
        for r in range(BM):
            pos = pos_lo + r // G
            if pos < n:
                Qt[r] = q[pos, r % G]
        Kt = np.zeros((n_tiles * BN, D), np.float32)
        Vt = np.zeros((n_tiles * BN, D), np.float32)
        m_keys = min(kv_len, n_tiles * BN)
        Kt[:m_keys] = K[:m_keys]
        Vt[:m_keys] = V[:m_keys]
        assert n_tiles * BN - BN < kv_len  # every tile holds at least one existing key
        for wg in range(2):
            rows = np.arange(row0 + wg * 64, row0 + wg * 64 + 64)
            qpos = p0 + np.where(rows < n_rows, rows // G, n - 1)
            qpos_min = p0 + min(n - 1, (row0 + wg * 64) // G)
            Qw = Qt[wg * 64:(wg + 1) * 64]
            o = np.zeros((64, D), np.float32)
            m = np.full(64, -np.inf, np.float32)
            l = np.zeros(64, np.float32)
            P = None

            def softmax(j):
                nonlocal m, l
                s = (Qw @ Kt[j * BN:(j + 1) * BN].T).astype(np.float32)
                if j * BN + BN - 1 > qpos_min:
                    keys = j * BN + np.arange(BN)
                    s = np.where(keys[None, :] > qpos[:, None], -np.inf, s)
                else:  # unmasked tiles must be fully visible to every row of the warpgroup
                    assert (j * BN + BN - 1 <= qpos).all()
                mx = s.max(axis=1)
                m_new = np.maximum(m, mx)
                m_use = np.where(m_new == -np.inf, 0, m_new).astype(np.float32)
                alpha = np.exp2((m - m_use) * sl2).astype(np.float32)
                m = m_new
                e = np.exp2(s * sl2 - m_use[:, None] * sl2).astype(np.float32)
                l = l * alpha + e.sum(axis=1)
                return e, alpha

            e, alpha = softmax(0)
            P = bf16(e)
            for j in range(1, n_tiles):
                # issue S_j; rescale O by alpha_{j-1}; O += P_{j-1}·V_{j-1}; softmax(S_j) -> alpha_j
                o = o * alpha[:, None]
                o = o + P @ Vt[(j - 1) * BN:j * BN]
                e, alpha = softmax(j)
                P = bf16(e)
            o = o * alpha[:, None]
            o = o + P @ Vt[(n_tiles - 1) * BN:n_tiles * BN]
            o = o / l[:, None]
            for ri, r in enumerate(rows):
                if r < n_rows:
                    assert np.isnan(out[r // G, r % G]).all(), "row written twice"
                    out[r // G, r % G] = o[ri]
    assert not np.isnan(out).any(), "row never written"
    return out


def reference(q, K, V, p0, n, G):
    out = np.zeros((n, G, D))
    for i in range(n):
        keys = p0 + i + 1
        s = np.einsum("hd,kd->hk", q[i].astype(np.float64), K[:keys].astype(np.float64)) / 16.0
        s -= s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        out[i] = p @ V[:keys].astype(np.float64)
    return out


def check_algorithm():
    rng = np.random.default_rng(7)
    cases = [(0, 1, 8), (0, 7, 8), (0, 64, 8), (0, 65, 8), (0, 127, 8), (0, 128, 8), (0, 129, 8),
             (0, 200, 8), (37, 200, 8), (1000, 3, 8), (0, 1000, 8), (60, 9, 8), (56, 16, 8),
             (0, 65, 2), (10, 70, 1), (5, 33, 1), (0, 40, 16), (3, 300, 4), (127, 2, 16),
             (62, 20, 8), (63, 5, 8), (126, 140, 8), (78, 20, 8), (79, 3, 8), (158, 30, 8)]  # first positions at and just before a tile end
    for p0, n, G in cases:
        kv_len = p0 + n
        q = bf16(rng.standard_normal((n, G, D)) * 1.5)
        K = bf16(rng.standard_normal((kv_len + 40, D)))
        V = bf16(rng.standard_normal((kv_len + 40, D)))
        K[kv_len:] = np.nan  # the cache past the written rows
        V[kv_len:] = np.nan
        got = emulate(q, K, V, p0, n, G, 0)
        ref = reference(q, K[:kv_len], V[:kv_len], p0, n, G)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 5e-3, (p0, n, G, err)
    print(f"algorithm emulation vs softmax attention ({len(cases)} shapes, bf16 P): ok")


def check_barriers():
    """Producer: for j: [j>=2: wait k_empty[s] parity (j/2-1)&1] expect k_full[s]; copies;
    [j>=2: wait v_empty[s] ...] expect v_full[s]; copies. Consumer (each of 2 warpgroups, 4 warps
    arriving): wait k_full[0] p0, S0, release k_empty[0]; for j>=1: wait k_full[j%2] p (j/2)&1,
    wait v_full[(j-1)%2] p ((j-1)/2)&1, [ping-pong: bar.sync 1+wg], issue, [bar.arrive 2-wg],
    release k_empty[j%2] (after S_j), release v_empty[(j-1)%2]; warpgroup 1 arrives on barrier 1
    before the loop and warpgroup 0 syncs on it after; end: wait v_full[(n-1)%2]."""

    class Bar:
        def __init__(self, count):
            self.count, self.pending, self.phase = count, count, 0  # phase: completed phases

        def arrive(self):
            self.pending -= 1
            assert self.pending >= 0
            if self.pending == 0:
                self.phase += 1
                self.pending = self.count

        def done(self, parity):  # try_wait.parity: the phase with this parity has completed
            return (self.phase & 1) != parity  # current (incomplete) phase parity differs

    class Named:  # bar.sync / bar.arrive with 256 threads: 2 warpgroups' worth of arrivals
        def __init__(self):
            self.arrived, self.phase = 0, 0

        def arrive(self):
            self.arrived += 1
            if self.arrived == 2:
                self.arrived = 0
                self.phase += 1

    for n_tiles, pingpong, seed in [(n, pp, s) for n in list(range(1, 9)) + [17, 40] for pp in (False, True)
                                    for s in range(30)]:
        if True:
            rnd = random.Random(seed * 1000 + n_tiles)
            kf = [Bar(1) for _ in range(STAGES)]
            vf = [Bar(1) for _ in range(STAGES)]
            ke = [Bar(8) for _ in range(STAGES)]
            ve = [Bar(8) for _ in range(STAGES)]
            k_stage = [None] * STAGES  # tile held (None: being written / empty)
            v_stage = [None] * STAGES
            k_readers = [set() for _ in range(STAGES)]
            v_readers = [set() for _ in range(STAGES)]
            inflight = []  # (kind, stage, tile)
            named = [Named(), Named()]  # barrier 1 + w: warpgroup w's turn

            def producer():
                for j in range(n_tiles):
                    s = j % STAGES
                    par = ((j // STAGES) - 1) & 1
                    if j >= STAGES:
                        while not ke[s].done(par):
                            yield
                    assert not k_readers[s], "K stage overwritten while read"
                    k_stage[s] = None
                    inflight.append(("k", s, j))
                    yield
                    if j >= STAGES:
                        while not ve[s].done(par):
                            yield
                    assert not v_readers[s], "V stage overwritten while read"
                    v_stage[s] = None
                    inflight.append(("v", s, j))
                    yield

            def consumer(wg):
                def wait_k(j):
                    s = j % STAGES
                    while not kf[s].done((j // STAGES) & 1):
                        yield
                    assert k_stage[s] == j, ("K tile", j, k_stage[s])
                    k_readers[s].add(wg)

                def wait_v(j):
                    s = j % STAGES
                    while not vf[s].done((j // STAGES) & 1):
                        yield
                    assert v_stage[s] == j, ("V tile", j, v_stage[s])
                    v_readers[s].add(wg)

                def release(bars, readers, s):
                    readers[s].discard(wg)
                    for _ in range(4):
                        bars[s].arrive()

                def named_sync(b):
                    target = b.phase + 1
                    b.arrive()
                    while b.phase < target:
                        yield

                yield from wait_k(0)
                yield
                release(ke, k_readers, 0)
                if pingpong and wg == 1:
                    named[0].arrive()
                for j in range(1, n_tiles):
                    yield from wait_k(j)
                    yield from wait_v(j - 1)
                    if pingpong:
                        yield from named_sync(named[wg])
                    yield  # issue S_j, P_{j-1}·V_{j-1}
                    if pingpong:
                        named[1 - wg].arrive()
                    yield
                    release(ke, k_readers, j % STAGES)
                    yield
                    release(ve, v_readers, (j - 1) % STAGES)
                if pingpong and wg == 0:
                    yield from named_sync(named[0])
                yield from wait_v(n_tiles - 1)
                release(ve, v_readers, (n_tiles - 1) % STAGES)

            actors = [producer(), consumer(0), consumer(1)]
            alive = set(range(3))
            steps = 0
            while alive or inflight:
                steps += 1
                assert steps < 100000, f"deadlock (n_tiles {n_tiles}, ping-pong {pingpong}, seed {seed})"
                if inflight and rnd.random() < 0.3:  # a copy lands
                    kind, s, j = inflight.pop(rnd.randrange(len(inflight)))
                    if kind == "k":
                        k_stage[s] = j
                        kf[s].arrive()
                    else:
                        v_stage[s] = j
                        vf[s].arrive()
                    continue
                if not alive:
                    continue
                a = rnd.choice(sorted(alive))
                try:
                    next(actors[a])
                except StopIteration:
                    alive.discard(a)
            assert all(b.arrived == 0 for b in named), "a named barrier phase left open"
    print("mbarrier protocol and ping-pong turns (random interleavings, 1..40 tiles): ok")


def check_grid():
    for n, G, n_kv in ((1, 8, 2), (4096, 8, 2), (131072, 8, 2), (70, 6 // 6, 1), (40, 16, 1), (65, 2, 2)):
        row_tiles = (n * G + BM - 1) // BM
        seen, last_len = set(), None
        for b in range(row_tiles * n_kv):
            tile = row_tiles - 1 - b // n_kv
            kvh = b % n_kv
            assert 0 <= tile < row_tiles and (tile, kvh) not in seen
            seen.add((tile, kvh))
            length = min(n - 1, (tile * BM + BM - 1) // G)  # the block's last position
            assert last_len is None or length <= last_len
            last_len = length
        assert len(seen) == row_tiles * n_kv
    print("grid order (bijection, longest rows first): ok")


if __name__ == "__main__":
    check_grid()
    check_barriers()
    for bn in (64, 80):
        set_tile(bn)
        print(f"-- BN = {bn} keys per tile")
        check_descriptors()
        check_operands()
        check_fragments()
        check_algorithm()
    sys.exit(0)
