"""Lossless 12-bit bf16 weight format: 8-bit sign+mantissa plane + 4-bit exponent-code plane + exception list.

bf16 = 1 sign | 8 exponent | 7 mantissa bits. Trained (and GGUF-dequantized) weights use a narrow exponent range,
so per tensor we keep 15 exponents in a 16-entry table and store each weight as
    hi[i] = sign << 7 | mantissa          (uint8 plane, one byte per weight)
    code  = index of its exponent in exp_table, 0..14; code 15 = zero or escape   (uint8 plane `lo`, two codes per
            byte: element 2j in the low nibble of lo[j], element 2j+1 in the high nibble)
Code 15 means exponent 0, and exp_table[15] = 0. A signed zero (exponent 0, mantissa 0) is stored as code 15 with its
sign in hi: exact zeros cost nothing. Every other weight whose exponent is not in the table (a subnormal, inf/NaN, an
outlier) is an escape: code 15, hi = 0, so the shift/mask decode below yields exactly +0.0 for it, and its original
bf16 bits go to the exception list (exc_index: sorted flat indices, exc_bits: original bits as int16). A kernel can
therefore decode every weight in registers and apply the exceptions as an additive sparse correction
y[row] += exc_value * x[col]  (exact, because the decoded escape is +0). `exc_row_ptr` (CSR offsets over rows =
flat_index // shape[-1]) lets the kernel for a block of output rows find its exceptions without a search.

Which 15 exponents: by default (`mode="window"`) a CONTIGUOUS window [base, base + 14], the one covering the most
weights (1 <= base <= 240, so exponent 0 and inf/NaN's 255 are never in it). Weight exponents are nearly contiguous
(a unimodal histogram), so the window costs little coverage against the 15 most frequent exponents
(`mode="top15"`, kept for comparison, docs/LOSSLESS12.md), and it lets a kernel decode with arithmetic instead of a
table lookup: exponent = base + code. exp_table[c] = base + c is still stored, so `decode` (a table lookup) reads
either kind, and `window_base(exp_table)` tells whether a table is a window.

Decode of one weight (what `decode` does, any table):
    bits = (hi & 0x80) << 8 | exp_table[code] << 7 | (hi & 0x7F)
The flat (row-major) layout keeps a block of weights along the input dimension contiguous in both planes. See
docs/LOSSLESS12.md.

`to_linear_planes` re-lays a window-coded [N, K] weight out for the fused kernel (kernels/lossless12_linear.py):
the same 12 bits a weight, bit-shuffled so that the kernel needs about 2.4 integer operations a weight
(`Packed12Linear`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ESCAPE = 15          # reserved exponent code: exponent 0 (a signed zero) or an escape (then hi = 0)
TABLE_SIZE = 16      # codes 0..14 are exponents, 15 is the escape
N_EXPONENTS = TABLE_SIZE - 1
MAX_WINDOW_BASE = 255 - N_EXPONENTS   # 240: the window's top exponent is at most 254 (255 is inf/NaN)
MODES = ("window", "top15")


@dataclass
class Packed12:
    shape: tuple[int, ...]
    exp_table: torch.Tensor     # uint8[16]: exponent of code c; entry 15 (zero/escape) is 0
    hi: torch.Tensor            # uint8[n]: sign << 7 | mantissa; 0 for escapes
    lo: torch.Tensor            # uint8[ceil(n/2)]: two 4-bit exponent codes a byte (even element in the low nibble)
    exc_index: torch.Tensor     # int64[k]: sorted flat indices of escapes
    exc_bits: torch.Tensor      # int16[k]: their original bf16 bits
    exc_row_ptr: torch.Tensor   # int32[rows+1]: exceptions of row r are exc_index[ptr[r]:ptr[r+1]]

    @property
    def numel(self) -> int:
        return self.hi.numel()

    @property
    def n_escapes(self) -> int:
        return self.exc_index.numel()

    @property
    def escape_rate(self) -> float:
        return self.n_escapes / max(self.numel, 1)

    @property
    def nbytes(self) -> int:
        """Every stored byte: both planes, the exponent table, the exception list and its row offsets."""
        return sum(t.numel() * t.element_size()
                   for t in (self.exp_table, self.hi, self.lo, self.exc_index, self.exc_bits, self.exc_row_ptr))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / max(self.numel, 1)

    @property
    def window_base(self) -> int | None:
        return window_base(self.exp_table)


def _bits(w: torch.Tensor) -> torch.Tensor:
    """The raw bf16 bits of w as non-negative int32 (0..65535), flattened."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16:
        got = w.dtype if isinstance(w, torch.Tensor) else type(w).__name__
        raise TypeError(f"lossless12 encodes bfloat16 tensors only, got {got}; convert with .to(torch.bfloat16) "
                        f"first if that conversion is what you mean (it is lossy for fp32/fp16)")
    return w.detach().contiguous().view(torch.int16).flatten().to(torch.int32) & 0xFFFF


def exponent_histogram(w: torch.Tensor) -> torch.Tensor:
    """int64[256]: how many elements of the bf16 tensor w have each biased exponent (0 = zero/subnormal,
    255 = inf/NaN)."""
    return torch.bincount((_bits(w) >> 7) & 0xFF, minlength=256)


def choose_window(hist: torch.Tensor) -> int:
    """The base of the window [base, base + 14] (1 <= base <= 240) holding the most elements of an exponent
    histogram (int[256]); the lowest such base on ties (an all-zero tensor gets base 1)."""
    h = hist.detach().to("cpu", torch.int64)
    csum = torch.cat([h.new_zeros(1), h.cumsum(0)])                     # csum[e] = elements with exponent < e
    bases = torch.arange(1, MAX_WINDOW_BASE + 1)
    cover = csum[bases + N_EXPONENTS] - csum[bases]
    return int(bases[int(torch.argmax(cover))])                          # argmax: first maximum


def window_base(exp_table: torch.Tensor) -> int | None:
    """base when exp_table is the window [base, base + 14] with the zero/escape entry 0 (decodable with arithmetic,
    exponent = base + code), else None (a top-15 table, or one made by an older encoder)."""
    t = [int(v) for v in exp_table.flatten().tolist()]
    if len(t) != TABLE_SIZE or t[ESCAPE] != 0 or not 1 <= t[0] <= MAX_WINDOW_BASE:
        return None
    return t[0] if all(t[c] == t[0] + c for c in range(N_EXPONENTS)) else None


def _rows_cols(shape: tuple[int, ...], n: int) -> tuple[int, int]:
    cols = max(shape[-1], 1) if len(shape) else 1
    return (n // cols if n else 0), cols


def encode(w: torch.Tensor, mode: str = "window") -> Packed12:
    """Pack a bf16 tensor into the 12-bit format, on w's device. Bit-exact: decode(encode(w)) has w's bits, NaN
    payloads too. mode "window": the 15 exponents are the contiguous window covering the most weights (what the
    fused kernel decodes with arithmetic); "top15": the 15 most frequent exponents (a table lookup to decode)."""
    if mode not in MODES:
        raise ValueError(f"lossless12 encode mode must be one of {MODES}, got {mode!r}")
    b = _bits(w)
    n = b.numel()
    exp = (b >> 7) & 0xFF
    hist = torch.bincount(exp, minlength=256)
    if mode == "window":
        base = choose_window(hist)
        chosen = torch.arange(base, base + N_EXPONENTS, device=b.device)
    else:
        h = hist.clone()
        h[0] = 0                                               # zeros are free (code 15); subnormals escape
        order = torch.sort(h, descending=True, stable=True).indices[:N_EXPONENTS]
        chosen = order[h[order] > 0].sort().values             # the used ones among the 15 most frequent, ascending
    exp_table = torch.zeros(TABLE_SIZE, dtype=torch.uint8, device=b.device)
    exp_table[:chosen.numel()] = chosen.to(torch.uint8)
    lut = torch.full((256,), ESCAPE, dtype=torch.int32, device=b.device)
    lut[chosen] = torch.arange(chosen.numel(), dtype=torch.int32, device=b.device)

    code = lut[exp]                                             # exponent 0 is never chosen: zeros get code 15
    esc = (code == ESCAPE) & ((b & 0x7FFF) != 0)                # code 15 but not a signed zero
    hi = ((b >> 8) & 0x80) | (b & 0x7F)
    hi = torch.where(esc, torch.zeros_like(hi), hi).to(torch.uint8)
    if n % 2:
        code = torch.cat([code, code.new_zeros(1)])          # tail nibble of an odd count is 0
    lo = (code[0::2] | (code[1::2] << 4)).to(torch.uint8)

    exc_index = esc.nonzero().flatten().to(torch.int64)       # nonzero() is sorted
    exc_bits = w.detach().contiguous().view(torch.int16).flatten()[exc_index].clone()
    rows, cols = _rows_cols(tuple(w.shape), n)
    per_row = torch.bincount(exc_index // cols, minlength=rows)
    exc_row_ptr = torch.cat([per_row.new_zeros(1), per_row.cumsum(0)]).to(torch.int32)
    return Packed12(tuple(w.shape), exp_table, hi, lo, exc_index, exc_bits, exc_row_ptr)


def _codes(p: Packed12) -> torch.Tensor:
    """int32[n]: the 4-bit code of every element."""
    lo = p.lo.to(torch.int32)
    return torch.stack([lo & 0xF, lo >> 4], dim=1).flatten()[:p.numel]


def decode(p: Packed12) -> torch.Tensor:
    """The bf16 tensor p was encoded from, bit for bit (any exponent table: window, top-15 or older)."""
    hi = p.hi.to(torch.int32)
    bits = ((hi & 0x80) << 8) | (p.exp_table.to(torch.int32)[_codes(p)] << 7) | (hi & 0x7F)  # escapes decode to +0
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    bits[p.exc_index] = p.exc_bits
    return bits.view(torch.bfloat16).reshape(p.shape)


def tensor_stats(name: str, w: torch.Tensor) -> dict:
    """Measurement row for one bf16 tensor: distinct exponents, top-15/16 coverage, the window's base and escape
    rate (the format), the top-15 table's escape rate (for comparison), bits/weight, whether the round trip is
    exact."""
    hist = exponent_histogram(w).to(torch.float64)
    top = hist.sort(descending=True).values
    n = max(w.numel(), 1)
    p = encode(w)
    p15 = encode(w, mode="top15")
    exact = all(torch.equal(decode(q).view(torch.int16), w.contiguous().view(torch.int16)) for q in (p, p15))
    return dict(name=name, shape=tuple(w.shape), numel=w.numel(), distinct=int((hist > 0).sum()),
                top15=float(top[:15].sum() / n), top16=float(top[:16].sum() / n), base=p.window_base,
                escapes=p.n_escapes, escape_rate=p.escape_rate, escapes_top15=p15.n_escapes,
                escape_rate_top15=p15.escape_rate, zeros=int(((_bits(w) & 0x7FFF) == 0).sum()),
                nbytes=p.nbytes, bits_per_weight=p.bits_per_weight, exact=exact)


# -- the fused kernel's layout -------------------------------------------------------------------------------------
#
# Per weight the kernel needs fp32 bits  sign << 31 | exponent << 23 | mantissa << 16  (bf16 is the top half of
# fp32). With a window, exponent = base + code. The kernel builds instead
#     f = sign << 31 | c << 23 | mantissa << 16,    c = (code + 1) & 15   (c = 0: zero or escape, else 1..15)
# and multiplies by 2^(base - 1): for c >= 1, f is a normal float (exponent field c) and f * 2^(base-1) has exponent
# c + base - 1 = base + code, exactly (a power-of-two scale of a normal number in range); for c = 0, f is a signed
# zero (escapes and zeros have mantissa 0) and stays one. No table, no compare/select: one FMUL on the FP pipe,
# which has twice the integer pipe's throughput.
#
# To build f in as few integer operations as possible the 12 bits of each weight are stored *at their fp32
# positions*: a weight's "half" is the 16-bit value  H = s << 15 | c << 7 | m  (4 unused bits, 11..14, between the
# code and the sign). Eight weights make three int32 words:
#     W0 = H0 << 16 | H1,   W1 = H2 << 16 | H3,   W2 = H4 << 16 | H5     + weights 6 and 7 in the unused bits:
#     bits 27..30 / 11..14 of W0: c6 / c7;   of W1: m6 >> 3 / m7 >> 3;   of W2: s6 m6&7 / s7 m7&7
# Decode (kernels/lossless12_linear.py), HALF = 0x87FF0000 (sign, code, mantissa at fp32 positions):
#     f0 = W0 & HALF,  f1 = (W0 << 16) & HALF,  likewise f2..f5 from W1, W2
#     T  = (W0 >> 4) & 0x07800780 | (W1 >> 8) & 0x00780078 | (W2 >> 11) & 0x00070007 | (W2 << 1) & 0x80008000
#     f6 = T & HALF,   f7 = T << 16
# 19 integer operations for 8 weights. The 8 weights of a group are K/8 apart ("sliced"): slot t of group j is
# column t * K8 + j (K8 = ceil(K / 8), columns past K are zero padding), so a block of groups along a row reads x
# as 8 contiguous slices. Words are stored row by row as [W0 of all groups | W1 ... | W2 ...]: q is int32
# [N, 3 * K8], contiguous along the groups of each plane.

HALF_MASK = 0x87FF0000
T67_MASKS = ((4, 0x07800780), (8, 0x00780078), (11, 0x00070007))   # (right shift, mask) of W0, W1, W2
T67_SIGN_MASK = 0x80008000                                          # (W2 << 1) & this: the signs of weights 6, 7


X_SCALE_EXP = 40   # Packed12Linear.x_scales: the largest power of two a GEMV multiplies x by


@dataclass
class Packed12Linear:
    """A [N, K] weight in the 12-bit format, laid out for the fused linear kernel (see above)."""
    q: torch.Tensor         # int32 [N, 3 * K8]: per row the words W0 of all K8 groups, then W1, then W2
    exc_row: torch.Tensor   # int32 [E]: escapes' rows, sorted
    exc_col: torch.Tensor   # int32 [E]: escapes' columns
    exc_val: torch.Tensor   # float32 [E]: escapes' exact values
    row_ptr: torch.Tensor   # int32 [N + 1]: escapes of row n are exc_*[row_ptr[n]:row_ptr[n + 1]]
    shape: tuple[int, int]
    base: int               # the exponent window [base, base + 14]
    reencoded: bool = False  # to_linear_planes got a Packed12 with a non-window table and re-encoded it

    @property
    def k8(self) -> int:
        return self.q.shape[1] // 3

    @property
    def scale_w(self) -> float:
        """What the kernel multiplies each decoded f by: 2^(base - 1), capped at 2^127 (fp32's largest power of 2)."""
        return 2.0 ** min(self.base - 1, 127)

    @property
    def scale_out(self) -> float:
        """The rest of 2^(base - 1), applied to each output's dense sum: 1.0 unless the window starts above 128
        (weights of magnitude >= 2^1 throughout)."""
        return 2.0 ** (self.base - 1 - min(self.base - 1, 127))

    @property
    def x_scales(self) -> tuple[float, float]:
        """(x_scale, sum_scale), powers of two whose product is 2^(base - 1), for a kernel that multiplies x by
        x_scale instead of every weight by 2^(base - 1) (one multiply per x value it loads instead of one per
        weight), and each output's sum of f * x_scale * x by sum_scale. x_scale is 2^min(base - 1, X_SCALE_EXP),
        clamped so both fit fp32. Each product f * (x * x_scale) is then w * x / sum_scale rounded once, exactly as
        w * x is, unless it falls below fp32's normal range (|w * x| < 2^(base - 127 - X_SCALE_EXP), 2^-57 for
        Llama-like windows: far below the ulp of any output) or x * x_scale overflows (|x| >= 2^(128 -
        X_SCALE_EXP), 2^88)."""
        e = self.base - 1
        a = min(max(min(e, X_SCALE_EXP), e - 127), 127)
        return 2.0 ** a, 2.0 ** (e - a)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.q, self.exc_row, self.exc_col, self.exc_val, self.row_ptr))


def _s32(v: int) -> int:
    """A 32-bit pattern as a signed int32 value."""
    return v - (1 << 32) if v >= 1 << 31 else v


def to_linear_planes(w, device=None) -> Packed12Linear:
    """A bf16 [N, K] weight (or its Packed12) laid out for the fused linear kernel (kernels/lossless12_linear.py).

    A bf16 tensor is encoded with the exponent window (on `device` when given: seconds on a GPU, not minutes). A
    Packed12 whose table is not a window (mode="top15", or an older encoder's) cannot be decoded with arithmetic:
    it is decoded and re-encoded with the window, explicitly (the result's `reencoded` is True)."""
    reencoded = False
    if isinstance(w, Packed12):
        p = w
        if device is not None:
            p = Packed12(p.shape, *(getattr(p, f).to(device) for f in
                                    ("exp_table", "hi", "lo", "exc_index", "exc_bits", "exc_row_ptr")))
        if window_base(p.exp_table) is None:
            p, reencoded = encode(decode(p)), True
    else:
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"lossless12 linear weights must be 2-D, got "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        p = encode(w.to(device) if device is not None else w)
    if len(p.shape) != 2:
        raise ValueError(f"lossless12 linear weights must be 2-D, got {p.shape}")
    n, k = p.shape
    base = window_base(p.exp_table)
    k8 = -(-k // 8)
    hi = p.hi.to(torch.int32).reshape(n, k)
    c = ((_codes(p) + 1) & 15).reshape(n, k)              # 0: zero or escape; 1..15: exponent base - 1 + c
    pad = 8 * k8 - k                                       # zero padding up to 8 * K8 columns decodes to +0
    if pad:
        hi = torch.nn.functional.pad(hi, (0, pad))
        c = torch.nn.functional.pad(c, (0, pad))
    s, m = (hi >> 7).reshape(n, 8, k8), (hi & 0x7F).reshape(n, 8, k8)     # [row, slot t, group j]
    c = c.reshape(n, 8, k8)
    half = (s << 15) | (c << 7) | m                        # H = sign | code at 7..10 | mantissa (bits 11..14 free)
    w0 = (half[:, 0] << 16) | half[:, 1] | (c[:, 6] << 27) | (c[:, 7] << 11)
    w1 = (half[:, 2] << 16) | half[:, 3] | ((m[:, 6] >> 3) << 27) | ((m[:, 7] >> 3) << 11)
    w2 = ((half[:, 4] << 16) | half[:, 5] | (s[:, 6] << 30) | ((m[:, 6] & 7) << 27)
          | (s[:, 7] << 14) | ((m[:, 7] & 7) << 11))
    q = torch.cat([w0, w1, w2], dim=1).contiguous()        # int32 arithmetic wraps: these are the bit patterns
    exc_val = (p.exc_bits.to(torch.int32) << 16).view(torch.float32)
    return Packed12Linear(q=q, exc_row=(p.exc_index // k).to(torch.int32), exc_col=(p.exc_index % k).to(torch.int32),
                          exc_val=exc_val, row_ptr=p.exc_row_ptr.to(torch.int32), shape=(n, k), base=base,
                          reencoded=reencoded)


def linear_bits(w: Packed12Linear) -> torch.Tensor:
    """int32 [N, 8, K8]: the f bit patterns (sign << 31 | c << 23 | mantissa << 16) of every slot, decoded with
    exactly the kernel's shifts and masks (torch int32 shifts wrap like the GPU's)."""
    n, k8 = w.shape[0], w.k8
    q = w.q.reshape(n, 3, k8)
    w0, w1, w2 = q[:, 0], q[:, 1], q[:, 2]
    half = _s32(HALF_MASK)
    (s0, m0), (s1, m1), (s2, m2) = T67_MASKS
    t = ((w0 >> s0) & m0) | ((w1 >> s1) & m1) | ((w2 >> s2) & m2) | ((w2 << 1) & _s32(T67_SIGN_MASK))
    return torch.stack([w0 & half, (w0 << 16) & half, w1 & half, (w1 << 16) & half, w2 & half, (w2 << 16) & half,
                        t & half, t << 16], dim=1)


def decode_linear_weight(w: Packed12Linear, dtype=torch.bfloat16) -> torch.Tensor:
    """The [N, K] weight, decoded with torch ops the way the fused kernel does it (f * 2^(base-1), exceptions
    written back): the exact values it multiplies with."""
    n, k = w.shape
    f = linear_bits(w).view(torch.float32) * w.scale_w     # exact: power-of-two scale of a normal float, or +-0
    if w.scale_out != 1.0:
        f = f * w.scale_out
    full = f.reshape(n, 8 * w.k8)[:, :k].contiguous()
    full[w.exc_row.long(), w.exc_col.long()] = w.exc_val
    if dtype == torch.bfloat16:  # the top half of the fp32 bits: exact, NaN payloads too (a float cast is not)
        return (full.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return full.to(dtype)
