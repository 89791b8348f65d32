/* gpuscope share: memory caps, the preload library's second part.
 *
 * Every device-memory allocation entry point of the driver API is interposed the same three ways as
 * the launches (by symbol, through cuGetProcAddress, through dlsym): cuMemAlloc_v2, cuMemAllocPitch_v2,
 * cuMemAllocManaged, cuMemAllocAsync and cuMemAllocFromPoolAsync (and their _ptsz variants), and
 * cuMemCreate (the virtual-memory API PyTorch's expandable segments and NCCL use), with the matching
 * frees: cuMemFree_v2, cuMemFreeAsync, cuMemRelease. Before an allocation reaches the driver its size
 * is reserved on the tenant's memory page, shared by all the tenant's processes, with one atomic add:
 * past the tenant's cap the reservation is taken back and the call returns CUDA_ERROR_OUT_OF_MEMORY,
 * the driver's own code (so PyTorch raises its usual torch.OutOfMemoryError), and is counted. A free
 * gives its size back (a table maps pointers and handles to sizes). Memory a pool keeps after a free
 * (cuMemFreeAsync with a release threshold) counts as given back: the cap bounds what the program
 * holds, not what the pool caches.
 *
 * One view of the card: inside a capped tenant cuMemGetInfo_v2 and NVML's nvmlDeviceGetMemoryInfo
 * (and _v2) report the cap as the total and the cap less the tenant's use (or the card's real free
 * memory, if less) as free. torch.cuda.mem_get_info, vLLM's gpu_memory_utilization and nvidia-smi run
 * inside the tenant therefore agree.
 *
 * A process that is not a tenant, or whose tenant has no cap, passes through untouched (its use is
 * still counted on its page). A tenant can defeat all this by not loading the library: the controller
 * compares NVML's list of processes with the ones that joined (docs/share.md, security model).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "_preload.h"

typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemHandle;
typedef void *CUstream;
typedef void *CUpool;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

#define OUT_OF_MEMORY 2 /* CUDA_ERROR_OUT_OF_MEMORY */
#define MISSING 500     /* CUDA_ERROR_NOT_FOUND */

enum {
    M_ALLOC, M_PITCH, M_MANAGED, M_ASYNC, M_ASYNC_PTSZ, M_POOL, M_POOL_PTSZ, M_FREE, M_FREE_ASYNC,
    M_FREE_ASYNC_PTSZ, M_CREATE, M_RELEASE, M_INFO, M_NVML_INFO, M_NVML_INFO_V2, M_N
};

/* Each hook: its exported name, the base name cuGetProcAddress is asked for (NULL: not a driver
 * entry point), and whether it is the per-thread-default-stream twin of the one before it. */
static const struct {
    const char *name, *base;
    int ptsz;
} names[M_N] = {
    {"cuMemAlloc_v2", "cuMemAlloc", 0},
    {"cuMemAllocPitch_v2", "cuMemAllocPitch", 0},
    {"cuMemAllocManaged", "cuMemAllocManaged", 0},
    {"cuMemAllocAsync", "cuMemAllocAsync", 0},
    {"cuMemAllocAsync_ptsz", "cuMemAllocAsync", 1},
    {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", 0},
    {"cuMemAllocFromPoolAsync_ptsz", "cuMemAllocFromPoolAsync", 1},
    {"cuMemFree_v2", "cuMemFree", 0},
    {"cuMemFreeAsync", "cuMemFreeAsync", 0},
    {"cuMemFreeAsync_ptsz", "cuMemFreeAsync", 1},
    {"cuMemCreate", "cuMemCreate", 0},
    {"cuMemRelease", "cuMemRelease", 0},
    {"cuMemGetInfo_v2", "cuMemGetInfo", 0},
    {"nvmlDeviceGetMemoryInfo", NULL, 0},
    {"nvmlDeviceGetMemoryInfo_v2", NULL, 0},
};
static _Atomic(void *) real_fn[M_N];
static void *hook_fn[M_N];

static void *nvml_library(void) {
    static void *lib;
    if (!lib) lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
    return lib;
}

static void *real(int i) {
    void *p = atomic_load_explicit(&real_fn[i], memory_order_acquire);
    if (p) return p;
    if (!real_dlsym) find_real_dlsym();
    p = real_dlsym ? real_dlsym(RTLD_NEXT, names[i].name) : NULL;
    if (!p || p == hook_fn[i]) {
        if (names[i].base) p = driver_symbol(names[i].name);
        else p = nvml_library() && real_dlsym ? real_dlsym(nvml_library(), names[i].name) : NULL;
    }
    if (p == hook_fn[i]) p = NULL;
    if (p) atomic_store_explicit(&real_fn[i], p, memory_order_release);
    return p;
}

/* Which hook serves `symbol`: an exported name as it is; a base name (cuGetProcAddress) picks the
 * _ptsz twin when the per-thread-default-stream flag is set. -1: none. */
static int hook_for(const char *symbol, uint64_t flags) {
    for (int i = 0; i < M_N; i++) {
        int exact = strcmp(symbol, names[i].name) == 0;
        if (!exact && !(names[i].base && strcmp(symbol, names[i].base) == 0)) continue;
        int ptsz = (flags & 2ull) != 0; /* CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
        if (ptsz && i + 1 < M_N && names[i + 1].ptsz && strcmp(names[i + 1].base, names[i].base) == 0) return i + 1;
        return i;
    }
    return -1;
}

void *memory_wrap(const char *symbol, uint64_t flags, void *p) {
    if (!p || !symbol || !((symbol[0] == 'c' && symbol[1] == 'u' && symbol[2] == 'M') || symbol[0] == 'n'))
        return p;
    int found = hook_for(symbol, flags);
    if (found < 0) return p;
    for (int i = 0; i < M_N; i++)
        if (p == hook_fn[i]) return p; /* one of ours already (a driver that resolves through the hooks) */
    void *expected = NULL;
    atomic_compare_exchange_strong(&real_fn[found], &expected, p);
    return hook_fn[found];
}

/* ------------------------------------------------------------------------------------------------ */
/* What the process holds: device pointers and virtual-memory handles to sizes                      */

typedef struct {
    uint64_t key, size; /* key 0: empty; size TOMB: removed */
    int device;         /* the ordinal of the device it was allocated on: its free gives back there */
} entry_t;
typedef struct {
    entry_t *slots;
    size_t cap, used; /* used: live and removed entries */
} table_t;
#define TOMB UINT64_MAX
static table_t pointers, handles;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t slot_of(const table_t *t, uint64_t key) {
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & (t->cap - 1);
}

static int grow(table_t *t) {
    size_t cap = t->cap ? t->cap * 2 : 1024;
    entry_t *slots = calloc(cap, sizeof *slots);
    if (!slots) return 0;
    table_t bigger = {slots, cap, 0};
    for (size_t i = 0; i < t->cap; i++)
        if (t->slots[i].key && t->slots[i].size != TOMB) {
            size_t j = slot_of(&bigger, t->slots[i].key);
            while (bigger.slots[j].key) j = (j + 1) & (cap - 1);
            bigger.slots[j] = t->slots[i];
            bigger.used++;
        }
    free(t->slots);
    *t = bigger;
    return 1;
}

static void remember(table_t *t, uint64_t key, uint64_t size, share_dev_t *d) {
    if (!key) return;
    pthread_mutex_lock(&table_lock);
    if ((t->used + 1) * 2 > t->cap && !grow(t)) {
        pthread_mutex_unlock(&table_lock);
        atomic_fetch_add(&d->proc->hook_errors, 1); /* its free will not give the size back */
        return;
    }
    size_t j = slot_of(t, key);
    while (t->slots[j].key && t->slots[j].key != key) j = (j + 1) & (t->cap - 1);
    if (!t->slots[j].key) t->used++;
    t->slots[j] = (entry_t){key, size, d->ordinal};
    pthread_mutex_unlock(&table_lock);
}

/* The size `key` was allocated with (0 when unknown), forgotten; `*d` the device it was allocated on
 * (the calling thread's when unknown). */
static uint64_t forget(table_t *t, uint64_t key, share_dev_t **d) {
    uint64_t size = 0;
    *d = share_here();
    pthread_mutex_lock(&table_lock);
    if (t->cap && key) {
        size_t j = slot_of(t, key);
        while (t->slots[j].key && t->slots[j].key != key) j = (j + 1) & (t->cap - 1);
        if (t->slots[j].key == key && t->slots[j].size != TOMB) {
            size = t->slots[j].size;
            *d = share_device(t->slots[j].device);
            t->slots[j].size = TOMB;
        }
    }
    pthread_mutex_unlock(&table_lock);
    return size;
}

/* ------------------------------------------------------------------------------------------------ */
/* The cap                                                                                          */

typedef CUresult (*info_fn)(size_t *, size_t *);

/* The card's real size, as the driver says (needs a current context: asked at an allocation). */
static uint64_t card_bytes(share_dev_t *d) {
    uint64_t known = d->tenant_mem ? atomic_load(&d->tenant_mem->card_bytes) : 0;
    if (known) return known;
    info_fn fn = (info_fn)real(M_INFO);
    size_t free_b = 0, total = 0;
    if (!fn || fn(&free_b, &total) != 0 || !total) return 0;
    if (d->tenant_mem) atomic_store(&d->tenant_mem->card_bytes, total);
    return total;
}

/* This process's tenant's cap in bytes (0: none). */
static uint64_t cap_bytes(share_dev_t *d) {
    if (!d->policy || !d->tenant_mem) return 0;
    uint64_t v = d->policy->tenants[__builtin_ctz(d->slot_bit)].mem_cap;
    if (!(v & MEM_CAP_FRACTION)) return v;
    return (v & 0xffffffffull) * card_bytes(d) / 1000000ull;
}

/* GPUSCOPE_SHARE_MEMORY: a cap this process holds itself to, below its tenant's (the admission
 * webhook sets it from a pod's gpuscope.io/share-memory): a fraction of the card (0.4) or a size
 * (40GiB, 512MB, bytes). It can only lower what the process may hold. Parsed once. */
static uint64_t own_cap_word;
static pthread_once_t own_cap_once = PTHREAD_ONCE_INIT;

static void parse_own_cap(void) {
    const char *text = getenv("GPUSCOPE_SHARE_MEMORY");
    if (!text || !*text) return;
    char *end = NULL;
    double value = strtod(text, &end);
    static const struct {
        const char *unit;
        double bytes;
    } units[] = {{"", 1}, {"b", 1}, {"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12},
                 {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
    for (size_t i = 0; end && end != text && i < sizeof units / sizeof units[0]; i++)
        if (strcasecmp(end, units[i].unit) == 0) {
            if (!*end && value > 0 && value <= 1) own_cap_word = MEM_CAP_FRACTION | (uint64_t)(value * 1e6 + 0.5);
            else if (value * units[i].bytes >= 1048576.0) own_cap_word = (uint64_t)(value * units[i].bytes);
            break;
        }
    if (!own_cap_word) say("gpuscope-share: GPUSCOPE_SHARE_MEMORY=%s is neither a fraction of the card nor a size of "
                           "at least 1MiB: ignored\n", text);
}

/* This process's own cap in bytes (0: none). */
static uint64_t own_cap_bytes(share_dev_t *d) {
    pthread_once(&own_cap_once, parse_own_cap);
    if (!(own_cap_word & MEM_CAP_FRACTION)) return own_cap_word;
    return (own_cap_word & 0xffffffffull) * card_bytes(d) / 1000000ull;
}

static void sub_floor(_Atomic uint64_t *word, uint64_t n) {
    uint64_t v = atomic_load(word);
    while (!atomic_compare_exchange_weak(word, &v, v > n ? v - n : 0)) {
    }
}

/* Reserve `n` bytes for an allocation about to be made: 0 when that would take the tenant past its cap. */
static int reserve(share_dev_t *d, uint64_t n) {
    tenant_mem_t *t = d->tenant_mem;
    if (t) {
        uint64_t cap = cap_bytes(d);
        uint64_t now = atomic_fetch_add(&t->used, n) + n;
        if (cap && now > cap) {
            sub_floor(&t->used, n);
            atomic_fetch_add(&t->refused, 1);
            atomic_fetch_add(&d->proc->mem_refused, 1);
            return 0;
        }
        uint64_t peak = atomic_load(&t->peak);
        while (now > peak && !atomic_compare_exchange_weak(&t->peak, &peak, now)) {
        }
    }
    uint64_t own = own_cap_bytes(d);
    if (own && atomic_fetch_add(&d->proc->mem_bytes, n) + n > own) {
        sub_floor(&d->proc->mem_bytes, n);
        if (t) {
            sub_floor(&t->used, n);
            atomic_fetch_add(&t->refused, 1);
        }
        atomic_fetch_add(&d->proc->mem_refused, 1);
        return 0;
    }
    if (!own) atomic_fetch_add(&d->proc->mem_bytes, n);
    return 1;
}

static void give_back(share_dev_t *d, uint64_t n) {
    if (!n) return;
    sub_floor(&d->proc->mem_bytes, n);
    if (d->tenant_mem) sub_floor(&d->tenant_mem->used, n);
}

void memory_carry(tenant_mem_t *tenant, proc_t *new_proc, const proc_t *old_proc) {
    uint64_t held = old_proc ? atomic_load(&old_proc->mem_bytes) : 0;
    atomic_store(&new_proc->mem_bytes, held);
    if (held) atomic_fetch_add(&tenant->used, held);
}

/* ------------------------------------------------------------------------------------------------ */
/* Hooks                                                                                            */

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*pitch_fn)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
typedef CUresult (*managed_fn)(CUdeviceptr *, size_t, unsigned);
typedef CUresult (*async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*pool_fn)(CUdeviceptr *, size_t, CUpool, CUstream);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);
typedef CUresult (*create_fn)(CUmemHandle *, size_t, const void *, unsigned long long);
typedef CUresult (*release_fn)(CUmemHandle);
typedef int (*nvml_info_fn)(void *, nvmlMemory_t *);
typedef int (*nvml_info2_fn)(void *, nvmlMemory_v2_t *);

/* Reserve, allocate through CALL, remember the pointer (or give the reservation back). */
#define ALLOCATE(I, T, SIZE, PTR, CALL)                                                                 \
    do {                                                                                                \
        T fn = (T)real(I);                                                                              \
        if (!fn) return MISSING;                                                                        \
        share_dev_t *d = share_here(); /* the device of the context it allocates in */                 \
        if (!reserve(d, SIZE)) return OUT_OF_MEMORY;                                                    \
        CUresult rc = CALL;                                                                             \
        if (rc != 0 || !(PTR)) give_back(d, SIZE);                                                      \
        else remember(&pointers, *(PTR), SIZE, d);                                                      \
        return rc;                                                                                      \
    } while (0)

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { ALLOCATE(M_ALLOC, alloc_fn, n, p, fn(p, n)); }

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned flags) {
    ALLOCATE(M_MANAGED, managed_fn, n, p, fn(p, n, flags));
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) {
    ALLOCATE(M_ASYNC, async_fn, n, p, fn(p, n, s));
}

EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) {
    ALLOCATE(M_ASYNC_PTSZ, async_fn, n, p, fn(p, n, s));
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUpool pool, CUstream s) {
    ALLOCATE(M_POOL, pool_fn, n, p, fn(p, n, pool, s));
}

EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUpool pool, CUstream s) {
    ALLOCATE(M_POOL_PTSZ, pool_fn, n, p, fn(p, n, pool, s));
}

/* The pitch (so the size) is the driver's choice: allocate first, then hold it to the cap. */
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t width, size_t height, unsigned elem) {
    pitch_fn fn = (pitch_fn)real(M_PITCH);
    if (!fn) return MISSING;
    CUresult rc = fn(p, pitch, width, height, elem);
    if (rc != 0 || !p || !pitch) return rc;
    uint64_t n = (uint64_t)*pitch * height;
    share_dev_t *d = share_here();
    if (!reserve(d, n)) {
        free_fn release = (free_fn)real(M_FREE);
        if (release) release(*p);
        return OUT_OF_MEMORY;
    }
    remember(&pointers, *p, n, d);
    return rc;
}

/* After the driver's answer to a free of ``key`` (``n`` bytes, already forgotten): freed, its bytes go
 * back to the tenant; refused, it is still held and stays counted. */
static CUresult settle_free(table_t *t, uint64_t key, uint64_t n, share_dev_t *d, CUresult rc) {
    if (rc == 0) give_back(d, n);
    else if (n) remember(t, key, n, d);
    return rc;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    free_fn fn = (free_fn)real(M_FREE);
    if (!fn) return MISSING;
    share_dev_t *d;
    uint64_t n = forget(&pointers, p, &d);
    return settle_free(&pointers, p, n, d, fn(p));
}

static CUresult free_async(int i, CUdeviceptr p, CUstream s) {
    free_async_fn fn = (free_async_fn)real(i);
    if (!fn) return MISSING;
    share_dev_t *d;
    uint64_t n = forget(&pointers, p, &d);
    return settle_free(&pointers, p, n, d, fn(p, s));
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { return free_async(M_FREE_ASYNC, p, s); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return free_async(M_FREE_ASYNC_PTSZ, p, s); }

/* cuMemCreate names its device itself (CUmemAllocationProp: type, requested handle types, then the
 * location's type and id; CU_MEM_LOCATION_TYPE_DEVICE is 1), which need not be the context's. -1:
 * the calling thread's current device. */
static int creation_device(const void *prop) {
    const int32_t *words = prop;
    return words && words[2] == 1 ? words[3] : -1;
}

EXPORT CUresult cuMemCreate(CUmemHandle *h, size_t n, const void *prop, unsigned long long flags) {
    create_fn fn = (create_fn)real(M_CREATE);
    if (!fn) return MISSING;
    share_dev_t *d = share_on(creation_device(prop));
    if (!reserve(d, n)) return OUT_OF_MEMORY;
    CUresult rc = fn(h, n, prop, flags);
    if (rc != 0 || !h) give_back(d, n);
    else remember(&handles, *h, n, d);
    return rc;
}

EXPORT CUresult cuMemRelease(CUmemHandle h) {
    release_fn fn = (release_fn)real(M_RELEASE);
    if (!fn) return MISSING;
    share_dev_t *d;
    uint64_t n = forget(&handles, h, &d);
    return settle_free(&handles, h, n, d, fn(h));
}

/* What a capped tenant (or process) is shown: total = its cap; free = what is left of it (or of the
 * card, if less). With both caps, the tighter view. */
static int clamp(share_dev_t *d, uint64_t *total, uint64_t *free_b, uint64_t *used) {
    uint64_t cap = cap_bytes(d), own = own_cap_bytes(d);
    if (!cap && !own) return 0;
    uint64_t held = cap && d->tenant_mem ? atomic_load(&d->tenant_mem->used) : 0, mine = atomic_load(&d->proc->mem_bytes);
    uint64_t left = cap ? (cap > held ? cap - held : 0) : UINT64_MAX;
    if (own) {
        uint64_t own_left = own > mine ? own - mine : 0;
        if (own_left < left) left = own_left;
        if (!cap || own < cap) cap = own, held = mine; /* shown as the card: the smaller cap */
    }
    *total = cap;
    if (*free_b > left) *free_b = left;
    if (used) *used = held < cap ? held : cap;
    return 1;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total) {
    info_fn fn = (info_fn)real(M_INFO);
    if (!fn) return MISSING;
    CUresult rc = fn(free_b, total);
    if (rc != 0 || !free_b || !total) return rc;
    share_dev_t *d = share_here();
    if (d->tenant_mem && !atomic_load(&d->tenant_mem->card_bytes)) atomic_store(&d->tenant_mem->card_bytes, *total);
    uint64_t t = *total, f = *free_b;
    if (clamp(d, &t, &f, NULL)) *total = (size_t)t, *free_b = (size_t)f;
    return rc;
}

EXPORT int nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *m) {
    nvml_info_fn fn = (nvml_info_fn)real(M_NVML_INFO);
    if (!fn) return 13; /* NVML_ERROR_FUNCTION_NOT_FOUND */
    int rc = fn(device, m);
    if (rc == 0 && m) {
        uint64_t t = m->total, f = m->free, u = m->used;
        if (clamp(share_here(), &t, &f, &u)) m->total = t, m->free = f, m->used = u;
    }
    return rc;
}

EXPORT int nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *m) {
    nvml_info2_fn fn = (nvml_info2_fn)real(M_NVML_INFO_V2);
    if (!fn) return 13;
    int rc = fn(device, m);
    if (rc == 0 && m) {
        uint64_t t = m->total, f = m->free, u = m->used;
        if (clamp(share_here(), &t, &f, &u)) m->total = t, m->free = f, m->used = u, m->reserved = 0;
    }
    return rc;
}

__attribute__((constructor)) static void init_memory(void) {
    hook_fn[M_ALLOC] = (void *)cuMemAlloc_v2;
    hook_fn[M_PITCH] = (void *)cuMemAllocPitch_v2;
    hook_fn[M_MANAGED] = (void *)cuMemAllocManaged;
    hook_fn[M_ASYNC] = (void *)cuMemAllocAsync;
    hook_fn[M_ASYNC_PTSZ] = (void *)cuMemAllocAsync_ptsz;
    hook_fn[M_POOL] = (void *)cuMemAllocFromPoolAsync;
    hook_fn[M_POOL_PTSZ] = (void *)cuMemAllocFromPoolAsync_ptsz;
    hook_fn[M_FREE] = (void *)cuMemFree_v2;
    hook_fn[M_FREE_ASYNC] = (void *)cuMemFreeAsync;
    hook_fn[M_FREE_ASYNC_PTSZ] = (void *)cuMemFreeAsync_ptsz;
    hook_fn[M_CREATE] = (void *)cuMemCreate;
    hook_fn[M_RELEASE] = (void *)cuMemRelease;
    hook_fn[M_INFO] = (void *)cuMemGetInfo_v2;
    hook_fn[M_NVML_INFO] = (void *)nvmlDeviceGetMemoryInfo;
    hook_fn[M_NVML_INFO_V2] = (void *)nvmlDeviceGetMemoryInfo_v2;
}
