"""The delta engine's host-memory loops in C (the sender's one-pass diff, the seed's copy-and-checksum, the
rollout's sparse apply, verl's flush hash), built once and loaded with ``ctypes``.

numpy/torch passes cost several memcpys of the model (2.3 ns a word against 0.63 ns); one loop runs within
about 2x of a memcpy. :data:`SOURCE` is compiled with ``$CC`` (or ``cc``, ``gcc``, ``clang``) into
``$HAL_CACHE_DIR/delta/<key>/``, keyed by source, compiler and machine (about a second, once). Without a
compiler, or with ``HAL_DELTA_KERNEL=off``, :func:`library` returns ``None`` and callers take torch/numpy paths
giving the same bits; :func:`status` says why. All functions take host little-endian 64-bit words.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import threading

import numpy as np
import torch

# Set to off (or 0) to use the torch/numpy paths even where the library builds.
ENV = "HAL_DELTA_KERNEL"
# Seconds a compiler run may take before the build counts as failed.
BUILD_TIMEOUT_S = 120.0

# Row of one tensor in hal_delta_diff / hal_delta_seed (int64): inputs, then what the call writes.
W0, NBYTES, CMAX, CHANGED, DENSE, OUT0, OUT1, DW, DS, ROW = range(10)

SOURCE = r"""
#include <stdint.h>
#include <string.h>

enum { W0, NBYTES, CMAX, CHANGED, DENSE, OUT0, OUT1, DW, DS, ROW };
#define SAMPLE_MIN 4096 /* tensors of at least this many words are sampled before their pass */
#define SAMPLES 64
#define BLOCK 512       /* words whose changed ones are listed before they are visited */

static uint16_t LANES[256][8]; /* LANES[m]: the set bits of m, lowest first (then zeros) */
static uint8_t POP[256];        /* POP[m]: how many bits of m are set */

__attribute__((constructor)) static void tables(void) {
    for (int m = 0; m < 256; m++) {
        int k = 0;
        for (int b = 0; b < 8; b++)
            if ((m >> b) & 1) LANES[m][k++] = (uint16_t)b;
        POP[m] = (uint8_t)k;
    }
}

/* v repeated in every es-byte lane of a word */
static inline uint64_t rep(uint64_t v, int es) {
    switch (es) {
    case 1: return (v & 0xFF) * 0x0101010101010101ull;
    case 2: return (v & 0xFFFF) * 0x0001000100010001ull;
    case 4: return (v & 0xFFFFFFFF) * 0x0000000100000001ull;
    default: return v;
    }
}

/* the top bit of each es-byte lane of x set where the lane is non-zero (lo: every lane's other bits;
   no carry crosses a lane) */
static inline uint64_t nonzero_lanes(uint64_t x, uint64_t lo) { return (((x & lo) + lo) | x) & ~lo; }

/* bit L set where lane L's top bit is set in h (h: only lanes' top bits) */
static inline unsigned lane_bits(uint64_t h, int es) {
    switch (es) {
    case 1: return (unsigned)(((h >> 7) * 0x0102040810204080ull) >> 56);
    case 2: h >>= 15; return (unsigned)((h | (h >> 15) | (h >> 30) | (h >> 45)) & 0xF);
    case 4: h >>= 31; return (unsigned)((h | (h >> 31)) & 0x3);
    default: return (unsigned)(h >> 63);
    }
}

/* the bits of a word that hold its first `lanes` lanes (of `per`), little endian */
static inline uint64_t own_mask(int64_t lanes, int64_t per, int es) {
    return lanes >= per ? ~(uint64_t)0 : (((uint64_t)1 << (8 * es * lanes)) - 1);
}

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* the offsets from b0 of the words in [b0, b1) where c and s differ, into at (room for b1 - b0 + 8);
   returns how many: eight words at a time, compared two by two (SSE2), listed through LANES, no branch
   per word (random changes would mispredict it) */
static inline int64_t scan_block(const uint64_t *c, const uint64_t *s, int64_t b0, int64_t b1, uint16_t *at) {
    int64_t n = 0, i = b0;
#if defined(__SSE2__)
    for (; i + 8 <= b1; i += 8) {
        int eq = 0;
        for (int k = 0; k < 4; k++) {
            const __m128i a = _mm_loadu_si128((const __m128i *)(c + i + 2 * k));
            const __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 2 * k));
            __m128i e = _mm_cmpeq_epi32(a, b);
            e = _mm_and_si128(e, _mm_shuffle_epi32(e, 0xB1)); /* a 64-bit word equal: both halves */
            eq |= _mm_movemask_pd(_mm_castsi128_pd(e)) << (2 * k);
        }
        const int ne = ~eq & 0xFF;
        const __m128i off = _mm_add_epi16(_mm_loadu_si128((const __m128i *)LANES[ne]),
                                          _mm_set1_epi16((short)(i - b0)));
        _mm_storeu_si128((__m128i *)(at + n), off);
        n += POP[ne];
    }
#endif
    for (; i < b1; i++) {
        at[n] = (uint16_t)(i - b0);
        n += c[i] != s[i];
    }
    return n;
}

/* Over nw words c (new) against s (snapshot), the last masked to `last`: add the changed lanes to *count
   and the checksum change to *dw, *ds (unsigned, mod 2^64). Lane counts are summed in each lane's own bits
   (the top bit of a changed lane, shifted down) and folded every CHUNK_WORDS words. */
#define CHUNK_WORDS 255 /* a byte lane's sum cannot wrap */
static inline uint64_t fold_lanes(uint64_t acc, int es) {
    switch (es) {
    case 1:
        acc = (acc & 0x00FF00FF00FF00FFull) + ((acc >> 8) & 0x00FF00FF00FF00FFull);
        return (acc * 0x0001000100010001ull) >> 48;
    case 2: return (acc * 0x0001000100010001ull) >> 48;
    case 4: return (acc & 0xFFFFFFFFull) + (acc >> 32);
    default: return acc;
    }
}

static void count_and_sum(const uint64_t *c, const uint64_t *s, int64_t nw, uint64_t last, uint64_t lo, int es,
                          int64_t *count, uint64_t *dw, uint64_t *ds) {
    const int shift = 8 * es - 1;
    uint64_t w = *dw, sum = *ds;
    int64_t n = *count;
    for (int64_t c0 = 0; c0 < nw; c0 += CHUNK_WORDS) {
        const int64_t c1 = nw - c0 < CHUNK_WORDS ? nw : c0 + CHUNK_WORDS;
        uint64_t acc = 0;
        for (int64_t i = c0; i < c1; i++) {
            const uint64_t m = i == nw - 1 ? last : ~(uint64_t)0;
            const uint64_t a = c[i] & m, b = s[i] & m, d = a - b;
            acc += nonzero_lanes(a ^ b, lo) >> shift;
            sum += d;
            w += d * (uint64_t)(2 * i + 1);
        }
        n += (int64_t)fold_lanes(acc, es);
    }
    *count = n;
    *dw = w;
    *ds = sum;
}

/* One tensor: words c (new) against s (snapshot), nbytes of its own from word 0. Changed words are copied
   into s; changed values are written as (int32 position, value) at pos/vals from o0 on, until more than
   cmax changed or a changed value is NaN (nan_on: (value & absmask) > infbits, absmask all but the sign
   bit): then it is dense and writes nothing (o0 is returned). Sums the checksum change of its own bytes.
   Returns the next output. */
#define DEFINE_DIFF(NAME, T, PER)                                                                          \
static int64_t NAME(const uint64_t *c, uint64_t *s, int64_t *row, int32_t *pos, T *vals, int64_t o0,     \
                    int nan_on, T absmask, T infbits) {                                                     \
    const int64_t nbytes = row[NBYTES], cmax = row[CMAX];                                                   \
    const int64_t numel = nbytes / (int64_t)sizeof(T), nw = (nbytes + 7) / 8;                              \
    const uint64_t last = own_mask(numel - (nw - 1) * PER, PER, sizeof(T));                                \
    const uint64_t lo = rep((T)~(T)0 >> 1, sizeof(T)), nan_add = rep((T)(absmask - infbits), sizeof(T));   \
    int64_t o = o0, count = 0;                                                                              \
    uint64_t ds = 0, dw = 0;                                                                                \
    int dense = cmax < 0;                                                                                   \
    int likely = dense;                                                                                     \
    if (!dense && nw >= SAMPLE_MIN) { /* likely dense? count first: no outputs written for a dense one */  \
        const int64_t step = nw / SAMPLES;                                                                  \
        int64_t seen = 0;                                                                                   \
        for (int64_t k = 0; k < SAMPLES; k++) seen += POP[lane_bits(nonzero_lanes(c[k * step] ^ s[k * step], lo), sizeof(T))]; \
        likely = 4 * seen * numel > 3 * cmax * SAMPLES * PER;                                               \
    }                                                                                                       \
    if (likely) { /* one pass counts and sums, nothing written; dense: the snapshot is then a copy */      \
        count_and_sum(c, s, nw, last, lo, sizeof(T), &count, &dw, &ds);                                    \
        dense = count > cmax;                                                                               \
        if (dense) {                                                                                        \
            memcpy(s, c, (size_t)nw * 8);                                                                   \
        } else { /* the sample misjudged it: the sparse pass below counts and sums again */                 \
            count = 0;                                                                                      \
            dw = ds = 0;                                                                                    \
        }                                                                                                   \
    }                                                                                                       \
    if (!dense) {                                                                                           \
        uint16_t at[BLOCK + 8];                                                                             \
        for (int64_t b0 = 0; b0 < nw; b0 += BLOCK) {                                                        \
          /* the changed words of a block are listed, then visited while the block is in L1 */             \
          const int64_t n = scan_block(c, s, b0, nw - b0 < BLOCK ? nw : b0 + BLOCK, at);                    \
          for (int64_t k = 0; k < n; k++) {                                                                 \
            const int64_t i = b0 + at[k];                                                                   \
            const uint64_t a = c[i], b = s[i];                                                              \
            s[i] = a;                                                                                       \
            const uint64_t m = i == nw - 1 ? last : ~(uint64_t)0;                                          \
            const uint64_t d = (a & m) - (b & m);                                                           \
            ds += d;                                                                                        \
            dw += d * (uint64_t)(2 * i + 1);                                                                \
            const uint64_t changed = nonzero_lanes((a ^ b) & m, lo); /* top bit of each changed lane */    \
            const unsigned lanes = lane_bits(changed, sizeof(T));                                          \
            count += POP[lanes];                                                                            \
            if (dense) continue;                                                                            \
            T la[PER];                                                                                      \
            memcpy(la, &a, 8);                                                                              \
            const uint16_t *at_lane = LANES[lanes];                                                         \
            const int32_t p0 = (int32_t)(i * PER);                                                          \
            for (int L = 0; L < PER; L++) { /* every slot written, the changed ones kept */                 \
                pos[o + L] = p0 + at_lane[L];                                                               \
                vals[o + L] = la[at_lane[L]];                                                               \
            }                                                                                               \
            o += POP[lanes];                                                                                \
            const int nan = nan_on && ((((a & lo) + nan_add) & changed) != 0);                             \
            if (count > cmax || nan) {                                                                      \
                dense = 1;                                                                                  \
                o = o0;                                                                                     \
            }                                                                                               \
          }                                                                                                 \
        }                                                                                                   \
    }                                                                                                       \
    row[CHANGED] = count;                                                                                   \
    row[DENSE] = dense;                                                                                     \
    row[OUT0] = o0;                                                                                         \
    row[OUT1] = dense ? o0 : o;                                                                             \
    row[DW] = (int64_t)dw;                                                                                  \
    row[DS] = (int64_t)ds;                                                                                  \
    return dense ? o0 : o;                                                                                  \
}

DEFINE_DIFF(diff1, uint8_t, 8)
DEFINE_DIFF(diff2, uint16_t, 4)
DEFINE_DIFF(diff4, uint32_t, 2)
DEFINE_DIFF(diff8, uint64_t, 1)

int64_t hal_delta_diff(const uint64_t *cur, uint64_t *snap, int64_t nwords, int32_t es, int64_t nt,
                       int64_t *rows, int32_t *pos, void *vals, int32_t nan_on, uint64_t absmask,
                       uint64_t infbits) {
    int64_t out = 0, done = 0;
    for (int64_t t = 0; t < nt; t++) {
        int64_t *row = rows + t * ROW;
        const int64_t w0 = row[W0];
        if (w0 > done) memcpy(snap + done, cur + done, (size_t)(w0 - done) * 8); /* padding between views */
        switch (es) {
        case 1: out = diff1(cur + w0, snap + w0, row, pos, (uint8_t *)vals, out, nan_on, (uint8_t)absmask,
                            (uint8_t)infbits); break;
        case 2: out = diff2(cur + w0, snap + w0, row, pos, (uint16_t *)vals, out, nan_on, (uint16_t)absmask,
                            (uint16_t)infbits); break;
        case 4: out = diff4(cur + w0, snap + w0, row, pos, (uint32_t *)vals, out, nan_on, (uint32_t)absmask,
                            (uint32_t)infbits); break;
        default: out = diff8(cur + w0, snap + w0, row, pos, (uint64_t *)vals, out, nan_on, absmask, infbits);
        }
        done = w0 + (row[NBYTES] + 7) / 8;
    }
    if (nwords > done) memcpy(snap + done, cur + done, (size_t)(nwords - done) * 8);
    return out;
}

/* Each tensor's checksum parts (W, S) into its row, copying the region into snap (when not NULL). */
void hal_delta_seed(const uint64_t *cur, uint64_t *snap, int64_t nwords, int32_t es, int64_t nt,
                    int64_t *rows) {
    const int64_t per = 8 / es;
    int64_t done = 0;
    for (int64_t t = 0; t < nt; t++) {
        int64_t *row = rows + t * ROW;
        const int64_t w0 = row[W0], nbytes = row[NBYTES];
        const int64_t numel = nbytes / es, nw = (nbytes + 7) / 8;
        const uint64_t last = own_mask(numel - (nw - 1) * per, per, es);
        const uint64_t *c = cur + w0;
        if (snap && w0 > done) memcpy(snap + done, cur + done, (size_t)(w0 - done) * 8);
        uint64_t w = 0, sum = 0;
        if (snap) {
            uint64_t *s = snap + w0;
            for (int64_t i = 0; i < nw; i++) {
                const uint64_t a = c[i];
                s[i] = a;
                const uint64_t v = i == nw - 1 ? a & last : a;
                sum += v;
                w += v * (uint64_t)(2 * i + 1);
            }
        } else {
            for (int64_t i = 0; i < nw; i++) {
                const uint64_t v = i == nw - 1 ? c[i] & last : c[i];
                sum += v;
                w += v * (uint64_t)(2 * i + 1);
            }
        }
        row[DW] = (int64_t)w;
        row[DS] = (int64_t)sum;
        done = w0 + nw;
    }
    if (snap && nwords > done) memcpy(snap + done, cur + done, (size_t)(nwords - done) * 8);
}

/* Write vals at the int32 positions pos (n of them) into dst (numel values of es bytes) when `write`, and
   put the change of dst's checksum parts (W, S) into out[0], out[1]. Returns -1, or the index of the first
   position outside [0, numel) (then nothing was written). */
#define DEFINE_APPLY(NAME, T, PER)                                                                         \
static void NAME(T *dst, const int32_t *pos, const T *vals, int64_t n, int write, int64_t *out) {          \
    uint64_t ds = 0, dw = 0;                                                                                \
    for (int64_t k = 0; k < n; k++) {                                                                       \
        const int64_t p = pos[k];                                                                           \
        const T v = vals[k];                                                                                \
        const uint64_t d = ((uint64_t)v - (uint64_t)dst[p]) << (8 * sizeof(T) * (p % PER));                 \
        ds += d;                                                                                            \
        dw += d * (uint64_t)(2 * (p / PER) + 1);                                                            \
        if (write) dst[p] = v;                                                                              \
    }                                                                                                       \
    out[0] = (int64_t)dw;                                                                                   \
    out[1] = (int64_t)ds;                                                                                   \
}

DEFINE_APPLY(apply1, uint8_t, 8)
DEFINE_APPLY(apply2, uint16_t, 4)
DEFINE_APPLY(apply4, uint32_t, 2)
DEFINE_APPLY(apply8, uint64_t, 1)

int64_t hal_delta_apply(void *dst, int64_t numel, int32_t es, const int32_t *pos, const void *vals, int64_t n,
                        int32_t write, int64_t *out) {
    for (int64_t k = 0; k < n; k++)
        if (pos[k] < 0 || pos[k] >= numel) return k;
    switch (es) {
    case 1: apply1((uint8_t *)dst, pos, (const uint8_t *)vals, n, write, out); break;
    case 2: apply2((uint16_t *)dst, pos, (const uint16_t *)vals, n, write, out); break;
    case 4: apply4((uint32_t *)dst, pos, (const uint32_t *)vals, n, write, out); break;
    default: apply8((uint64_t *)dst, pos, (const uint64_t *)vals, n, write, out);
    }
    return -1;
}

/* XOR of n values of es bytes (zero-extended) into out[0]; with expmask, in out[1] how many have an
   exponent field neither all zeros nor all ones, in out[2] how many have one of those and a mantissa
   (mantmask) that is not zero (subnormals, NaNs), the first odd_cap of their indices into odd. Counted in
   chunks in the values' own width, so that the compiler can vectorize the loop. */
#define CHUNK 32768
#define DEFINE_XOR(NAME, T)                                                                                \
static void NAME(const T *v, int64_t n, T em, T mm, int64_t *out, int64_t *odd, int64_t odd_cap) {         \
    T x = 0;                                                                                                \
    int64_t normal = 0, nodd = 0;                                                                           \
    if (!em) {                                                                                              \
        for (int64_t k = 0; k < n; k++) x ^= v[k];                                                          \
    }                                                                                                       \
    const int64_t chunk = (T)~(T)0 < CHUNK ? (int64_t)(T)~(T)0 : CHUNK; /* cnt cannot wrap */             \
    for (int64_t c0 = 0; em && c0 < n; c0 += chunk) {                                                       \
        const int64_t c1 = n - c0 < chunk ? n : c0 + chunk;                                                 \
        T cnt = 0, any = 0;                                                                                 \
        for (int64_t k = c0; k < c1; k++) {                                                                 \
            const T w = v[k], e = w & em;                                                                   \
            const T edge = (T)((e == 0) | (e == em));                                                       \
            x ^= w;                                                                                         \
            cnt += (T)(edge ^ 1);                                                                           \
            any |= (T)(edge & ((w & mm) != 0));                                                             \
        }                                                                                                   \
        normal += (int64_t)cnt;                                                                             \
        if (any) {                                                                                          \
            for (int64_t k = c0; k < c1; k++) {                                                             \
                const T e = v[k] & em;                                                                      \
                if (((e == 0) | (e == em)) && (v[k] & mm)) {                                                \
                    if (nodd < odd_cap) odd[nodd] = k;                                                      \
                    nodd++;                                                                                 \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    out[0] = (int64_t)(uint64_t)x;                                                                          \
    out[1] = normal;                                                                                        \
    out[2] = nodd;                                                                                          \
}

DEFINE_XOR(xor1, uint8_t)
DEFINE_XOR(xor2, uint16_t)
DEFINE_XOR(xor4, uint32_t)
DEFINE_XOR(xor8, uint64_t)

void hal_delta_xor(const void *v, int64_t n, int32_t es, uint64_t em, uint64_t mm, int64_t *out, int64_t *odd,
                   int64_t odd_cap) {
    switch (es) {
    case 1: xor1((const uint8_t *)v, n, (uint8_t)em, (uint8_t)mm, out, odd, odd_cap); break;
    case 2: xor2((const uint16_t *)v, n, (uint16_t)em, (uint16_t)mm, out, odd, odd_cap); break;
    case 4: xor4((const uint32_t *)v, n, (uint32_t)em, (uint32_t)mm, out, odd, odd_cap); break;
    default: xor8((const uint64_t *)v, n, em, mm, out, odd, odd_cap);
    }
}
"""

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "lib": the loaded library or None, "reason": why not


def cache_root() -> pathlib.Path:
    """Return the folder holding built libraries: ``$HAL_CACHE_DIR`` or ``~/.cache/hal``."""
    return pathlib.Path(os.environ.get("HAL_CACHE_DIR") or pathlib.Path.home() / ".cache" / "hal")


def _compiler() -> str | None:
    named = os.environ.get("CC", "").split()
    for name in named[:1] or ["cc", "gcc", "clang"]:
        if shutil.which(name):
            return name
    return None


FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99")


def _build(compiler: str) -> pathlib.Path:
    """Compile :data:`SOURCE` (once per source, compiler and machine) and return the library's path."""
    key = hashlib.sha256("\0".join((SOURCE, compiler, platform.machine(), platform.system(), *FLAGS)).encode()
                         ).hexdigest()[:16]
    folder = cache_root() / "delta" / key
    lib = folder / "libhal_delta.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f"hal_delta.{os.getpid()}.c"
    tmp = folder / f"libhal_delta.{os.getpid()}.so"
    src.write_text(SOURCE)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", str(tmp), str(src)], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{compiler} did not finish within {BUILD_TIMEOUT_S:g} s") from exc
    finally:
        src.unlink(missing_ok=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed (exit {done.returncode}): {done.stderr.strip()[:2000]}")
    os.replace(tmp, lib)  # atomic: a concurrent builder's identical file, or ours, is what others load
    return lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint64
    lib.hal_delta_diff.restype = i64
    lib.hal_delta_diff.argtypes = [p, p, i64, i32, i64, p, p, p, i32, u64, u64]
    lib.hal_delta_seed.restype = None
    lib.hal_delta_seed.argtypes = [p, p, i64, i32, i64, p]
    lib.hal_delta_apply.restype = i64
    lib.hal_delta_apply.argtypes = [p, i64, i32, p, p, i64, i32, p]
    lib.hal_delta_xor.restype = None
    lib.hal_delta_xor.argtypes = [p, i64, i32, u64, u64, p, p, i64]
    return lib


def library() -> ctypes.CDLL | None:
    """Return the loaded library, building it on first use; ``None`` where unavailable (see :func:`status`)."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return None
    with _LOCK:
        if "lib" not in _STATE:
            compiler = _compiler()
            if compiler is None:
                _STATE.update(lib=None, reason="no C compiler ($CC, cc, gcc or clang) on PATH")
            else:
                try:
                    _STATE.update(lib=_declare(ctypes.CDLL(str(_build(compiler)))), reason="")
                except (RuntimeError, OSError) as exc:
                    _STATE.update(lib=None, reason=f"building the delta kernel failed: {exc}")
        return _STATE["lib"]  # type: ignore[return-value]


def status() -> tuple[bool, str]:
    """Return ``(True, "")`` when the C loops are used, else ``(False, why)``."""
    if library() is not None:
        return True, ""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return False, f"{ENV}={os.environ[ENV]}"
    return False, str(_STATE.get("reason", ""))


def _ptr(t: torch.Tensor | np.ndarray) -> int:
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data


def diff(lib: ctypes.CDLL, cur: torch.Tensor, snap: torch.Tensor, es: int, rows: np.ndarray,
         pos: torch.Tensor | np.ndarray, vals: torch.Tensor | np.ndarray, nan: tuple[int, int] | None) -> int:
    """Run ``hal_delta_diff`` over host words ``cur`` against ``snap`` (updated); return the entries written.

    ``rows``: ``[n, ROW]`` int64 with ``W0``, ``NBYTES``, ``CMAX`` filled; ``pos`` (int32) and ``vals`` must hold
    :func:`capacity` entries; ``nan``: the dtype's ``(absmask, infbits)`` or ``None``.
    """
    need = capacity(rows, es)
    have = min(pos.numel(), vals.numel() // es) if isinstance(pos, torch.Tensor) else min(pos.size, vals.size // es)
    if have < need:
        raise ValueError(f"pos/vals hold {have} entries, the region may write {need}")
    absmask, infbits = nan if nan is not None else (0, 0)
    return lib.hal_delta_diff(_ptr(cur), _ptr(snap), cur.numel(), es, rows.shape[0], _ptr(rows), _ptr(pos),
                              _ptr(vals), int(nan is not None), absmask, infbits)


def capacity(rows: np.ndarray, es: int) -> int:
    """Return how many entries :func:`diff` may write for ``rows``."""
    per = 8 // es
    numel = rows[:, NBYTES] // es
    return int(np.minimum(numel, np.maximum(rows[:, CMAX], 0) + per).sum()) + per


def seed(lib: ctypes.CDLL, cur: torch.Tensor, snap: torch.Tensor | None, es: int, rows: np.ndarray) -> None:
    """Run ``hal_delta_seed``: fill each row's ``DW``/``DS`` checksum parts; copy ``cur`` into ``snap`` if given."""
    lib.hal_delta_seed(_ptr(cur), 0 if snap is None else _ptr(snap), cur.numel(), es, rows.shape[0], _ptr(rows))


def apply(lib: ctypes.CDLL, dst: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor, write: bool
          ) -> tuple[int, int] | int:
    """Run ``hal_delta_apply``; return the checksum change ``(dW, dS)``, or the first out-of-range position (int)."""
    out = np.zeros(2, dtype=np.int64)
    bad = lib.hal_delta_apply(_ptr(dst), dst.numel(), dst.element_size(), _ptr(pos), _ptr(vals), pos.numel(),
                              int(write), _ptr(out))
    if bad >= 0:
        return int(bad)
    return int(out[0]) & (2**64 - 1), int(out[1]) & (2**64 - 1)


# Subnormals and NaNs xor_values lists by index; past that many it only counts them.
ODD_CAP = 1024


def xor_values(lib: ctypes.CDLL, values: torch.Tensor, exp_mask: int = 0, mant_mask: int = 0
               ) -> tuple[int, int, int, torch.Tensor]:
    """Run ``hal_delta_xor``: return (XOR of raw elements, normal count, subnormal/NaN count, their first indices)."""
    out = np.zeros(3, dtype=np.int64)
    odd = torch.empty(ODD_CAP, dtype=torch.int64)
    lib.hal_delta_xor(_ptr(values), values.numel(), values.element_size(), exp_mask, mant_mask, _ptr(out),
                      _ptr(odd), ODD_CAP)
    return int(out[0]) & (2**64 - 1), int(out[1]), int(out[2]), odd[:min(int(out[2]), ODD_CAP)]
