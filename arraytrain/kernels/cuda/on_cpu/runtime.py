"""CUDA C on the CPU: the CUDA family's own source strings compiled by the system C++ compiler.

:data:`PRELUDE` gives CUDA's built-ins their meaning on the host. Every block runs on one OS
thread, its threads as fibers (a stack each, switched by a few instructions of x86-64
assembly on ELF systems, ``ucontext`` elsewhere) that really interleave: a fiber runs until it waits at a
barrier (``__syncthreads``, ``__syncthreads_or``) or a warp operation (shuffles, ballots,
``__reduce_max_sync``), whose 32 lanes meet and exchange there in step; the scheduler
resumes the runnable fibers in alternating order (forward, then backward; odd blocks start
backward), so that a read of shared memory that lacks its barrier sees another thread's
stale value whichever side of the race it is on. Blocks run one after another (``__shared__`` is a static: one per
kernel, reused by the next block). Atomics are plain read-modify-writes (one thread of
execution). A barrier that can never complete is reported as an error naming the kernel.

:class:`Module` compiles a source with an entry point per name expression (the template
instance's address) and the byte size of each of its parameters, so that the launch
packs arguments as the CUDA driver does (a pointer to each argument's bytes) and checks
each argument's size against the parameter's: an argument that would be misread on a GPU
(a float64 where the kernel takes a float) is an error here. Compiled libraries are kept
in a cache directory keyed by the source, the expressions and the compiler's flags
(``ARRAYTRAIN_CUDA_CPU_CACHE``, default ``~/.cache/arraytrain/cuda-cpu``).

What it cannot see: memory coalescing, bank conflicts and speed; true concurrency between
blocks (a race between blocks, or an atomic's ordering); races that the two interleavings
do not hit; NVRTC's own compiler (its warnings, its defaults such as contracting a * b + c
into an fma, which this build does not: ``-ffp-contract=off``); out-of-bounds reads.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import mmap
import os
import subprocess
import tempfile
import threading

import numpy as np

# The architecture the sources' ``#if __CUDA_ARCH__`` branches see (sm_80: __reduce_max_sync).
ARCH = int(os.environ.get("ARRAYTRAIN_CUDA_CPU_ARCH", "800"))
CXX = os.environ.get("CXX", "g++")
FLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-strict-aliasing",
         "-ffp-contract=off", "-fno-fast-math")
MAX_THREADS = 1024
STACK_BYTES = 64 * 1024

PRELUDE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <type_traits>
#include <utility>

#define ARRAYTRAIN_CUDA_ON_CPU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static

struct dim3 { unsigned int x, y, z; };
static dim3 threadIdx, blockIdx, blockDim, gridDim;
static const int warpSize = 32;

// -- bits, arithmetic with an explicit rounding, integer intrinsics ------------------------
template <typename To, typename From> static inline To at_bits(From f) { To t; memcpy(&t, &f, sizeof t); return t; }
static inline unsigned int __float_as_uint(float x) { return at_bits<unsigned int>(x); }
static inline int __float_as_int(float x) { return at_bits<int>(x); }
static inline float __uint_as_float(unsigned int x) { return at_bits<float>(x); }
static inline float __int_as_float(int x) { return at_bits<float>(x); }
static inline long long __double_as_longlong(double x) { return at_bits<long long>(x); }
static inline double __longlong_as_double(long long x) { return at_bits<double>(x); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
template <typename T> static inline T __ldg(const T* p) { return *p; }
// CUDA's min/max: float ones are fminf/fmaxf, integer ones of the common type
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline float min(float a, float b) { return fminf(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
template <typename A, typename B, typename = typename std::enable_if<std::is_integral<A>::value && std::is_integral<B>::value>::type>
static inline typename std::common_type<A, B>::type max(A a, B b) {
    typedef typename std::common_type<A, B>::type C; return (C)a > (C)b ? (C)a : (C)b;
}
template <typename A, typename B, typename = typename std::enable_if<std::is_integral<A>::value && std::is_integral<B>::value>::type>
static inline typename std::common_type<A, B>::type min(A a, B b) {
    typedef typename std::common_type<A, B>::type C; return (C)a < (C)b ? (C)a : (C)b;
}
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
// -- atomics: one thread of execution, so a read-modify-write; each returns the old value ----
template <typename T, typename U> static inline T atomicAdd(T* p, U v) { T o = *p; *p = (T)(o + v); return o; }
template <typename T, typename U> static inline T atomicOr(T* p, U v) { T o = *p; *p = (T)(o | v); return o; }
template <typename T, typename U> static inline T atomicAnd(T* p, U v) { T o = *p; *p = (T)(o & v); return o; }
template <typename T, typename U> static inline T atomicMin(T* p, U v) { T o = *p; if ((T)v < o) *p = (T)v; return o; }
template <typename T, typename U> static inline T atomicMax(T* p, U v) { T o = *p; if ((T)v > o) *p = (T)v; return o; }
template <typename T, typename U> static inline T atomicExch(T* p, U v) { T o = *p; *p = (T)v; return o; }
template <typename T> static inline T atomicCAS(T* p, T c, T v) { T o = *p; if (o == c) *p = v; return o; }

// -- fibers --------------------------------------------------------------------------------
#if defined(__x86_64__) && defined(__ELF__) && !defined(AT_UCONTEXT)  // -DAT_UCONTEXT: the portable switch
#define AT_ASM_SWITCH 1
#endif
#if AT_ASM_SWITCH
extern "C" void at_swap(void** save_sp, void* next_sp);
__asm__(
    ".text\n.p2align 4\n.globl at_swap\n.hidden at_swap\n.type at_swap,@function\nat_swap:\n"
    "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\n"
    "subq $16, %rsp\nstmxcsr 8(%rsp)\nfnstcw (%rsp)\n"
    "movq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
    "ldmxcsr 8(%rsp)\nfldcw (%rsp)\naddq $16, %rsp\n"
    "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n"
    ".size at_swap,.-at_swap\n");
#else
#include <ucontext.h>
#endif

struct at_fiber {
    void* sp; char* stack; int tid, done, wait; unsigned long long gen;
#if !AT_ASM_SWITCH
    ucontext_t uc;
#endif
};
enum { AT_RUN = 0, AT_BLOCK = 1, AT_WARP = 2 };
static at_fiber* at_f;          // the block's fibers
static int at_n, at_alive;      // threads per block, not yet returned
static at_fiber* at_cur;
static void* at_sched_sp;
#if !AT_ASM_SWITCH
static ucontext_t at_sched_uc;
#endif
static void (*at_invoke)(void*, void**);
static void* at_kernel;
static void** at_args;
static unsigned long long at_block_gen;
static int at_block_arrived, at_or_acc, at_or_res;
static unsigned long long at_warp_gen[32];
static int at_warp_arrived[32];
static unsigned int at_warp_alive[32];
static unsigned long long at_xchg[32][2][32];
static unsigned int at_warp_came[32], at_warp_met[32][2];  // lanes at the meeting, then per parity

static void at_set_thread(const at_fiber* f) {
    threadIdx.x = (unsigned)f->tid % blockDim.x;
    threadIdx.y = (unsigned)f->tid / blockDim.x % blockDim.y;
    threadIdx.z = (unsigned)f->tid / (blockDim.x * blockDim.y);
}
static void at_yield() {
#if AT_ASM_SWITCH
    at_swap(&at_cur->sp, at_sched_sp);
#else
    swapcontext(&at_cur->uc, &at_sched_uc);
#endif
}
static void at_resume(at_fiber* f) {
    at_cur = f;
    at_set_thread(f);
#if AT_ASM_SWITCH
    at_swap(&at_sched_sp, f->sp);
#else
    swapcontext(&at_sched_uc, &f->uc);
#endif
}
static void at_release_block() { at_block_arrived = 0; at_or_res = at_or_acc; at_or_acc = 0; ++at_block_gen; }
static void at_release_warp(int w) {
    at_warp_met[w][at_warp_gen[w] & 1] = at_warp_came[w];
    at_warp_came[w] = 0; at_warp_arrived[w] = 0; ++at_warp_gen[w];
}
static void at_fiber_main() {
    at_invoke(at_kernel, at_args);
    at_fiber* f = at_cur;
    f->done = 1;
    --at_alive;
    const int w = f->tid >> 5;
    at_warp_alive[w] &= ~(1u << (f->tid & 31));
    // a thread that returned no longer holds a barrier back (as on the hardware)
    if (at_block_arrived > 0 && at_block_arrived == at_alive) at_release_block();
    if (at_warp_arrived[w] > 0 && at_warp_arrived[w] == __builtin_popcount(at_warp_alive[w])) at_release_warp(w);
    at_yield();
    __builtin_trap();
}

// -- barriers and warp operations ----------------------------------------------------------
static void __syncthreads() {
    at_fiber* f = at_cur;
    f->gen = at_block_gen;
    if (++at_block_arrived == at_alive) at_release_block();
    f->wait = AT_BLOCK;  // the last to arrive waits too: the others go first
    at_yield();
}
static int __syncthreads_or(int p) { if (p) at_or_acc = 1; __syncthreads(); return at_or_res; }
static void at_warp_meet(unsigned int mask) {
    at_fiber* f = at_cur;
    const int w = f->tid >> 5;
    f->gen = at_warp_gen[w];
    at_warp_came[w] |= 1u << (f->tid & 31);
    if (++at_warp_arrived[w] == __builtin_popcount(mask & at_warp_alive[w])) at_release_warp(w);
    f->wait = AT_WARP;
    at_yield();
}
static void __syncwarp(unsigned int mask = 0xffffffffu) { at_warp_meet(mask); }
// each lane posts a value; after the meeting every lane reads the posts of its warp (and which
// lanes met: at_met), kept per parity of the meeting so that the next one cannot overwrite them
static int at_parity;
template <typename T> static const unsigned long long* at_post(unsigned int mask, T v) {
    const int w = at_cur->tid >> 5, lane = at_cur->tid & 31, b = (int)(at_warp_gen[w] & 1);
    unsigned long long u = 0; memcpy(&u, &v, sizeof v);
    at_xchg[w][b][lane] = u;
    at_warp_meet(mask);
    at_parity = b;
    return at_xchg[w][b];
}
static unsigned int at_met() { return at_warp_met[at_cur->tid >> 5][at_parity]; }
template <typename T> static T at_read(const unsigned long long* posts, int src) { T t; memcpy(&t, &posts[src], sizeof t); return t; }
template <typename T> static T __shfl_sync(unsigned int mask, T v, int src, int width = 32) {
    const int lane = at_cur->tid & 31;
    const unsigned long long* p = at_post(mask, v);
    return at_read<T>(p, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <typename T> static T __shfl_down_sync(unsigned int mask, T v, unsigned int d, int width = 32) {
    const int lane = at_cur->tid & 31;
    const unsigned long long* p = at_post(mask, v);
    return (lane & (width - 1)) + (int)d < width ? at_read<T>(p, lane + (int)d) : v;
}
template <typename T> static T __shfl_up_sync(unsigned int mask, T v, unsigned int d, int width = 32) {
    const int lane = at_cur->tid & 31;
    const unsigned long long* p = at_post(mask, v);
    return (lane & (width - 1)) >= (int)d ? at_read<T>(p, lane - (int)d) : v;
}
template <typename T> static T __shfl_xor_sync(unsigned int mask, T v, int o, int width = 32) {
    const int lane = at_cur->tid & 31, src = lane ^ o;
    const unsigned long long* p = at_post(mask, v);
    return (src & ~(width - 1)) == (lane & ~(width - 1)) ? at_read<T>(p, src) : v;
}
static unsigned int __ballot_sync(unsigned int mask, int pred) {
    const unsigned long long* p = at_post(mask, (unsigned long long)(pred != 0));
    const unsigned int lanes = at_met();
    unsigned int r = 0;
    for (int l = 0; l < 32; ++l) if ((lanes >> l & 1u) && p[l]) r |= 1u << l;
    return r;
}
static int __any_sync(unsigned int mask, int pred) { return __ballot_sync(mask, pred) != 0; }
static int __all_sync(unsigned int mask, int pred) { const unsigned int b = __ballot_sync(mask, pred); return b == at_met(); }
static unsigned int __reduce_max_sync(unsigned int mask, unsigned int v) {
    const unsigned long long* p = at_post(mask, v);
    const unsigned int lanes = at_met();
    unsigned int r = 0;
    for (int l = 0; l < 32; ++l) if (lanes >> l & 1u) r = (unsigned int)p[l] > r ? (unsigned int)p[l] : r;
    return r;
}
// -- launch --------------------------------------------------------------------------------
static void at_start(at_fiber* f, char* stack) {
#if AT_ASM_SWITCH
    uintptr_t* sp = (uintptr_t*)(((uintptr_t)(stack + STACK_BYTES)) & ~(uintptr_t)15);
    *--sp = 0;                           // the entry sees rsp = 8 mod 16, as after a call
    *--sp = (uintptr_t)&at_fiber_main;   // at_swap's ret
    for (int r = 0; r < 6; ++r) *--sp = 0;
    sp -= 2;
    unsigned int csr; unsigned short cw;
    __asm__ volatile("stmxcsr %0" : "=m"(csr));
    __asm__ volatile("fnstcw %0" : "=m"(cw));
    memcpy((char*)sp + 8, &csr, 4); memcpy((char*)sp, &cw, 2);
    f->sp = sp;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = stack; f->uc.uc_stack.ss_size = STACK_BYTES; f->uc.uc_link = nullptr;
    makecontext(&f->uc, at_fiber_main, 0);
#endif
}

// Runs the grid on `stacks` (MAX_THREADS stacks of STACK_BYTES, the lowest page of each a guard:
// one region per process, given by the launcher, which launches one kernel at a time); 0, or 1 with
// a message in err.
static int at_launch(void* kernel, void (*invoke)(void*, void**), const unsigned int* dims, void** args,
                     char* stacks, const char* name, char* err, int errlen) {
    const long long n = (long long)dims[3] * dims[4] * dims[5];
    if (n <= 0 || n > MAX_THREADS) { snprintf(err, errlen, "%s: %lld threads per block (1 to %d)", name, n, MAX_THREADS); return 1; }
    static at_fiber fibers[MAX_THREADS];
    gridDim.x = dims[0]; gridDim.y = dims[1]; gridDim.z = dims[2];
    blockDim.x = dims[3]; blockDim.y = dims[4]; blockDim.z = dims[5];
    at_invoke = invoke; at_kernel = kernel; at_args = args; at_f = fibers; at_n = (int)n;
    for (unsigned bz = 0; bz < gridDim.z; ++bz)
    for (unsigned by = 0; by < gridDim.y; ++by)
    for (unsigned bx = 0; bx < gridDim.x; ++bx) {
        blockIdx.x = bx; blockIdx.y = by; blockIdx.z = bz;
        at_alive = (int)n; at_block_arrived = 0; at_or_acc = at_or_res = 0;
        for (int w = 0; w < 32; ++w) {
            at_warp_arrived[w] = 0; at_warp_came[w] = 0;
            const long long lo = 32LL * w;
            at_warp_alive[w] = lo >= n ? 0u : (n - lo >= 32 ? 0xffffffffu : (1u << (n - lo)) - 1u);
        }
        for (int t = 0; t < n; ++t) {
            at_fiber* f = &fibers[t];
            f->tid = t; f->done = 0; f->wait = AT_RUN; f->gen = 0;
            f->stack = stacks + (long long)t * STACK_BYTES;
            at_start(f, f->stack);
        }
        for (int pass = 0;; ++pass) {
            int live = 0, ran = 0;
            // the direction alternates per pass and starts per block (even blocks forward), so a
            // launch of two blocks or more runs the code before its first barrier in both orders
            const bool back = ((pass + bx + by + bz) & 1) != 0;
            for (int k = 0; k < n; ++k) {
                at_fiber* f = &fibers[back ? n - 1 - k : k];
                if (f->done) continue;
                ++live;
                if (f->wait == AT_BLOCK && f->gen == at_block_gen) continue;
                if (f->wait == AT_WARP && f->gen == at_warp_gen[f->tid >> 5]) continue;
                f->wait = AT_RUN;
                at_resume(f);
                ++ran;
            }
            if (!live) break;
            if (!ran) {
                int t = 0; while (fibers[t].done) ++t;
                snprintf(err, errlen, "%s: block (%u, %u, %u) cannot go on: thread %d waits at a %s that %d of "
                         "%d live threads reached", name, bx, by, bz, t,
                         fibers[t].wait == AT_BLOCK ? "__syncthreads" : "warp operation",
                         fibers[t].wait == AT_BLOCK ? at_block_arrived : at_warp_arrived[t >> 5],
                         fibers[t].wait == AT_BLOCK ? at_alive : __builtin_popcount(at_warp_alive[t >> 5]));
                return 1;
            }
        }
    }
    return 0;
}

template <typename T> struct at_unref { typedef typename std::remove_cv<typename std::remove_reference<T>::type>::type type; };
template <typename... A, size_t... I>
static void at_call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<typename at_unref<A>::type*>(args[I])...);
}
template <typename... A> struct at_kernel_of {
    static void invoke(void* f, void** args) { at_call(reinterpret_cast<void (*)(A...)>(f), args, std::index_sequence_for<A...>{}); }
    static int sizes(long long* out, int cap) {
        const long long s[] = {(long long)sizeof(typename at_unref<A>::type)..., 0LL};
        for (size_t i = 0; i < sizeof...(A) && (int)i < cap; ++i) out[i] = s[i];
        return (int)sizeof...(A);
    }
};
template <typename... A> static at_kernel_of<A...> at_kernel_type(void (*)(A...));
"""

_ENTRY = r"""
extern "C" __attribute__((visibility("default"))) int at_params_{i}(long long* out, int cap) {{
    return decltype(at_kernel_type(&{expr}))::sizes(out, cap);
}}
extern "C" __attribute__((visibility("default"))) int at_launch_{i}(const unsigned int* dims, void** args, char* stacks, char* err, int n) {{
    return at_launch(reinterpret_cast<void*>(&{expr}), &decltype(at_kernel_type(&{expr}))::invoke, dims, args,
                     stacks, "{name}", err, n);
}}
"""


def _cache_dir() -> str:
    d = os.environ.get("ARRAYTRAIN_CUDA_CPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "arraytrain",
                                                                     "cuda-cpu")
    os.makedirs(d, exist_ok=True)
    return d


def translation_unit(code: str, exprs) -> str:
    """The C++ the host compiler gets: the prelude, the CUDA source unchanged, one entry per expression."""
    head = f"#define __CUDA_ARCH__ {ARCH}\n#define MAX_THREADS {MAX_THREADS}\n#define STACK_BYTES {STACK_BYTES}\n"
    entries = "".join(_ENTRY.format(i=i, expr=e, name=e.replace('"', "'")) for i, e in enumerate(exprs))
    return head + PRELUDE + "\n#line 1 \"cuda-source\"\n" + code + "\n" + entries


def build(code: str, options, exprs) -> str:
    """The shared library of ``code`` with entries for ``exprs`` (compiled once, then from the cache)."""
    extra = tuple(o for o in options if o.startswith("-D"))  # -std= etc. are NVRTC's; the host build sets its own
    unit = translation_unit(code, exprs)
    key = hashlib.sha256("\0".join((CXX, *FLAGS, *extra, unit)).encode()).hexdigest()[:32]
    path = os.path.join(_cache_dir(), f"{key}.so")
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process or thread building the same library: wait for it
        if os.path.exists(path):
            return path
        with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
            src = os.path.join(tmp, "unit.cpp")
            with open(src, "w") as f:
                f.write(unit)
            out = os.path.join(tmp, "unit.so")
            r = subprocess.run([CXX, *FLAGS, *extra, "-o", out, src], capture_output=True, text=True)
            if r.returncode:
                raise CompileError(f"{CXX} could not compile {', '.join(exprs)}:\n{r.stderr[-6000:]}")
            os.replace(out, path)  # atomic: another process sees the whole library or none
    return path


_launch_lock = threading.Lock()  # one kernel at a time: every library runs its blocks on the same stacks
_stacks = None


def _stack_region():
    """The process's fiber stacks: MAX_THREADS of STACK_BYTES in one anonymous mapping, the lowest page of
    each made a guard (an overflow faults instead of writing into the next); pages are taken as touched."""
    global _stacks
    if _stacks is None:
        region = mmap.mmap(-1, MAX_THREADS * STACK_BYTES)
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        for t in range(MAX_THREADS):
            if libc.mprotect(base + t * STACK_BYTES, mmap.PAGESIZE, 0):  # PROT_NONE
                raise OSError(ctypes.get_errno(), "mprotect of a fiber stack's guard page")
        _stacks = (region, ctypes.c_void_p(base))
    return _stacks[1]


class CompileError(RuntimeError):
    """The host compiler rejected a CUDA source (its message attached)."""


class LaunchError(RuntimeError):
    """A kernel launch that a GPU would misread or never finish (argument sizes, a barrier that cannot complete)."""


class Module:
    """A compiled source (``cupy.RawModule``'s part the family uses): :meth:`get_function` by name expression."""

    def __init__(self, code: str, options=(), name_expressions=()):
        self._exprs = tuple(name_expressions)
        self._lib = ctypes.CDLL(build(code, options, self._exprs))

    def get_function(self, expr: str) -> "Function":
        if expr not in self._exprs:
            raise KeyError(f"{expr!r} was not among this module's name expressions")
        return Function(self._lib, self._exprs.index(expr), expr)


_SCALARS = {bool: np.bool_, int: np.int64, float: np.float64}  # CuPy's packing of Python scalars


class Function:
    """One kernel: ``fn(grid, block, args)`` as CuPy's RawKernel is called."""

    def __init__(self, lib, i: int, name: str):
        self.name = name
        self._launch = getattr(lib, f"at_launch_{i}")
        self._launch.restype = ctypes.c_int
        sizes = (ctypes.c_longlong * 256)()  # CUDA's 4 KB of kernel parameters: at most 512 pointers; ours take < 40
        count = getattr(lib, f"at_params_{i}")(sizes, len(sizes))
        if count > len(sizes):
            raise LaunchError(f"{name}: {count} parameters, more than the executor reads ({len(sizes)})")
        self.param_sizes = tuple(sizes[:count])

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        from . import DeviceArray

        grid, block = _dims(grid), _dims(block)
        if len(args) != len(self.param_sizes):
            raise LaunchError(f"{self.name}: {len(args)} arguments for {len(self.param_sizes)} parameters")
        keep, ptrs = [], (ctypes.c_void_p * max(len(args), 1))()
        for k, (a, size) in enumerate(zip(args, self.param_sizes)):
            if isinstance(a, DeviceArray):
                if size != 8:
                    raise LaunchError(f"{self.name}: argument {k} is an array, parameter {k} is {size} bytes")
                buf = ctypes.c_void_p(a.data.ptr)
            elif isinstance(a, np.ndarray):
                raise LaunchError(f"{self.name}: argument {k} is a NumPy (host) array; a kernel takes device arrays")
            else:
                if not isinstance(a, np.generic) and type(a) not in _SCALARS:
                    raise LaunchError(f"{self.name}: argument {k} ({type(a).__name__}) is no kernel argument")
                v = np.array(a if isinstance(a, np.generic) else _SCALARS[type(a)](a))
                if v.dtype.kind not in "biuf":
                    raise LaunchError(f"{self.name}: argument {k} ({v.dtype}) is no kernel argument")
                if v.itemsize != size:
                    raise LaunchError(f"{self.name}: argument {k} is {v.dtype} ({v.itemsize} bytes), "
                                      f"parameter {k} is {size} bytes")
                buf = v
            keep.append(buf)
            ptrs[k] = ctypes.addressof(buf) if isinstance(buf, ctypes.c_void_p) else buf.ctypes.data
        dims = (ctypes.c_uint * 6)(*grid, *block)
        err = ctypes.create_string_buffer(512)
        with _launch_lock:
            failed = self._launch(dims, ptrs, _stack_region(), err, len(err))
        if failed:
            raise LaunchError(err.value.decode())


def _dims(d):
    d = tuple(int(x) for x in (d if isinstance(d, tuple) else (d,)))
    return d + (1,) * (3 - len(d))

