/* A stand-in libcuda.so.1 for the preload library's tests: it records every launch (name, stream,
 * the caller's sequence number in gridDimX) to the file named by FAKE_CUDA_LOG, serves
 * cuGetProcAddress / cuGetProcAddress_v2 like the real driver (base names, the per-thread flag picks
 * the _ptsz variant), and keeps a fake GPU clock so event pairs have durations: a launch takes
 * blockDimX microseconds of "GPU time" on that clock, a graph launch 100 (FAKE_CUDA_GRAPH_US to
 * change it: a replayed graph is few long launches). Prototypes follow cuda.h.
 *
 * With FAKE_CUDA_REALTIME=1 the clock is the wall clock instead: the process's "GPU" runs one launch
 * after another, each taking its blockDimX microseconds from when the previous one ends (or from its
 * launch, when the GPU was idle); an event completes when the work queued before it has, a query
 * before then says not ready, and a synchronize sleeps until then (like a blocking-sync event).
 * FAKE_CUDA_LAUNCH_US=N makes each launch call spend N microseconds of CPU before its work reaches
 * the "GPU", as the real driver's launch path does (what a launch-bound program is bound by), and
 * FAKE_CUDA_RECORD_US=N each event record (what timing each launch costs such a program).
 * FAKE_CUDA_SHARED_GPU=PATH (with FAKE_CUDA_REALTIME) makes every process that names the same file
 * share one "GPU": the clock is a word in that file, so work runs one launch after another across
 * processes, in the order it was launched, and an event pair of one process spans whatever the
 * others queued in between (as time-slicing contexts do on a real GPU).
 *
 * Devices: FAKE_CUDA_DEVICES (at most 8, default 2) devices, each with a context of its own
 * (cuCtxGetCurrent / cuCtxSetCurrent per thread, cuCtxGetDevice), a UUID (cuDeviceGetUuid and _v2:
 * fa 4e, thirteen zeros, then the device's ordinal) and a clock of its own: work launched in a
 * device's context runs on that device's clock, and events and synchronizes follow that device's
 * work. A thread starts in the context of device FAKE_CUDA_DEVICE (default 0). On a shared GPU file
 * each device's clock is a word of its own (device d at byte 8 * d). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUstream;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

#include <time.h>

#define MAX_DEV 8
static _Atomic uint64_t own_clock_ns[MAX_DEV];
static _Atomic uint64_t *gpu_clock; /* own_clock_ns, or the shared GPU's words: one per device */
static _Atomic uint64_t own_end_ns[MAX_DEV];  /* in real time: when this process's queued work ends */
static int ctx_tokens[MAX_DEV]; /* a context per device: its address is the CUcontext */
static __thread int current_dev = -1;

/* The device of the calling thread's current context. */
static int dev(void) {
    if (current_dev < 0) {
        const char *d = getenv("FAKE_CUDA_DEVICE");
        current_dev = d ? atoi(d) % MAX_DEV : 0;
    }
    return current_dev;
}

static int device_count(void) {
    const char *n = getenv("FAKE_CUDA_DEVICES");
    int k = n ? atoi(n) : 2;
    return k < 1 ? 1 : k > MAX_DEV ? MAX_DEV : k;
}
static int log_fd = -1;
static int realtime = -1;
static long launch_us = -1;
static long record_us = -1;

static uint64_t wall_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#include <sys/mman.h>

/* The current device's clock word: the process's own, or its word of FAKE_CUDA_SHARED_GPU's file. */
static _Atomic uint64_t *clock_word(void) {
    if (gpu_clock) return gpu_clock + dev();
    _Atomic uint64_t *word = own_clock_ns;
    const char *path = getenv("FAKE_CUDA_SHARED_GPU");
    if (path && *path) {
        int fd = open(path, O_RDWR | O_CREAT, 0600);
        if (fd < 0 || ftruncate(fd, 4096) != 0) abort();
        void *m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED) abort();
        close(fd);
        word = (_Atomic uint64_t *)m;
    }
    gpu_clock = word;
    return word + dev();
}

static void spin_us(long us) {
    if (us <= 0) return;
    uint64_t until = wall_ns() + (uint64_t)us * 1000;
    while (wall_ns() < until) {
    }
}

/* The launch call's own CPU time, spent (spinning, like a CPU-bound driver) before the work is queued. */
static void submit_delay(void) {
    if (launch_us < 0) launch_us = getenv("FAKE_CUDA_LAUNCH_US") ? atol(getenv("FAKE_CUDA_LAUNCH_US")) : 0;
    spin_us(launch_us);
}

/* An event record's own CPU time (FAKE_CUDA_RECORD_US). */
static void record_delay(void) {
    if (record_us < 0) record_us = getenv("FAKE_CUDA_RECORD_US") ? atol(getenv("FAKE_CUDA_RECORD_US")) : 0;
    spin_us(record_us);
}

/* Read at the first call of any kind: an event recorded before the first launch needs it too. */
static int in_real_time(void) {
    if (realtime < 0) realtime = getenv("FAKE_CUDA_REALTIME") && atoi(getenv("FAKE_CUDA_REALTIME"));
    return realtime;
}

/* Queue `ns` of GPU work: in real time it starts when the GPU is free (or now, if idle). */
static void run_for(uint64_t ns) {
    submit_delay();
    _Atomic uint64_t *clock = clock_word();
    if (!in_real_time()) {
        atomic_fetch_add(clock, ns);
        return;
    }
    uint64_t now = wall_ns(), busy = atomic_load(clock);
    while (!atomic_compare_exchange_weak(clock, &busy, (busy > now ? busy : now) + ns)) {
    }
    uint64_t end = (busy > now ? busy : now) + ns, mine = atomic_load(&own_end_ns[dev()]);
    while (mine < end && !atomic_compare_exchange_weak(&own_end_ns[dev()], &mine, end)) {
    }
}

/* When the work queued so far ends (the fake clock's reading; in real time this process's work, at
 * least now: on a shared GPU an event follows its own stream's work, not the other processes'). */
static uint64_t queue_end(void) {
    uint64_t busy = in_real_time() ? atomic_load(&own_end_ns[dev()]) : atomic_load(clock_word());
    if (in_real_time()) {
        uint64_t now = wall_ns();
        if (busy < now) busy = now;
    }
    return busy;
}

static void log_call(const char *name, CUstream s, unsigned seq) {
    if (log_fd < 0) {
        const char *p = getenv("FAKE_CUDA_LOG");
        log_fd = p ? open(p, O_WRONLY | O_CREAT | O_APPEND, 0644) : 2;
    }
    char buf[128];
    int n = snprintf(buf, sizeof buf, "%s %lu %u\n", name, (unsigned long)(uintptr_t)s, seq);
    if (write(log_fd, buf, (size_t)n) < 0) abort();
}

#define LAUNCH(NAME)                                                                                   \
    CUresult NAME(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
                  unsigned shm, CUstream s, void **p, void **e) {                                      \
        (void)f; (void)gy; (void)gz; (void)by; (void)bz; (void)shm; (void)p; (void)e;                  \
        run_for((uint64_t)bx * 1000);                                          \
        log_call(#NAME, s, gx);                                                                        \
        return 0;                                                                                      \
    }
LAUNCH(cuLaunchKernel)
LAUNCH(cuLaunchKernel_ptsz)

#define LAUNCH_EX(NAME)                                                                                \
    CUresult NAME(const CUlaunchConfig *c, void *f, void **p, void **e) {                              \
        (void)f; (void)p; (void)e;                                                                     \
        run_for((uint64_t)c->blockDimX * 1000);                                \
        log_call(#NAME, c->hStream, c->gridDimX);                                                      \
        return 0;                                                                                      \
    }
LAUNCH_EX(cuLaunchKernelEx)
LAUNCH_EX(cuLaunchKernelEx_ptsz)

static uint64_t graph_ns(void) {
    static long us = -1;
    if (us < 0) us = getenv("FAKE_CUDA_GRAPH_US") ? atol(getenv("FAKE_CUDA_GRAPH_US")) : 100;
    return (uint64_t)us * 1000;
}

#define GRAPH(NAME)                                                                                    \
    CUresult NAME(void *g, CUstream s) {                                                               \
        run_for(graph_ns());                                                   \
        log_call(#NAME, s, (unsigned)(uintptr_t)g);                                                    \
        return 0;                                                                                      \
    }
GRAPH(cuGraphLaunch)
GRAPH(cuGraphLaunch_ptsz)

/* Device memory: FAKE_CUDA_MEM_TOTAL bytes (default 80 GiB), handed out as made-up addresses (never
 * touched), sizes kept in a small table so that frees give them back; past the total, the driver's
 * CUDA_ERROR_OUT_OF_MEMORY (2). Virtual-memory handles (cuMemCreate) share the table. */
#include <pthread.h>
#define FAKE_ALLOCS 65536
static struct { uint64_t key, size; } allocs[FAKE_ALLOCS];
static uint64_t allocated, next_address = 0x700000000000ull;
static pthread_mutex_t alloc_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t mem_total(void) {
    const char *t = getenv("FAKE_CUDA_MEM_TOTAL");
    return t ? strtoull(t, NULL, 10) : 80ull << 30;
}

static CUresult fake_alloc(unsigned long long *out, size_t n) {
    pthread_mutex_lock(&alloc_lock);
    if (allocated + n > mem_total()) {
        pthread_mutex_unlock(&alloc_lock);
        return 2;
    }
    for (int i = 0; i < FAKE_ALLOCS; i++)
        if (!allocs[i].key) {
            allocs[i].key = next_address;
            allocs[i].size = n;
            *out = next_address;
            next_address += (n + 0xfffff) & ~0xfffffull;
            allocated += n;
            pthread_mutex_unlock(&alloc_lock);
            return 0;
        }
    pthread_mutex_unlock(&alloc_lock);
    return 2;
}

static CUresult fake_free(unsigned long long key) {
    pthread_mutex_lock(&alloc_lock);
    for (int i = 0; i < FAKE_ALLOCS; i++)
        if (allocs[i].key == key) {
            allocated -= allocs[i].size;
            allocs[i].key = 0;
            pthread_mutex_unlock(&alloc_lock);
            return 0;
        }
    pthread_mutex_unlock(&alloc_lock);
    return 1; /* CUDA_ERROR_INVALID_VALUE */
}

CUresult cuMemAlloc_v2(unsigned long long *p, size_t n) { return fake_alloc(p, n); }
CUresult cuMemAllocManaged(unsigned long long *p, size_t n, unsigned flags) { (void)flags; return fake_alloc(p, n); }
CUresult cuMemAllocAsync(unsigned long long *p, size_t n, CUstream s) { (void)s; return fake_alloc(p, n); }
CUresult cuMemAllocAsync_ptsz(unsigned long long *p, size_t n, CUstream s) { (void)s; return fake_alloc(p, n); }
CUresult cuMemAllocFromPoolAsync(unsigned long long *p, size_t n, void *pool, CUstream s) {
    (void)pool; (void)s;
    return fake_alloc(p, n);
}
CUresult cuMemAllocFromPoolAsync_ptsz(unsigned long long *p, size_t n, void *pool, CUstream s) {
    (void)pool; (void)s;
    return fake_alloc(p, n); /* not through cuMemAllocFromPoolAsync: the preload library hooks that name */
}
CUresult cuMemAllocPitch_v2(unsigned long long *p, size_t *pitch, size_t width, size_t height, unsigned elem) {
    (void)elem;
    *pitch = (width + 511) & ~(size_t)511;
    return fake_alloc(p, *pitch * height);
}
CUresult cuMemFree_v2(unsigned long long p) { return fake_free(p); }
CUresult cuMemFreeAsync(unsigned long long p, CUstream s) { (void)s; return fake_free(p); }
CUresult cuMemFreeAsync_ptsz(unsigned long long p, CUstream s) { (void)s; return fake_free(p); }
CUresult cuMemCreate(unsigned long long *h, size_t n, const void *prop, unsigned long long flags) {
    (void)prop; (void)flags;
    return fake_alloc(h, n);
}
CUresult cuMemRelease(unsigned long long h) { return fake_free(h); }
CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total) {
    pthread_mutex_lock(&alloc_lock);
    *total = mem_total();
    *free_b = mem_total() - allocated;
    pthread_mutex_unlock(&alloc_lock);
    return 0;
}

/* Events: a slot holding the fake clock at record time. */
typedef struct { uint64_t at; int recorded; } fake_event;
CUresult cuEventCreate(fake_event **e, unsigned flags) { (void)flags; *e = calloc(1, sizeof **e); return 0; }
CUresult cuEventRecord(fake_event *e, CUstream s) {
    (void)s;
    record_delay();
    e->at = queue_end();
    e->recorded = 1;
    return 0;
}
CUresult cuEventRecord_ptsz(fake_event *e, CUstream s) { return cuEventRecord(e, s); }
CUresult cuEventSynchronize(fake_event *e) {
    if (in_real_time() && e->recorded) {
        uint64_t now = wall_ns();
        if (e->at > now) {
            struct timespec ts = {(time_t)((e->at - now) / 1000000000ull), (long)((e->at - now) % 1000000000ull)};
            nanosleep(&ts, NULL);
        }
    }
    return 0;
}
/* Without FAKE_CUDA_REALTIME work "finishes" as it is launched, so a recorded event is always
 * complete (600: not ready, or never recorded). */
CUresult cuEventQuery(fake_event *e) {
    if (!e->recorded) return 600;
    return in_real_time() && e->at > wall_ns() ? 600 : 0;
}
CUresult cuEventElapsedTime(float *ms, fake_event *a, fake_event *b) {
    if (!a->recorded || !b->recorded) return 600;
    *ms = (float)((double)(b->at - a->at) / 1e6);
    return 0;
}
/* Waiting for this process's queued work (every stream: the fake has one queue per process). */
static void wait_own_work(void) {
    if (!in_real_time()) return;
    uint64_t end = atomic_load(&own_end_ns[dev()]), now = wall_ns();
    if (end > now) {
        struct timespec ts = {(time_t)((end - now) / 1000000000ull), (long)((end - now) % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}
CUresult cuStreamSynchronize(CUstream s) { (void)s; wait_own_work(); return 0; }
CUresult cuStreamSynchronize_ptsz(CUstream s) { (void)s; wait_own_work(); return 0; }
CUresult cuCtxSynchronize(void) { wait_own_work(); return 0; }
/* Stream 99 is "being captured into a graph". */
CUresult cuStreamIsCapturing(CUstream s, int *status) { *status = (uintptr_t)s == 99; return 0; }
CUresult cuCtxGetCurrent(void **c) { *c = &ctx_tokens[dev()]; return 0; }
CUresult cuCtxSetCurrent(void *c) {
    for (int i = 0; i < device_count(); i++)
        if (c == (void *)&ctx_tokens[i]) {
            current_dev = i;
            return 0;
        }
    return 201; /* CUDA_ERROR_INVALID_CONTEXT */
}
CUresult cuCtxGetDevice(int *d) { *d = dev(); return 0; }
CUresult cuDeviceGetCount(int *n) { *n = device_count(); return 0; }
/* A context per device, as the primary context the runtime retains for it. */
CUresult cuDevicePrimaryCtxRetain(void **c, int d) {
    if (d < 0 || d >= device_count()) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *c = &ctx_tokens[d];
    return 0;
}
CUresult cuDeviceGetUuid(unsigned char uuid[16], int d) {
    if (d < 0 || d >= device_count()) return 101;
    memset(uuid, 0, 16);
    uuid[0] = 0xfa, uuid[1] = 0x4e, uuid[15] = (unsigned char)d;
    return 0;
}
CUresult cuDeviceGetUuid_v2(unsigned char uuid[16], int d) { return cuDeviceGetUuid(uuid, d); }

static const struct { const char *name; void *fn; void *ptsz; } table[] = {
    {"cuLaunchKernel", (void *)cuLaunchKernel, (void *)cuLaunchKernel_ptsz},
    {"cuLaunchKernelEx", (void *)cuLaunchKernelEx, (void *)cuLaunchKernelEx_ptsz},
    {"cuGraphLaunch", (void *)cuGraphLaunch, (void *)cuGraphLaunch_ptsz},
    {"cuMemAlloc", (void *)cuMemAlloc_v2, (void *)cuMemAlloc_v2},
    {"cuMemAllocPitch", (void *)cuMemAllocPitch_v2, (void *)cuMemAllocPitch_v2},
    {"cuMemAllocManaged", (void *)cuMemAllocManaged, (void *)cuMemAllocManaged},
    {"cuMemAllocAsync", (void *)cuMemAllocAsync, (void *)cuMemAllocAsync_ptsz},
    {"cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync, (void *)cuMemAllocFromPoolAsync_ptsz},
    {"cuMemFree", (void *)cuMemFree_v2, (void *)cuMemFree_v2},
    {"cuMemFreeAsync", (void *)cuMemFreeAsync, (void *)cuMemFreeAsync_ptsz},
    {"cuMemCreate", (void *)cuMemCreate, (void *)cuMemCreate},
    {"cuMemRelease", (void *)cuMemRelease, (void *)cuMemRelease},
    {"cuMemGetInfo", (void *)cuMemGetInfo_v2, (void *)cuMemGetInfo_v2},
    {"cuEventRecord", (void *)cuEventRecord, (void *)cuEventRecord_ptsz},
    {"cuStreamSynchronize", (void *)cuStreamSynchronize, (void *)cuStreamSynchronize_ptsz},
    {"cuCtxSynchronize", (void *)cuCtxSynchronize, (void *)cuCtxSynchronize},
    {"cuEventSynchronize", (void *)cuEventSynchronize, (void *)cuEventSynchronize},
};

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status);
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
    return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status) {
    (void)ver;
    if (strcmp(sym, "cuGetProcAddress") == 0) { *pfn = (void *)cuGetProcAddress_v2; if (status) *status = 0; return 0; }
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(sym, table[i].name) == 0) {
            *pfn = (flags & 2) ? table[i].ptsz : table[i].fn;
            if (status) *status = 0;
            return 0;
        }
    *pfn = NULL;
    if (status) *status = 1;
    return 500;
}
