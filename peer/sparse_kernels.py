"""Compiled kernels of the sparse codecs (peer.sparse): chunked top-k selection and quantization,
fused with SparseLoCo's error-feedback update, and the checked decode of a payload's bit-packed
indices and values. numba (LLVM) compiles them on first use and caches the machine code beside
this module (or in numba's user cache), so a process pays the compilation once per machine.

Why compiled: over a 400 MB pseudo-gradient the numpy forms of these steps make temporaries of
the block's size at every step (β·e + Δ, the magnitude bits, the partition, the selection mask)
and walk memory five times; the kernels walk e and Δ once, a chunk at a time in cache, and touch
only the kept entries after that. Per 10^8 elements at C 1,024, k 10, 2 bits, one core of the
2-core development machine: the error-fed encode 0.11 s (the numpy form, kept as the reference
in tests/unit/test_sparse_kernels.py: 0.34 s), the encode of the values alone 0.16 s, the
checked decode of one contribution 0.021 s (numpy: 0.040 s); `scripts/sparse_codec_speed.py
--sizes 1e8 --chunk 1024 --k 10 --bits 2 --kinds topk --repeat 3` times the codec.

Exactness: every kernel computes the same IEEE float32 (and float64, for the scales) operations
as the definitions in peer.sparse's module docstring, one rounding each and no contraction
(numba compiles without fastmath, so LLVM does not fuse a multiply and an add), so a payload is
byte-for-byte the payload of the numpy reference (tests/unit/test_sparse_kernels.py checks
that, ties, zeros and non-finite values included).

Selection of a chunk's k largest magnitudes (ties to the lower index), O(chunk) for any chunk
and k: the maxima of its groups of GROUP elements give a threshold t0, the k-th largest group
maximum, which no element of the top k is below (k groups hold an element >= t0); the elements
>= t0 (of the groups whose maximum is >= t0: about k of them on dense data) are the candidates,
in index order; with fewer groups than k every element is one. The k-th largest candidate t
(`_kth_largest`) then keeps, in one pass in index order, every candidate above t and the first
of those equal to it. Magnitudes are compared as the int32 bits of |x| (sign bit cleared): IEEE
754 orders the bit patterns of non-negative floats as their values, and NaN and inf have the
largest, so a chunk holding one has it among its candidates.
"""

from __future__ import annotations

import numba as nb
import numpy as np

GROUP = 32
"""Elements per group of the selection's first pass (module docstring)."""

_MAGNITUDE = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_TINY = np.float32(np.finfo(np.float32).smallest_subnormal)
_F32_MAX = float(np.finfo(np.float32).max)



def _jit(fn=None, *, inline: str = "never"):
    """numba.njit(nogil=True), its machine code cached on disk (beside this module, else in
    numba's user cache, ~/.cache/numba; NUMBA_CACHE_DIR moves it); compiled in every process
    instead where no cache directory is writable (a read-only container without a home), which
    numba refuses at decoration time. `inline="always"` inlines the function into its callers
    in numba's IR, so LLVM optimizes a hot loop in the caller's context (a call to a separate
    function keeps it from vectorizing the chunk loaders)."""
    if fn is None:
        return lambda f: _jit(f, inline=inline)
    try:
        return nb.njit(cache=True, nogil=True, inline=inline)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return nb.njit(nogil=True, inline=inline)(fn)


@_jit
def _float32_step(x, up):
    """The float32 next to a finite x >= 0 (up: toward +inf, else toward 0)."""
    a = np.empty(1, np.float32)
    a[0] = x
    b = a.view(np.int32)
    b[0] += 1 if up else -1
    return a[0]


@_jit
def _kth_largest(a, count, kk, scratch):
    """The kk-th largest of `a[:count]` (int32, 1 <= kk <= count); `a` is not changed. Small kk:
    a descending list of the kk largest in `scratch` (one comparison per element once it is
    full); else a partition of a copy, O(count) either way."""
    if kk <= 16:
        for j in range(kk):
            scratch[j] = -1
        for i in range(count):
            v = a[i]
            if v > scratch[kk - 1]:
                t = kk - 2
                while t >= 0 and scratch[t] < v:
                    scratch[t + 1] = scratch[t]
                    t -= 1
                scratch[t + 1] = v
        return scratch[kk - 1]
    return np.partition(a[:count].copy(), count - kk)[count - kk]


@_jit
def _group_maxima(bits_of, length, gm):
    """gm[g] = the largest magnitude bits of group g of `bits_of[:length]` (the last group may
    be shorter), for the element ranges the loaders (`_load_error_fed`, `_load_values`) did not
    fill a group at a time."""
    for g in range(-(-length // GROUP)):
        mx = 0
        for i in range(g * GROUP, min(length, (g + 1) * GROUP)):
            w = bits_of[i] & _MAGNITUDE
            mx = w if w > mx else mx
        gm[g] = mx


@_jit(inline="always")
def _load_error_fed(e, delta, beta, a, length, buf, bits_of, gm):
    """buf[:length] = e[a:a + length] * beta + delta[a:a + length] (float32, one rounding each)
    and the group maxima of its magnitude bits into gm, in one pass: a full chunk is whole
    groups of fixed length, which LLVM vectorizes (per 10^8 elements the whole error-fed encode
    takes 0.11 s this way, 0.24 s when the chunk is loaded and then scanned)."""
    eb, db = e[a:a + length], delta[a:a + length]  # indexed from 0 up: no wraparound check in the loop
    full = length // GROUP
    for g in range(full):
        mx = 0
        base = g * GROUP
        for i in range(base, base + GROUP):
            buf[i] = eb[i] * beta + db[i]
            w = bits_of[i] & _MAGNITUDE
            mx = w if w > mx else mx
        gm[g] = mx
    if full * GROUP < length:
        for i in range(full * GROUP, length):
            buf[i] = eb[i] * beta + db[i]
        _group_maxima(bits_of[full * GROUP:], length - full * GROUP, gm[full:])


@_jit(inline="always")
def _load_values(x, a, length, buf, bits_of, gm):
    """`_load_error_fed` of the values themselves: `x` is their int32 view, x[a:a + length]
    copied bit for bit."""
    xb = x[a:a + length]
    full = length // GROUP
    for g in range(full):
        mx = 0
        base = g * GROUP
        for i in range(base, base + GROUP):
            bits_of[i] = xb[i]  # the int32 bits (x's int32 view): an integer copy LLVM vectorizes
            w = bits_of[i] & _MAGNITUDE
            mx = w if w > mx else mx
        gm[g] = mx
    if full * GROUP < length:
        for i in range(full * GROUP, length):
            bits_of[i] = xb[i]
        _group_maxima(bits_of[full * GROUP:], length - full * GROUP, gm[full:])


@_jit
def _keep(buf, bits_of, length, kk, bits, gm, cm, ci, scratch, cols, codes, o):
    """Select and quantize one chunk held in `buf[:length]` (`bits_of`: its int32 view; `gm`: its
    group maxima, from the loader): writes the `kk` kept columns (ascending) and codes at
    `cols[o:]`, `codes[o:]`. Returns the chunk's scale, or -1.0 when the chunk holds NaN or inf
    (nothing written that counts)."""
    groups = -(-length // GROUP)
    cnt = 0
    if groups >= kk:  # candidates: the elements >= the kk-th largest group maximum
        t0 = _kth_largest(gm, groups, kk, scratch)
        for g in range(groups):
            if gm[g] >= t0:
                for i in range(g * GROUP, min(length, g * GROUP + GROUP)):
                    m = bits_of[i] & _MAGNITUDE
                    if m >= t0:  # about kk of a group's GROUP elements: a predictable branch
                        cm[cnt] = m
                        ci[cnt] = i
                        cnt += 1
    else:  # fewer groups than kept elements: every element is a candidate
        for i in range(length):
            cm[i] = bits_of[i] & _MAGNITUDE
            ci[i] = i
        cnt = length
    # the candidates are in index order; keep those above the kk-th largest t and the first of
    # those equal to it (ties to the lower index), in index order
    t = _kth_largest(cm, cnt, kk, scratch)
    above = 0
    top = 0
    for j in range(cnt):
        above += 1 if cm[j] > t else 0
        top = cm[j] if cm[j] > top else top
    if top >= _INF_BITS:  # NaN and inf have the largest magnitude bits
        return np.float32(-1.0)
    ties = kk - above
    w = 0
    for j in range(cnt):
        m = cm[j]
        if m > t or (m == t and ties > 0):
            ties -= 1 if m == t else 0
            ci[w] = ci[j]
            w += 1
    levels = 1 << (bits - 1)
    absmax = 0.0
    for j in range(kk):
        v = abs(np.float64(buf[ci[j]]))
        absmax = v if v > absmax else absmax
    scale = np.float32(absmax / levels)
    if np.float64(scale) * levels < absmax:  # float32 rounding left the top below a level
        scale = _float32_step(scale, True)
    if scale == 0 and absmax > 0:
        scale = _TINY
    if np.float64(scale) * levels > _F32_MAX:  # keep every level finite
        scale = _float32_step(scale, False)
    s64 = np.float64(scale)
    for j in range(kk):
        v = buf[ci[j]]
        q = np.rint(abs(np.float64(v)) / s64) if s64 > 0 else 1.0
        q = min(max(q, 1.0), float(levels))
        code = np.uint8(int(q) - 1)
        if v < 0:
            code |= np.uint8(1 << (bits - 1))
        cols[o + j] = ci[j]
        codes[o + j] = code
    return scale


@_jit
def _outputs(count, chunk, k):
    full, rest = count // chunk, count % chunk
    chunks = full + (1 if rest else 0)
    kept = full * min(k, chunk) + min(k, rest)
    return (chunks, np.empty(kept, np.int64), np.empty(kept, np.uint8), np.empty(chunks, np.float32),
            np.empty(chunk, np.float32), np.empty(chunk // GROUP + 1, np.int32), np.empty(chunk, np.int32),
            np.empty(chunk, np.int64), np.empty(chunk, np.int32))


@_jit
def encode_error_fed(e, delta, beta, lo, hi, chunk, k, bits):
    """The top-k payload fields of elements [lo, hi) of β·e + Δ (float32: `e[i] * beta`, then
    `+ delta[i]`, one rounding each), chunks from lo: `(cols, codes, scales, bad)`: (K,) int64
    columns within their chunk, (K,) uint8 codes, (chunks,) float32 scales; bad = the first
    element of the first chunk holding NaN or inf, else -1 (the other arrays then incomplete)."""
    chunks, cols, codes, scales, buf, gm, cm, ci, scratch = _outputs(hi - lo, chunk, k)
    bits_of = buf.view(np.int32)
    o = 0
    for c in range(chunks):
        a = lo + c * chunk
        length = min(chunk, hi - a)
        kk = min(k, length)
        _load_error_fed(e, delta, beta, a, length, buf, bits_of, gm)
        scale = _keep(buf, bits_of, length, kk, bits, gm, cm, ci, scratch, cols, codes, o)
        if scale < 0:
            return cols, codes, scales, a
        scales[c] = scale
        o += kk
    return cols, codes, scales, -1


@_jit
def encode_values(x, chunk, k, bits):
    """`encode_error_fed` of the values `x` themselves ((n,) float32, C-contiguous; chunks from
    element 0)."""
    chunks, cols, codes, scales, buf, gm, cm, ci, scratch = _outputs(x.shape[0], chunk, k)
    bits_of = buf.view(np.int32)
    xi = x.view(np.int32)
    o = 0
    for c in range(chunks):
        a = c * chunk
        length = min(chunk, x.shape[0] - a)
        kk = min(k, length)
        _load_values(xi, a, length, buf, bits_of, gm)
        scale = _keep(buf, bits_of, length, kk, bits, gm, cm, ci, scratch, cols, codes, o)
        if scale < 0:
            return cols, codes, scales, a
        scales[c] = scale
        o += kk
    return cols, codes, scales, -1


@_jit
def _unpack_into(data, count, width, out):
    """LSB-first bitstream `data` (uint8) -> `out[:count]` codes of `width` bits; returns whether
    the padding bits after the last code are 0."""
    acc = np.uint64(0)
    have = 0
    at = 0
    mask = np.uint64((1 << width) - 1)
    for i in range(count):
        while have < width:
            acc |= np.uint64(data[at]) << np.uint64(have)
            at += 1
            have += 8
        out[i] = np.int64(acc & mask)
        acc >>= np.uint64(width)
        have -= width
    return acc == 0 and at == data.shape[0]


@_jit
def decode_fields(indices, values, scales, count, chunk, k, bits, width):
    """Check and decode the bit-packed fields of a payload of `count` elements (peer.sparse wire
    form; lengths already checked), both bitstreams read in one pass, chunk by chunk:
    `(status, a, b, index, value)` with index (K,) int64 global indices and value (K,) float32
    `±(m + 1) * scale`. status 0: fine; 1: nonzero padding bits after the last index; 2: after
    the last value; 3: column a out of range in chunk b; 4: indices not strictly increasing
    within chunk a."""
    full, rest = count // chunk, count % chunk
    chunks = full + (1 if rest else 0)
    kept = full * min(k, chunk) + min(k, rest)
    index = np.empty(kept, np.int64)
    value = np.empty(kept, np.float32)
    imask, vmask = np.uint64((1 << width) - 1), np.uint64((1 << bits) - 1)
    low, sign = np.uint64((1 << (bits - 1)) - 1), np.uint64(bits - 1)
    ia, ih, ip = np.uint64(0), 0, 0  # index stream: pending bits, their count, next byte
    va, vh, vp = np.uint64(0), 0, 0  # value stream
    o = 0
    for c in range(chunks):
        length = chunk if c < full else rest
        scale = scales[c]
        prev = -1
        for _ in range(min(k, length)):
            while ih < width:
                ia |= np.uint64(indices[ip]) << np.uint64(ih)
                ip += 1
                ih += 8
            col = np.int64(ia & imask)
            ia >>= np.uint64(width)
            ih -= width
            while vh < bits:
                va |= np.uint64(values[vp]) << np.uint64(vh)
                vp += 1
                vh += 8
            code = va & vmask
            va >>= np.uint64(bits)
            vh -= bits
            if col >= length:
                return 3, col, c, index, value
            if col <= prev:
                return 4, c, 0, index, value
            prev = col
            index[o] = c * chunk + col
            v = (np.float32(code & low) + np.float32(1.0)) * scale
            value[o] = -v if code >> sign else v
            o += 1
    if ia != 0 or ip != indices.shape[0]:  # what is left of the last byte is padding: all 0
        return 1, 0, 0, index, value
    if va != 0 or vp != values.shape[0]:
        return 2, 0, 0, index, value
    return 0, 0, 0, index, value


@_jit
def scatter_add(out, index, value):
    """`out[index[j]] += value[j]` in order (float32; indices unique within one call)."""
    for j in range(index.shape[0]):
        out[index[j]] += value[j]


@_jit
def scatter_add_weighted(out, index, value, w):
    """`out[index[j]] += w * value[j]`: the float32 product first (one rounding), then the sum."""
    for j in range(index.shape[0]):
        out[index[j]] += w * value[j]


@_jit
def scatter_sub(out, index, value):
    """`out[index[j]] -= value[j]` (float32; indices unique)."""
    for j in range(index.shape[0]):
        out[index[j]] -= value[j]
