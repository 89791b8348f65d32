/* gpuscope share: the preload library an unmodified CUDA process loads with LD_PRELOAD.
 *
 * It interposes the kernel-launch entry points of the driver API (cuLaunchKernel, cuLaunchKernelEx,
 * their _ptsz variants, cuGraphLaunch and its _ptsz variant) and the program's waits for the GPU
 * (cuStreamSynchronize and its _ptsz variant, cuCtxSynchronize, cuEventSynchronize) three ways,
 * because each is how some program reaches them:
 *   - by symbol, for programs linked against libcuda;
 *   - through cuGetProcAddress / cuGetProcAddress_v2, which is how the CUDA runtime (torch's
 *     libcudart) resolves every driver entry point;
 *   - through dlsym, because the runtime dlopens libcuda.so.1 and looks cuGetProcAddress up on that
 *     handle, which LD_PRELOAD alone does not interpose (ctypes, cuda-python and Triton do the same).
 * Every other symbol passes through untouched. Nothing from CUDA is linked at build time: the real
 * functions are resolved at run time with the real dlsym (found with dlvsym).
 *
 * What a launch does (layout of the shared files: ledger.py, the one other reader and writer):
 *   - one relaxed atomic load of the gate word in the controller's read-only policy mapping; when the
 *     process's tenant bit is set the launch goes ahead (plus counters and, once per window, two
 *     event records); otherwise the launching thread sleeps on that word with a futex (no spinning,
 *     no signals) until the controller sets the bit;
 *   - launches are accounted in windows: a CUDA event from a preallocated pool before the window's
 *     first launch and one after its last, resolved by a helper thread that sleeps in
 *     cuEventSynchronize on blocking-sync events, so the launching thread never waits on accounting,
 *     except that at most `inflight` windows may be queued (the bound on queued work that lets the
 *     controller switch tenants quickly); the window length adapts to about `window_us` of GPU time;
 *   - a wait for the GPU ends the open window at the last launch; a slice holder with nothing queued
 *     and no launch for QUIET_NS is quiet, and its helper rings: the controller lends the rest of its
 *     turn, and its next held launch rings to take it back (a borrower queues little meanwhile);
 *   - a tenant the controller runs beside the slice holder (its bit in `beside_mask`) launches
 *     untimed: events between its small kernels would each cost a context switch on the time-sliced
 *     GPU. In a probe (its bit in `busy_mask`, the holder paused) each launch is a window of its own,
 *     the end event right after the kernel: its busy time, from which the controller charges it.
 *     One busy for more than its share launches only in the first `duty` of every 10 ms (keep_duty).
 * Each GPU the process uses is held by its own ledger (one controller holds every GPU of a node, a
 * ledger each): every launch and allocation works on the device of the calling thread's current
 * context (dev_here), which joins that GPU's ledger at its first launch or allocation there and keeps
 * its own gate, windows, helper thread and connection (struct device).
 * Without GPUSCOPE_SHARE_TENANT the library passes everything through silently; with it but no
 * controller, or once the controller is gone, it passes through and says so once on stderr.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "_ledger.h"
#include "_preload.h"
#include "_wake_bits.h"

typedef void *CUstream;
typedef void *CUfunction;
typedef void *CUgraphExec;
typedef void *CUevent;
typedef void *CUcontext;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2ULL
#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define CU_EVENT_BLOCKING_SYNC 1u
#define CU_EVENT_DISABLE_TIMING 2u

/* ------------------------------------------------------------------------------------------------ */
/* Real symbols                                                                                     */

enum {
    H_LAUNCH, H_LAUNCH_PTSZ, H_LAUNCH_EX, H_LAUNCH_EX_PTSZ, H_GRAPH, H_GRAPH_PTSZ, H_STREAM_SYNC,
    H_STREAM_SYNC_PTSZ, H_CTX_SYNC, H_EVENT_SYNC, H_GPA, H_GPA_V2, H_N
};
static const char *const hook_names[H_N] = {
    "cuLaunchKernel",      "cuLaunchKernel_ptsz",      "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz",
    "cuGraphLaunch",       "cuGraphLaunch_ptsz",       "cuStreamSynchronize",
    "cuStreamSynchronize_ptsz", "cuCtxSynchronize",    "cuEventSynchronize", "cuGetProcAddress",
    "cuGetProcAddress_v2"};
static _Atomic(void *) real_fn[H_N];
static void *hook_fn[H_N];

dlsym_fn real_dlsym;
static void *libcuda;

void find_real_dlsym(void) {
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", NULL};
    for (int i = 0; versions[i] && !real_dlsym; i++) real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

void *driver_symbol(const char *name) {
    if (!real_dlsym) find_real_dlsym();
    if (!real_dlsym) return NULL;
    if (!libcuda) libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    return libcuda ? real_dlsym(libcuda, name) : NULL;
}

static void *real(int i) {
    void *p = atomic_load_explicit(&real_fn[i], memory_order_acquire);
    if (p) return p;
    if (!real_dlsym) find_real_dlsym();
    p = real_dlsym ? real_dlsym(RTLD_NEXT, hook_names[i]) : NULL;
    if (!p || p == hook_fn[i]) p = driver_symbol(hook_names[i]);
    if (p == hook_fn[i]) p = NULL;
    if (p) atomic_store_explicit(&real_fn[i], p, memory_order_release);
    return p;
}

/* Driver calls the accounting makes (never hooked). */
typedef CUresult (*event_create_fn)(CUevent *, unsigned int);
typedef CUresult (*event_record_fn)(CUevent, CUstream);
typedef CUresult (*event_sync_fn)(CUevent);
typedef CUresult (*event_query_fn)(CUevent);
typedef CUresult (*event_elapsed_fn)(float *, CUevent, CUevent);
typedef CUresult (*ctx_fn)(CUcontext *);
typedef CUresult (*ctx_set_fn)(CUcontext);
typedef CUresult (*capturing_fn)(CUstream, int *);
typedef CUresult (*capture_mode_fn)(int *);
static struct {
    capturing_fn capturing, capturing_ptsz;
    capture_mode_fn capture_mode;
    event_create_fn create;
    event_record_fn record, record_ptsz;
    event_sync_fn sync;
    event_query_fn query;
    event_elapsed_fn elapsed;
    ctx_fn get_ctx;
    ctx_set_fn set_ctx;
} drv;

/* ------------------------------------------------------------------------------------------------ */
/* State                                                                                            */

#define POOL 256     /* windows in the ring (two events each), created once at join */
#define K_MIN 1
#define K_MAX 1024

static int say_fd = 2;
void say(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n > 0) {
        ssize_t w = write(say_fd, buf, (size_t)(n < (int)sizeof buf ? n : (int)sizeof buf - 1));
        (void)w;
    }
}

static const uint32_t all_open = 0xffffffffu;

typedef struct {
    CUevent start, end;
    CUstream stream;
    int ptsz;
    int end_recorded; /* the end event already follows the window's last launch (busy-time windows) */
    int busy;         /* a launch timed on its own: its time also goes to busy_ns */
    int lent;         /* opened with the short queue (short_queue(): LENT_WINDOW_US) */
    uint64_t started_ns; /* busy-time windows: host clock just before the start event was recorded... */
    uint64_t submit_ns;  /* ...and from then until the launch call returned (see busy_window_ms) */
} window_t;

#define HELPER_NAP_NS 100000000ull
#define HELPER_SLEEP_NS 100000000ull /* with nothing to watch: a new window wakes it (wake_helper) */
/* How often the helper of a slice holder looks whether its process went quiet (the turn is then lent):
 * every WATCH_NAP_NS, or every WATCH_NAP_TIGHT_NS while the program launches again within QUIET_NS of
 * each of its waits for the GPU (TIGHT_SYNCS in a row: a replayed graph synced every step). Such a
 * program is not quiet after its waits, so they do not wake the helper, and the helper looks less
 * often: on the H200 a graph loop synced about 870 times a second and woke its helper at each. What it
 * costs: the first time such a program goes quiet it is seen within WATCH_NAP_TIGHT_NS instead of
 * QUIET_NS, and lends that turn that much later; its next waits wake the helper at once again. */
#define WATCH_NAP_NS 1000000ull
#define WATCH_NAP_TIGHT_NS 10000000ull
/* How often the helper of a holder alone (holding_alone(): no other tenant takes turns) posts its
 * finished windows: nobody waits for its hand-over or for a lent turn, and the controller charges the
 * posted time every 500 ms (KEEPER_RETURN_S; a tenant that starts taking turns wakes the helper
 * through the policy).
 * Watched as closely as a holder with others waiting, a launch-bound holder with a latency tenant
 * beside it woke its helper about 1,000 times a second on the CPU host (1.4% of a core), at each
 * window and at each millisecond's look for quiet; every 10 ms, 100 times (0.10-0.20%); every 25 ms,
 * 43 times (0.06-0.09%). */
#define ALONE_NAP_NS 25000000ull
#define TIGHT_SYNCS 8
/* A tight program stays tight through a late relaunch now and then: each wait followed by a launch
 * within TIGHT_GAP_NS counts one up (to TIGHT_MAX), each one followed later counts TIGHT_LATE down, so
 * a program is tight while fewer than one relaunch in five comes late. One late relaunch used to start
 * the count again: an encoder whose next forward reached its first kernel 0.1-0.5 ms after its sync
 * was tight a third of the time on an H100, and its helper woke about 1.8 times a step (306 a second,
 * 254 of them the end of a 300 us watch for quiet after a sync). What it costs: such a program's
 * host gaps of more than QUIET_NS, when they are fewer than one in five, are lent WATCH_NAP_TIGHT_NS
 * late or not at all. */
#define TIGHT_MAX 16
#define TIGHT_LATE 4
/* A relaunch this soon after a wait counts as quick. Not QUIET_NS: an H100's encoder reached its next
 * forward's first kernel 0.1-0.5 ms after its sync, so about half its relaunches came after QUIET_NS,
 * it never counted as tight, and its helper watched 300 us for quiet after nearly every sync (154
 * times a second, 0.84 a step) to find it back within a few hundred microseconds each time: 20 lends
 * in 12 s. A gap that short is not worth lending (the lend and its reclaim cost about nine wake-ups);
 * a tight holder's longer gaps are still found at its helper's next look (WATCH_NAP_TIGHT_NS). */
#define TIGHT_GAP_NS 1000000ull

/* Everything this process keeps about one GPU. Each GPU has a controller of its own (one `gpuscope
 * share` process holds them all, a ledger each), so a process that uses two GPUs joins twice, and is
 * held on each by that GPU's gate: a launch or an allocation goes to the device of the context it
 * runs in (dev_here). Each device has its own helper thread (its windows' events belong to that
 * device's context) and its own watcher (its own connection). */
struct device {
    share_dev_t s; /* policy, proc, tenant_mem, slot_bit: what _memory.c reads too */
    /* The word the fast path reads: the controller's gate, or all_open while passing through. */
    const _Atomic uint32_t *gate;
    _Atomic int joined; /* the first launch or allocation on this device joined (or tried to) */
    pthread_mutex_t join_lock;
    proc_t local_proc; /* counters when no ledger is mapped */
    atomic_int failed_open;
    pthread_mutex_t wlock;
    window_t ring[POOL];
    uint64_t head, tail; /* [head, tail) closed and unresolved; ring[tail % POOL] is the open one */
    int win_open, win_launches, acct_ready, acct_failed;
    /* Launched untimed beside the holder since the helper last drained (there are no windows to
     * wait on), and the stream of the last such launch: a closed gate drains it (drain_untimed). */
    int untimed_queued, untimed_ptsz;
    CUstream untimed_stream;
    CUevent drain_event;
    int K, K_lent;
    CUcontext acct_ctx;
    uint32_t helper_bit;
    _Atomic int helper_sleeping;
    int helper_waited_newest; /* the last wake on the newest window posted nothing */
    /* A probe's windows, posted in order: how late their start events ran (busy_window_ms). */
    struct {
        uint64_t idx, recorded_ns; /* the last probe window posted, and when its start event was recorded */
        float lag_ms;
        int valid;
    } chain;
    /* When a launching thread last waited for the oldest queued window (the bound on queued work):
     * while it keeps doing so it posts the finished windows itself, and the helper need not wake. */
    uint64_t queue_waited_ns;
    uint64_t probe_alive_checked; /* when the helper last looked for the controller in a probe */
    /* The gate generation under which this process, the slice holder, stopped launching at its
     * slice's end by itself (0: it has not): its helper then drains the queue as if the gate closed. */
    _Atomic uint32_t yielded_gen;
    /* When the program's last wait for the GPU (a stream, context or event synchronize) returned,
     * while it held the GPU (0: not since the helper looked): it is on the host now, its work done. */
    _Atomic uint64_t synced_ns;
    /* When the program's last wait for the GPU returned while it held the GPU (0 once its next launch
     * has looked), and a count of its last waits it followed with a launch within TIGHT_GAP_NS (up one
     * for each, down TIGHT_LATE for each that was not, within 0..TIGHT_MAX): note_relaunch,
     * syncs_tight. Launching threads write them; a race only miscounts. */
    _Atomic uint64_t last_sync_ns;
    _Atomic int tight_syncs;
    int conn_fd;           /* the connection to the controller: open while joined (its end tells either side) */
    _Atomic uint32_t *bell; /* the controller's doorbell, a page it handed over when this process joined */
    _Atomic uint64_t duty_started_ns; /* keep_duty */
    _Atomic int bursting; /* its burst is posted (proc burst_ns): start_burst, end_burst */
};
typedef struct device device_t;

/* Devices by the ordinal of their context's device (CUdevice); ordinals past MAX_DEVICES share the
 * last entry, which never joins (those launches pass through, counted). */
#define MAX_DEVICES 16
static device_t devs[MAX_DEVICES + 1];
#define UNMANAGED_DEV (&devs[MAX_DEVICES])

/* The device the calling thread works on: set at the top of every hook (dev_here), and once for good
 * by each device's helper and watcher thread. Everything below reads its device's state through it,
 * so the per-device code reads as the one-device code did. */
static __thread device_t *D __attribute__((tls_model("initial-exec"))) = &devs[0];

static void reset_dev(device_t *d, int ordinal) {
    pthread_mutex_t unlocked = PTHREAD_MUTEX_INITIALIZER;
    d->s.ordinal = ordinal;
    d->s.policy = NULL;
    d->s.proc = &d->local_proc;
    d->s.tenant_mem = NULL;
    d->s.slot_bit = 1;
    d->gate = (const _Atomic uint32_t *)&all_open;
    atomic_store(&d->joined, 0);
    d->join_lock = unlocked;
    atomic_store(&d->failed_open, 0);
    d->wlock = unlocked;
    d->head = d->tail = 0;
    d->win_open = d->win_launches = d->acct_ready = d->acct_failed = 0;
    d->K = 8, d->K_lent = 1;
    atomic_store(&d->helper_sleeping, 0);
    d->helper_waited_newest = 0;
    d->queue_waited_ns = 0;
    d->chain.valid = 0;
    atomic_store(&d->yielded_gen, 0);
    atomic_store(&d->synced_ns, 0);
    atomic_store(&d->last_sync_ns, 0);
    atomic_store(&d->tight_syncs, 0);
    d->conn_fd = -1;
    d->bell = NULL;
}

/* Which device a call works on: the device of the calling thread's current context. Asked of the
 * driver at every launch (cuCtxGetCurrent reads the driver's thread-local context); the device of the
 * last context each thread saw is kept, so the launch path asks cuCtxGetDevice only when a thread
 * switches contexts. (A context destroyed and another made at its address on another device would
 * be taken for the old one by a thread that used both: contexts live as long as their process here.) */
typedef CUresult (*ctx_device_fn)(int *);
typedef CUresult (*device_uuid_fn)(uint8_t *, int);
static struct {
    ctx_fn get_ctx;
    ctx_device_fn get_device;
    device_uuid_fn uuid;
} ctxcalls;
static pthread_once_t ctxcalls_once = PTHREAD_ONCE_INIT;
static _Atomic int ctxcalls_ready; /* all three looked up (a thread must not see one without the others) */

static void load_ctxcalls(void) {
    ctxcalls.get_ctx = (ctx_fn)driver_symbol("cuCtxGetCurrent");
    ctxcalls.get_device = (ctx_device_fn)driver_symbol("cuCtxGetDevice");
    ctxcalls.uuid = (device_uuid_fn)driver_symbol("cuDeviceGetUuid_v2");
    if (!ctxcalls.uuid) ctxcalls.uuid = (device_uuid_fn)driver_symbol("cuDeviceGetUuid");
    atomic_store_explicit(&ctxcalls_ready, 1, memory_order_release);
}

static __thread CUcontext last_ctx __attribute__((tls_model("initial-exec")));
static __thread device_t *last_dev __attribute__((tls_model("initial-exec")));

static device_t *dev_here(void) {
    if (__builtin_expect(!atomic_load_explicit(&ctxcalls_ready, memory_order_acquire), 0))
        pthread_once(&ctxcalls_once, load_ctxcalls);
    CUcontext c = NULL;
    if (!ctxcalls.get_ctx || ctxcalls.get_ctx(&c) != 0 || !c) return &devs[0]; /* no context: the call fails anyway */
    if (__builtin_expect(c == last_ctx, 1)) return last_dev;
    int ordinal = 0;
    if (ctxcalls.get_device && ctxcalls.get_device(&ordinal) != 0) ordinal = 0;
    device_t *d = &devs[ordinal >= 0 && ordinal < MAX_DEVICES ? ordinal : MAX_DEVICES];
    last_ctx = c, last_dev = d;
    return d;
}

/* The device's UUID for the join hello (zeros where the driver cannot say: the controller then takes
 * the process for its only GPU's, or refuses it when it holds several). */
static void device_uuid(int ordinal, uint8_t out[16]) {
    pthread_once(&ctxcalls_once, load_ctxcalls);
    if (!ctxcalls.uuid || ctxcalls.uuid(out, ordinal) != 0) memset(out, 0, 16);
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static long futex(volatile void *addr, int op, uint32_t val, const struct timespec *ts, uint32_t bits) {
    return syscall(SYS_futex, addr, op, val, ts, NULL, bits);
}

static void abs_after(struct timespec *ts, uint64_t ns) {
    uint64_t t = now_ns() + ns;
    ts->tv_sec = (time_t)(t / 1000000000ull);
    ts->tv_nsec = (long)(t % 1000000000ull);
}

/* ------------------------------------------------------------------------------------------------ */
/* Joining and leaving                                                                              */


static void fail_open(const char *why) {
    if (atomic_exchange(&D->failed_open, 1)) return;
    D->gate = (const _Atomic uint32_t *)&all_open;
    if (D->s.proc) atomic_store(&D->s.proc->failed_open, 1);
    say("gpuscope-share: %s: running unthrottled until a controller takes this process back\n", why);
    /* Wake this process's own threads held at the gate (the word no longer changes). */
    if (D->s.policy) futex((void *)&D->s.policy->gate, FUTEX_WAKE, 0x7fffffff, NULL, 0);
    /* and the watcher, asleep on the connection: it drops it and looks for a controller again */
    int fd = D->conn_fd;
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

static int policy_alive(const policy_t *p) {
    if (!p) return 0;
    if (kill(p->controller_pid, 0) != 0 && errno == ESRCH) return 0;
    uint64_t beat = atomic_load(&p->heartbeat_ns);
    uint64_t stale = (uint64_t)(p->stale_ms ? p->stale_ms : DEFAULT_STALE_MS) * 1000000ull;
    return now_ns() < beat + stale;
}

static int controller_alive(void) { return policy_alive(D->s.policy); }

/* A forked child starts over: it joins with a page of its own at its first launch (its CUDA state,
 * and so the parent's events, are not usable in it anyway). The parent's connection stays the
 * parent's: the child closes its copy. */
static void after_fork_in_child(void) {
    for (int i = 0; i <= MAX_DEVICES; i++) {
        device_t *d = &devs[i];
        if (d->conn_fd >= 0) close(d->conn_fd);
        reset_dev(d, i);
        atomic_store(&d->local_proc.mem_bytes, 0); /* the parent's allocations are not the child's */
    }
}

static void *helper_main(void *arg);
static void ring_bell(void);

/* The join protocol (joins.py): one hello, one reply carrying the pages as descriptors. */
#define HELLO_MAGIC 0x4A535347u /* "GSSJ" */
#define REPLY_MAGIC 0x41535347u /* "GSSA" */
#define REASON_LEN 120
typedef struct {
    uint32_t magic, version;
    char name[NAME_LEN];
    uint8_t uuid[16]; /* the device's UUID, as NVML gives it to the controller (zeros: unknown) */
} hello_t;
typedef struct {
    uint32_t magic, status;
    int32_t slot, pid;
    char reason[REASON_LEN];
} reply_t;
_Static_assert(sizeof(hello_t) == 64 && sizeof(reply_t) == 136, "join protocol layout");

/* The pages a joining process receives, in this order. */
enum { PAGE_POLICY, PAGE_BELL, PAGE_PROC, PAGE_TENANT, N_PAGES };

typedef struct {
    void *pages[N_PAGES]; /* as mapped (MAP_FAILED where not) */
    policy_t *policy;
    proc_t *proc;
    _Atomic uint32_t *bell;
    tenant_mem_t *tenant;
    int conn, slot;
    int retry; /* on failure: whether trying again later may help (no controller yet, or a restart) */
    char why[200];
} joined_t;

static const char *ledger_prefix(void) {
    const char *path = getenv("GPUSCOPE_SHARE_LEDGER");
    return path && *path ? path : DEFAULT_LEDGER;
}

/* A controller is trusted when it runs as root, as this process's user, or as the user named by
 * GPUSCOPE_SHARE_CONTROLLER_UID: anyone else listening at the ledger's name could hold this process
 * at a gate it never opens. The kernel tells who listens (SO_PEERCRED). */
static int trusted_controller(int fd, char *why, size_t n) {
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0) {
        snprintf(why, n, "cannot tell who listens at %s.sock", ledger_prefix());
        return 0;
    }
    const char *want = getenv("GPUSCOPE_SHARE_CONTROLLER_UID");
    if (cr.uid == 0 || cr.uid == geteuid() || (want && *want && strtoul(want, NULL, 10) == cr.uid)) return 1;
    snprintf(why, n, "%s.sock belongs to uid %u, not root, this user or GPUSCOPE_SHARE_CONTROLLER_UID",
             ledger_prefix(), (unsigned)cr.uid);
    return 0;
}

/* A page this process may map: at least a page long and sealed, so that nobody can ever shrink it
 * under this process (touching a mapped page past a file's end is a SIGBUS). */
static int sealed_page(int fd) {
    struct stat st;
    int seals = fcntl(fd, F_GET_SEALS);
    return fstat(fd, &st) == 0 && st.st_size >= 4096 && seals >= 0 &&
           (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) == (F_SEAL_SHRINK | F_SEAL_GROW);
}

static void unmap_pages(joined_t *j) {
    for (int i = 0; i < N_PAGES; i++)
        if (j->pages[i] && j->pages[i] != MAP_FAILED) munmap(j->pages[i], 4096);
}

static int join_failed(joined_t *j, int fd, int retry, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->why, sizeof j->why, fmt, ap);
    va_end(ap);
    j->retry = retry;
    if (fd >= 0) close(fd);
    return -1;
}

static int connect_controller(const char *tenant, joined_t *j) {
    memset(j, 0, sizeof *j);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    int n = snprintf(addr.sun_path, sizeof addr.sun_path, "%s.sock", ledger_prefix());
    if (n <= 0 || n >= (int)sizeof addr.sun_path) return join_failed(j, -1, 0, "the ledger path is too long");
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return join_failed(j, -1, 1, "no socket: %s", strerror(errno));
    struct timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0)
        return join_failed(j, fd, 1, "no controller at %s (%s)", addr.sun_path, strerror(errno));
    if (!trusted_controller(fd, j->why, sizeof j->why)) return join_failed(j, fd, 1, "%s", j->why);
    hello_t h = {HELLO_MAGIC, LAYOUT_VERSION, {0}, {0}};
    strncpy(h.name, tenant, NAME_LEN - 1);
    device_uuid(D->s.ordinal, h.uuid); /* the controller hands this process that GPU's pages */
    if (send(fd, &h, sizeof h, MSG_NOSIGNAL) != (ssize_t)sizeof h)
        return join_failed(j, fd, 1, "the controller did not take the hello (%s)", strerror(errno));
    reply_t r;
    int fds[N_PAGES], got = 0;
    union {
        char buf[CMSG_SPACE(sizeof fds)];
        struct cmsghdr align;
    } control;
    struct iovec iov = {&r, sizeof r};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    ssize_t len = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k; i++) {
                int one;
                memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof one);
                if (got < N_PAGES) fds[got++] = one;
                else close(one);
            }
        }
    int ok = len == (ssize_t)sizeof r && r.magic == REPLY_MAGIC && !(msg.msg_flags & MSG_CTRUNC);
    if (ok && r.status != 0) {
        r.reason[REASON_LEN - 1] = 0;
        for (int i = 0; i < got; i++) close(fds[i]);
        return join_failed(j, fd, 0, "%s", r.reason);
    }
    if (!ok || got != N_PAGES) {
        for (int i = 0; i < got; i++) close(fds[i]);
        return join_failed(j, fd, 1, "no valid answer from the controller at %s", addr.sun_path);
    }
    int sealed = 1;
    for (int i = 0; i < N_PAGES; i++) sealed = sealed && sealed_page(fds[i]);
    for (int i = 0; i < N_PAGES; i++) {
        j->pages[i] = sealed ? mmap(NULL, 4096, i == PAGE_POLICY ? PROT_READ : PROT_READ | PROT_WRITE,
                                    MAP_SHARED, fds[i], 0) : MAP_FAILED;
        close(fds[i]);
    }
    int mapped = 1;
    for (int i = 0; i < N_PAGES; i++) mapped = mapped && j->pages[i] != MAP_FAILED;
    policy_t *p = j->pages[PAGE_POLICY];
    tenant_mem_t *t = j->pages[PAGE_TENANT];
    int slot = r.slot;
    int valid = mapped && p->magic == POLICY_MAGIC && p->version == LAYOUT_VERSION && t->magic == TENANT_MAGIC &&
                slot >= 0 && slot < MAX_TENANTS && (uint32_t)slot < p->ntenants &&
                strncmp(p->tenants[slot].name, tenant, NAME_LEN) == 0;
    if (!valid) {
        unmap_pages(j);
        return join_failed(j, fd, 0, sealed ? "the controller's pages are not a version-%u ledger"
                                            : "the controller's pages are not sealed (version %u?)", LAYOUT_VERSION);
    }
    j->policy = p, j->bell = j->pages[PAGE_BELL], j->proc = j->pages[PAGE_PROC], j->tenant = t;
    j->conn = fd, j->slot = slot;
    return 0;
}

/* Make a joined controller this process's: the gate last, so that a launch that sees it sees the rest. */
static void install(joined_t *j) {
    atomic_store(&j->proc->started_ns, now_ns());
    memory_carry(j->tenant, j->proc, D->s.proc); /* what this process holds already counts on the new pages */
    D->s.tenant_mem = j->tenant;
    D->s.slot_bit = 1u << j->slot;
    D->helper_bit = helper_wake_bit(j->proc->pid); /* the pid as the controller knows it */
    D->bell = j->bell;
    D->s.proc = j->proc;
    D->s.policy = j->policy;
    D->conn_fd = j->conn;
    atomic_thread_fence(memory_order_release);
    D->gate = &D->s.policy->gate;
    atomic_store(&D->failed_open, 0);
}

#define REJOIN_NS 500000000ull /* how often a process without a controller looks for one */

/* One thread per tenant process, asleep on its connection: when the controller goes (the connection
 * ends) the process fails open at once, and every REJOIN_NS it connects again, so that a restarted
 * controller takes it back within a second. A previous controller's pages stay mapped (threads may
 * still read them); a restart leaks those three pages. */
static void *watcher_main(void *arg) {
    D = arg; /* this thread watches one device's connection */
    const char *tenant = getenv("GPUSCOPE_SHARE_TENANT");
    int refused = 0;
    for (;;) {
        int fd = D->conn_fd;
        if (fd >= 0) {
            struct pollfd pfd = {fd, POLLIN, 0};
            if (poll(&pfd, 1, -1) < 0 && errno == EINTR) continue;
            char c;
            ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT);
            if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EINTR))) continue;
            fail_open("the share controller is gone");
            D->conn_fd = -1;
            close(fd);
        }
        struct timespec ts = {0, (long)REJOIN_NS};
        nanosleep(&ts, NULL);
        joined_t j;
        if (connect_controller(tenant, &j) != 0) {
            if (!j.retry && !refused) {
                refused = 1;
                say("gpuscope-share: %s: tenant %s runs unthrottled\n", j.why, tenant);
            }
            continue;
        }
        refused = 0;
        if (!policy_alive(j.policy)) { /* a controller that has stopped beating: not taken back yet */
            unmap_pages(&j);
            close(j.conn);
            continue;
        }
        install(&j);
        say("gpuscope-share: tenant %s joined the share controller again\n", tenant);
    }
    return NULL;
}

static void start_watcher(void) {
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, watcher_main, D) == 0) pthread_setname_np(t, "gpuscope-join");
    pthread_attr_destroy(&attr);
}

static void join(void) {
    const char *tenant = getenv("GPUSCOPE_SHARE_TENANT");
    const char *dbg = getenv("GPUSCOPE_SHARE_FD");
    if (dbg) say_fd = atoi(dbg);

    D->s.proc = &D->local_proc;
    if (!tenant || !*tenant || D == UNMANAGED_DEV) return; /* not a tenant: plain pass-through, nothing to say */
    joined_t j;
    if (connect_controller(tenant, &j) != 0) {
        say("gpuscope-share: %s: tenant %s runs unthrottled%s\n", j.why, tenant,
            j.retry ? " until a controller starts" : "");
        atomic_store(&D->failed_open, 1);
        if (j.retry) start_watcher();
        return;
    }
    if (!policy_alive(j.policy)) {
        say("gpuscope-share: the controller of %s is not running: tenant %s runs unthrottled until one "
            "starts\n", ledger_prefix(), tenant);
        unmap_pages(&j);
        close(j.conn);
        atomic_store(&D->failed_open, 1);
        start_watcher();
        return;
    }
    install(&j); /* the controller rang its own bell when it admitted this process */
    start_watcher();
}

/* A device joins at the first launch or allocation made on it: one thread joins, the others wait. */
static inline void ensure_joined(void) {
    if (atomic_load_explicit(&D->joined, memory_order_acquire)) return;
    pthread_mutex_lock(&D->join_lock);
    if (!atomic_load_explicit(&D->joined, memory_order_relaxed)) {
        join();
        atomic_store_explicit(&D->joined, 1, memory_order_release);
    }
    pthread_mutex_unlock(&D->join_lock);
}

share_dev_t *share_here(void) {
    D = dev_here();
    ensure_joined();
    return &D->s;
}

share_dev_t *share_on(int ordinal) {
    if (ordinal < 0) return share_here();
    D = (device_t *)share_device(ordinal);
    ensure_joined();
    return &D->s;
}

share_dev_t *share_device(int ordinal) {
    return &devs[ordinal >= 0 && ordinal < MAX_DEVICES ? ordinal : MAX_DEVICES].s;
}

static void ring_bell(void) {
    _Atomic uint32_t *b = D->bell;
    if (!b) return;
    atomic_fetch_add(b, 1);
    futex(b, FUTEX_WAKE, 1, NULL, 0);
}

/* ------------------------------------------------------------------------------------------------ */
/* Accounting windows                                                                               */

static int load_driver_calls(void) {
    drv.create = (event_create_fn)driver_symbol("cuEventCreate");
    drv.record = (event_record_fn)driver_symbol("cuEventRecord");
    drv.record_ptsz = (event_record_fn)driver_symbol("cuEventRecord_ptsz");
    drv.sync = (event_sync_fn)driver_symbol("cuEventSynchronize");
    drv.query = (event_query_fn)driver_symbol("cuEventQuery"); /* optional: busy-time windows need it */
    drv.elapsed = (event_elapsed_fn)driver_symbol("cuEventElapsedTime_v2");
    if (!drv.elapsed) drv.elapsed = (event_elapsed_fn)driver_symbol("cuEventElapsedTime");
    drv.get_ctx = (ctx_fn)driver_symbol("cuCtxGetCurrent");
    drv.set_ctx = (ctx_set_fn)driver_symbol("cuCtxSetCurrent");
    drv.capturing = (capturing_fn)driver_symbol("cuStreamIsCapturing");
    drv.capturing_ptsz = (capturing_fn)driver_symbol("cuStreamIsCapturing_ptsz");
    drv.capture_mode = (capture_mode_fn)driver_symbol("cuThreadExchangeStreamCaptureMode");
    return drv.create && drv.record && drv.sync && drv.elapsed && drv.get_ctx && drv.set_ctx;
}

/* Called under wlock at the first admitted launch of a joined process. */
static void start_accounting(void) {
    D->acct_ready = 1;
    if (!load_driver_calls() || drv.get_ctx(&D->acct_ctx) != 0 || !D->acct_ctx) goto fail;
    for (int i = 0; i < POOL; i++)
        if (drv.create(&D->ring[i].start, CU_EVENT_BLOCKING_SYNC) != 0 ||
            drv.create(&D->ring[i].end, CU_EVENT_BLOCKING_SYNC) != 0)
            goto fail;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, helper_main, D) != 0) goto fail;
    pthread_setname_np(t, "gpuscope-share"); /* so its CPU time can be read per thread */
    return;
fail:
    D->acct_failed = 1;
    atomic_fetch_add(&D->s.proc->hook_errors, 1);
    say("gpuscope-share: no CUDA events for accounting: launches are counted, not timed\n");
}

/* Whether this process's tenant runs beside the slice holder (a higher-priority tenant within its
 * share). The GPU then time-slices it with the holder, and an event recorded between its small
 * kernels costs a context switch of its own (docs/share.md, "Priorities"). So its launches go untimed, and the controller charges it the busy fraction measured
 * in short probes, when the holder is paused and it runs alone (busy_accounting). */
static inline int beside(void) {
    return D->s.policy && (atomic_load_explicit(&D->s.policy->beside_mask, memory_order_relaxed) & D->s.slot_bit);
}

/* A probe: each launch is a window of its own, events right around the kernel: its busy time. */
static inline int busy_accounting(void) {
    return D->s.policy && drv.query && (atomic_load_explicit(&D->s.policy->busy_mask, memory_order_relaxed) & D->s.slot_bit) &&
           !atomic_load_explicit(&D->failed_open, memory_order_relaxed);
}

/* Whether this process holds the GPU under gate word `g` while no other tenant takes turns (any
 * others run beside it): nobody waits for its hand-over or for a turn it could lend, so its helper
 * posts its windows every ALONE_NAP_NS instead of watching each one and looking for quiet. The
 * controller marks the tenants taking turns, and wakes the helpers when that changes. Needs
 * cuEventQuery, to post finished windows without waiting on them. */
static inline int holding_alone(uint32_t g) {
    const policy_t *p = D->s.policy;
    return p && drv.query && (g & 0xffffu) != 0xffffu && (g & D->s.slot_bit) && !beside() && !busy_accounting() &&
           !(atomic_load_explicit(&p->turns_mask, memory_order_relaxed) & ~D->s.slot_bit) &&
           !atomic_load_explicit(&D->failed_open, memory_order_relaxed);
}

/* A turn another tenant lent (it was idle) is taken back at that tenant's next launch, after this
 * process's queued work; a tenant beside the holder waits behind the holder's queued work at each of
 * its bursts (the GPU runs queued work first, or switches contexts only at a time slice's end). So in
 * a lent turn a process queues at most LENT_INFLIGHT windows of about LENT_WINDOW_US of GPU time each
 * (two keep the GPU fed while the launching thread waits for the older one). While a tenant of
 * higher priority runs beside it, windows of that length up to the policy's beside_queue_us
 * (--share.beside-queue, 500 us by default; 0 keeps the usual queue): short_queue(). On the fake driver's
 * shared GPU, which runs every process's kernels one after another, a training step beside a
 * GPU-bound holder ran at 0.63 of its alone rate with the usual two 2 ms windows and 0.85 with a
 * 500 us queue; on the H200, which time-slices the two contexts, the holder's short queue left the GPU
 * idle between its helper's wake-ups (an encoder holding the GPU for 20 s beside two launch-bound
 * tenants got 0.37 of its alone rate with it, 0.57 without; the tenants beside it 0.58 and 0.65
 * against 0.56 and 0.59: docs/share.md, "Work-conserving turns"). */
#define LENT_INFLIGHT 2
#define LENT_WINDOW_US 250
/* Whether a tenant of higher priority than this process's runs beside it: a latency tenant, whose
 * every request waits behind the holder's queue. A tenant of equal or lower priority beside it is
 * there because it leaves the GPU idle (a launch-bound loop, host gaps): for it the holder keeps its
 * usual queue, since on the H200 a short one idled the holder more than it sped the tenant. */
static int urgent_beside(const policy_t *p) {
    uint32_t others = atomic_load_explicit(&p->beside_mask, memory_order_relaxed) & ~D->s.slot_bit &
                      ((1u << MAX_TENANTS) - 1);
    if (!others || !D->s.slot_bit) return 0;
    uint32_t mine = p->tenants[__builtin_ctz(D->s.slot_bit) % MAX_TENANTS].priority;
    for (int i = 0; others; i++, others >>= 1)
        if ((others & 1u) && p->tenants[i].priority > mine) return 1;
    return 0;
}

/* This tenant's duty in parts per million (keep_duty). */
static inline uint32_t duty_ppm(void) {
    if (!D->s.policy || !D->s.slot_bit) return 0;
    return atomic_load_explicit(&D->s.policy->tenants[__builtin_ctz(D->s.slot_bit) % MAX_TENANTS].duty_ppm,
                                memory_order_relaxed);
}

/* Whether a duty holds this process back (0 and a million parts: launch all the time). */
static inline int under_duty(void) {
    uint32_t ppm = duty_ppm();
    return ppm != 0 && ppm < 1000000u;
}

/* The depth of the short queue in windows, 0 where the usual queue applies. In a lent turn, and
 * under a duty (keep_duty), LENT_INFLIGHT. While a tenant of higher priority runs beside it, the
 * policy's beside_queue_us (--share.beside-queue; 0: the usual queue) in LENT_WINDOW_US windows, at
 * least LENT_INFLIGHT; as long as the usual queue or longer, the usual queue. */
static uint32_t short_queue(void) {
    const policy_t *p = D->s.policy;
    if (!p || beside()) return 0;
    uint32_t others = ~D->s.slot_bit;
    if (atomic_load_explicit(&p->lender_mask, memory_order_relaxed) & others) return LENT_INFLIGHT;
    /* a lone holder under a duty: what it has queued runs on past its part of the period */
    if (under_duty()) return LENT_INFLIGHT;
    uint32_t us = p->beside_queue_us;
    if (!us || !urgent_beside(p)) return 0; /* the usual queue */
    uint32_t usual = (p->inflight_slice ? p->inflight_slice : DEFAULT_QUEUED_WINDOWS) *
                     (p->window_us ? p->window_us : DEFAULT_WINDOW_US);
    if (us >= usual) return 0;
    uint32_t n = (us + LENT_WINDOW_US - 1) / LENT_WINDOW_US;
    return n < LENT_INFLIGHT ? LENT_INFLIGHT : n > POOL - 1 ? POOL - 1 : n;
}

/* Whether this process runs in a turn another tenant lent. Its helper is not woken for the windows it
 * closes there: the launching thread posts them at the short queue's bound, and the lender's reclaim
 * (a gate change) wakes the helper to drain the rest. Woken at a lent turn's first window, a GPU-bound
 * borrower's helper found nothing to do and napped: a wake-up of about 3.6 a lend on the CPU host. */
static inline int borrowing(void) {
    const policy_t *p = D->s.policy;
    return p && (atomic_load_explicit(&p->lender_mask, memory_order_relaxed) & ~D->s.slot_bit) != 0;
}

static inline uint32_t inflight_limit(void) {
    uint32_t g = atomic_load_explicit(D->gate, memory_order_relaxed);
    int binding = D->s.policy && !atomic_load_explicit(&D->failed_open, memory_order_relaxed) && (g & 0xffffu) != 0xffffu;
    /* only a slice holder is drained at a hand-over, so only its queue is kept short; a tenant beside
     * it has a window per launch, and the ring is what bounds those */
    if (busy_accounting()) return POOL - 1;
    uint32_t lim = binding ? D->s.policy->inflight_slice : (D->s.policy ? D->s.policy->inflight_open : DEFAULT_INFLIGHT_OPEN);
    /* in a lent turn or with a tenant beside: that tenant waits behind this queue (short_queue()) */
    uint32_t short_lim = binding ? short_queue() : 0;
    if (short_lim) lim = short_lim;
    return lim < 1 ? 1 : (lim > POOL - 1 ? POOL - 1 : lim);
}

/* How the helper sleeps (helper_sleeping), and how much a caller needs it awake. A helper that naps
 * looks again within HELPER_NAP_NS anyway: a window closed at a window boundary, or after a program's
 * sync, need not wake it (a GPU-bound loop that syncs every iteration woke it at each), only a helper
 * in its long sleep. A closed gate or a yield needs the queue drained now. */
enum { AWAKE, NAPPING, ASLEEP };
enum { WAKE_NONE, WAKE_IF_ASLEEP, WAKE_NOW };

static void wake_helper(int need) {
    int sleeping = atomic_load_explicit(&D->helper_sleeping, memory_order_relaxed);
    if (!D->s.policy || need == WAKE_NONE || sleeping == AWAKE || (need == WAKE_IF_ASLEEP && sleeping != ASLEEP)) return;
    futex((void *)&D->s.policy->gate, FUTEX_WAKE_BITSET, 1, NULL, D->helper_bit);
}

/* At the first launch call after a wait for the GPU: whether it came within QUIET_NS of it. */
static inline void note_relaunch(uint64_t at) {
    uint64_t synced = atomic_load_explicit(&D->last_sync_ns, memory_order_relaxed);
    if (!synced) return;
    atomic_store_explicit(&D->last_sync_ns, 0, memory_order_relaxed);
    int tight = atomic_load_explicit(&D->tight_syncs, memory_order_relaxed);
    if (at - synced >= TIGHT_GAP_NS) tight = tight > TIGHT_LATE ? tight - TIGHT_LATE : 0; /* it went to the host */
    else if (tight < TIGHT_MAX) tight++;
    atomic_store_explicit(&D->tight_syncs, tight, memory_order_relaxed);
}

/* Whether the program's waits for the GPU are followed by a launch at once (TIGHT_SYNCS in a row to
 * begin with, then all but fewer than one in five: note_relaunch). */
static inline int syncs_tight(void) {
    return atomic_load_explicit(&D->tight_syncs, memory_order_relaxed) >= TIGHT_SYNCS;
}

static inline uint64_t watch_nap(void) { return syncs_tight() ? WATCH_NAP_TIGHT_NS : WATCH_NAP_NS; }

/* Whether work on `stream` is being captured into a graph: no events go there (an event recorded in
 * a capture is a graph node, and waiting on it would invalidate the capture); the graph's launches
 * are accounted when it is replayed. */
static int capturing(CUstream stream, int ptsz) {
    capturing_fn fn = (ptsz && drv.capturing_ptsz) ? drv.capturing_ptsz : drv.capturing;
    int status = 0;
    return fn && fn(stream, &status) == 0 && status != 0;
}

static inline CUresult record(CUevent e, const window_t *w) {
    event_record_fn rec = (w->ptsz && drv.record_ptsz) ? drv.record_ptsz : drv.record;
    return rec(e, w->stream);
}

/* A probe's window is one launch: its start event, the kernel, its end event. The start event runs
 * as soon as the GPU reaches it, the kernel only once the launch call that follows has gone through;
 * for a launch-bound program (a decode loop of small kernels) that gap is as long as the kernel, and
 * it is the GPU idling, not this process's work (another tenant's work runs in it). So what comes
 * off a window is the part of its record and launch calls (host clock, `submit_ns`) that came after
 * its start event ran. When the start event ran is known relative to when it was recorded: `lag`,
 * how much later than the least late start event of the probe so far (from the events' GPU times and
 * the host's recording times, chained window to window). A start event queued behind the previous
 * kernel lags by what that kernel had left, and only the launch call's time beyond that comes off;
 * a GPU-bound program's windows lag by more than their launch calls take, and nothing comes off.
 * The host sees a call return after the GPU has it, so the estimate errs towards charging more. */

static float busy_window_ms(uint64_t idx, float ms) {
    const window_t *w = &D->ring[idx % POOL], *prev = &D->ring[(idx - 1) % POOL];
    float between = 0;
    if (idx == 0 || !D->chain.valid || D->chain.idx != idx - 1 || !prev->busy ||
        drv.elapsed(&between, prev->start, w->start) != 0) {
        /* the first window of a probe: taken as on time (a preempted launch call is then still
         * taken off; a start event queued behind work launched before the probe loses at most the
         * one kernel) */
        between = 0, D->chain.lag_ms = 0, D->chain.recorded_ns = w->started_ns;
    }
    float lag = D->chain.lag_ms + between - (float)(int64_t)(w->started_ns - D->chain.recorded_ns) / 1e6f;
    if (lag < 0) lag = 0; /* the least late start so far: the new reference */
    D->chain.idx = idx, D->chain.recorded_ns = w->started_ns, D->chain.lag_ms = lag, D->chain.valid = 1;
    float idle = (float)w->submit_ns / 1e6f - lag;
    if (idle <= 0) return ms;
    return idle < ms ? ms - idle : 0;
}

/* A finished window's GPU time onto the process's counters (ring[idx]; the window before it, whose
 * end event a busy-time window is compared with, is not reused yet: at most POOL - 1 windows are
 * queued, so the open one is never in its slot). */
static float post_window(uint64_t idx) {
    const window_t *w = &D->ring[idx % POOL];
    float ms = 0;
    CUresult rc = drv.elapsed(&ms, w->start, w->end);
    if (rc == 0 && ms > 0) {
        if (w->busy) ms = busy_window_ms(idx, ms);
        atomic_fetch_add(&D->s.proc->gpu_ns, (uint64_t)(ms * 1e6));
        if (w->busy) atomic_fetch_add(&D->s.proc->busy_ns, (uint64_t)(ms * 1e6));
    }
    else if (rc != 0) atomic_fetch_add(&D->s.proc->hook_errors, 1);
    atomic_fetch_add(&D->s.proc->windows, 1);
    return ms;
}

/* Under wlock: close the open window with an end event on its stream (not while it is captured:
 * the window then stays open until the capture ends). A busy-time window's end event already
 * follows its last launch: recording it again now would add the idle time since. `wake`: how much
 * the helper is needed to watch it (WAKE_NONE when the closing thread is about to wait on the queue
 * itself). */
static int close_window_and(int wake) {
    window_t *w = &D->ring[D->tail % POOL];
    if (capturing(w->stream, w->ptsz)) return 0;
    if (!w->end_recorded && record(w->end, w) != 0) atomic_fetch_add(&D->s.proc->hook_errors, 1);
    D->win_open = 0;
    atomic_store_explicit(&D->s.proc->window_open, 0, memory_order_relaxed);
    D->tail++;
    atomic_store_explicit(&D->s.proc->inflight, D->tail - D->head, memory_order_relaxed);
    wake_helper(wake);
    return 1;
}

/* Under wlock, before a launch on `stream`: make sure a window is open there. May release the lock
 * while the oldest queued window finishes (the bound on queued work). */
/* Under wlock: post the oldest windows that have finished, without waiting (at most `max`). */
static void adapt(uint64_t idx, float ms);

static void resolve_finished(int max) {
    while (D->head < D->tail && max-- > 0 && drv.query && drv.query(D->ring[D->head % POOL].end) == 0) {
        float ms = post_window(D->head);
        if (!D->ring[D->head % POOL].busy) adapt(D->head, ms);
        D->head++;
    }
    atomic_store_explicit(&D->s.proc->inflight, D->tail - D->head, memory_order_relaxed);
}

static void open_window(CUstream stream, int ptsz, int busy) {
    if (capturing(stream, ptsz)) return;
    if (D->win_open) {
        window_t *w = &D->ring[D->tail % POOL];
        if (w->stream == stream && w->ptsz == ptsz && D->win_launches < (busy ? 1 : short_queue() ? D->K_lent : D->K)) return;
        if (!close_window_and(D->tail + 1 - D->head < inflight_limit() && !borrowing() ? WAKE_IF_ASLEEP : WAKE_NONE))
            return;
    }
    if (busy) resolve_finished(4); /* a window per launch: keep the ring short as it goes */
    while (D->tail - D->head >= inflight_limit()) {
        CUevent oldest = D->ring[D->head % POOL].end;
        D->queue_waited_ns = now_ns();
        pthread_mutex_unlock(&D->wlock);
        drv.sync(oldest); /* a blocking-sync event: the thread sleeps, it does not spin */
        pthread_mutex_lock(&D->wlock);
        /* awake anyway: post every finished window, so that the helper need not wake for them */
        resolve_finished(POOL);
        if (D->win_open) return; /* another thread opened one meanwhile */
        if (D->tail - D->head >= inflight_limit()) {
            /* no cuEventQuery to ask: the oldest has finished, since it was waited for */
            adapt(D->head, post_window(D->head));
            D->head++;
        }
    }
    window_t *w = &D->ring[D->tail % POOL];
    w->stream = stream;
    w->ptsz = ptsz;
    w->end_recorded = 0;
    w->busy = busy;
    w->lent = short_queue() != 0;
    /* before the record call, not after: a thread preempted in it then shows its start event late,
     * which the least-late reference of busy_window_ms is immune to, rather than early */
    w->started_ns = busy ? now_ns() : 0;
    w->submit_ns = 0;
    if (record(w->start, w) != 0) {
        atomic_fetch_add(&D->s.proc->hook_errors, 1);
        return;
    }
    D->win_open = 1;
    atomic_store_explicit(&D->s.proc->window_open, 1, memory_order_relaxed);
    D->win_launches = 0;
}

/* Launches per window, towards the window's target of GPU time: one count for windows in a lent
 * turn (LENT_WINDOW_US), one for the others (window_us). */
static void adapt(uint64_t idx, float ms) {
    int lent = D->ring[idx % POOL].lent;
    int *k = lent ? &D->K_lent : &D->K;
    float target = (lent ? LENT_WINDOW_US : D->s.policy && D->s.policy->window_us ? D->s.policy->window_us : DEFAULT_WINDOW_US) / 1000.0f;
    if (ms > 2 * target && *k > K_MIN) *k /= 2;
    else if (ms < target / 2 && *k < K_MAX) *k *= 2;
}

/* Under wlock: an event recorded after the last untimed launch, on its stream, to wait on (NULL:
 * nothing to wait on). Not while that stream is captured into a graph (the record would become a
 * node of it), nor where the driver cannot say (the legacy stream while another stream is captured:
 * touching it would break that capture); not the whole context either: synchronizing a context with
 * a capture under way invalidates the capture. Not after DRAIN_RECENT_NS without a launch: that work
 * has run, and the stream may be gone. A program that launches on several streams beside the holder
 * is drained on its last one. */
#define DRAIN_RECENT_NS 1000000000ull
static CUevent drain_untimed(void) {
    uint64_t last = atomic_load_explicit(&D->s.proc->last_launch_ns, memory_order_relaxed);
    if (now_ns() - last > DRAIN_RECENT_NS) return NULL;
    capturing_fn query = (D->untimed_ptsz && drv.capturing_ptsz) ? drv.capturing_ptsz : drv.capturing;
    int status = 0;
    if (!query || query(D->untimed_stream, &status) != 0 || status != 0) return NULL;
    if (!D->drain_event && drv.create(&D->drain_event, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING) != 0) {
        D->drain_event = NULL;
        atomic_fetch_add(&D->s.proc->hook_errors, 1);
        return NULL;
    }
    event_record_fn rec = (D->untimed_ptsz && drv.record_ptsz) ? drv.record_ptsz : drv.record;
    if (rec(D->drain_event, D->untimed_stream) != 0) {
        atomic_fetch_add(&D->s.proc->hook_errors, 1);
        return NULL;
    }
    return D->drain_event;
}

/* Tell the controller that this process has nothing queued under gate generation `gen`. */
static void post_drained(proc_t *p, uint32_t gen) {
    atomic_store(&p->drained_gen, gen);
    futex((void *)&p->drained_gen, FUTEX_WAKE, 0x7fffffff, NULL, 0);
}

/* A wake-up of the helper, by what it slept on (a proc_t helper_wakes_* counter), and its CPU so far:
 * what it costs the program, per process, where /proc shows only the thread's total. */
static void helper_woke(_Atomic uint64_t *reason) {
    atomic_fetch_add_explicit(reason, 1, memory_order_relaxed);
    struct timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0)
        atomic_store_explicit(&D->s.proc->helper_cpu_ns, (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec,
                              memory_order_relaxed);
}

/* A sleep of the helper on the gate word, counted as `woken` or, where it ran its time, `timed_out`. */
static void helper_slept_on_gate(long rc, _Atomic uint64_t *woken, _Atomic uint64_t *timed_out) {
    helper_woke(rc == -1 && errno == ETIMEDOUT ? timed_out : woken);
}

/* The window lock from the helper: a launching thread takes it at every launch, and each time the
 * helper finds it held it sleeps on it, a wake-up like any other. */
static void helper_lock(void) {
    if (pthread_mutex_trylock(&D->wlock) == 0) return;
    pthread_mutex_lock(&D->wlock);
    helper_woke(&D->s.proc->helper_wakes_lock);
}

static void *helper_main(void *arg) {
    D = arg; /* one helper per device: its events belong to that device's context */
    drv.set_ctx(D->acct_ctx);
    if (drv.capture_mode) {
        /* relaxed: this thread's event waits must not break another thread's graph capture */
        int mode = 2; /* CU_STREAM_CAPTURE_MODE_RELAXED */
        drv.capture_mode(&mode);
    }
    uint32_t last_seen_closed = 0;
    int went_quiet = 0;
    uint64_t resolved_at = 0; /* when a quiet holder's last window finished (0: not watching) */
    for (;;) {
        if (!busy_accounting()) helper_lock();
        else if (pthread_mutex_trylock(&D->wlock) != 0) {
            /* in a probe the launching thread takes the lock at every launch, thousands a second:
             * blocking on it would wake this thread (and cost the launcher a futex call) each time */
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
            helper_woke(&D->s.proc->helper_wakes_probe);
            continue;
        }
        if (busy_accounting()) {
            /* windows of one launch each, thousands a second: post the finished ones in batches every
             * 2 ms rather than sleeping on each (the launching thread posts a few at each launch too);
             * at once again only while the ring is more than half full. Not asleep on the gate
             * meanwhile, where every window closed would wake it: a probe lasts tens of
             * milliseconds, and this loop posts what is left within 2 ms of its end. */
            resolve_finished(64);
            int crowded = D->tail - D->head > POOL / 2;
            pthread_mutex_unlock(&D->wlock);
            if (!crowded) {
                struct timespec ts = {0, 2000000};
                nanosleep(&ts, NULL);
                helper_woke(&D->s.proc->helper_wakes_probe);
            }
            uint64_t t = now_ns();
            if (t > D->probe_alive_checked + 100000000ull) { /* a probe the controller never ended */
                D->probe_alive_checked = t;
                if (!controller_alive()) fail_open("the share controller is gone");
            }
            continue;
        }
        uint32_t g = atomic_load(D->gate);
        int yielded = atomic_load(&D->yielded_gen) == (g >> 16);
        int allowed = (g & D->s.slot_bit) != 0 && !yielded; /* a holder that yielded drains as if held */
        int open_gate = (g & 0xffffu) == 0xffffu;
        int alone = !yielded && holding_alone(g);
        if (D->head < D->tail && (open_gate || alone)) resolve_finished(POOL);
        int synced = atomic_load_explicit(&D->synced_ns, memory_order_relaxed) != 0;
        /* a holder that syncs and relaunches at once posts its windows at each wait (after_sync) */
        int tight = allowed && syncs_tight();
        if (D->head < D->tail && allowed && (alone || tight || (!synced && (open_gate || now_ns() - D->queue_waited_ns < HELPER_NAP_NS)))) {
            /* A launching thread keeps waiting for the oldest window and posts what finished each
             * time: nap instead of waking with it for every window. With the gate open (no share
             * binds) nothing waits on the posted time but the counters, so post what finished and nap
             * too: sleeping on each window woke a launch-bound loop's helper at every window, and a
             * launching thread at the queue bound
             * posts anyway. A gate change wakes the helper (a drain needs the queue posted at once,
             * and the controller's gate writes wake every waiter); else it looks after the nap. */
            atomic_store(&D->helper_sleeping, NAPPING);
            pthread_mutex_unlock(&D->wlock);
            struct timespec ts;
            /* a tight holder's nap is its watch for quiet too (watch_nap) */
            abs_after(&ts, alone ? ALONE_NAP_NS : tight ? WATCH_NAP_TIGHT_NS : HELPER_NAP_NS);
            long rc = futex((void *)&D->s.policy->gate, FUTEX_WAIT_BITSET, g, &ts, D->helper_bit);
            atomic_store(&D->helper_sleeping, AWAKE);
            helper_slept_on_gate(rc, &D->s.proc->helper_wakes_nap, &D->s.proc->helper_wakes_nap_timeout);
            continue;
        }
        if (D->head < D->tail) {
            /* Sleep on the newest closed window: windows on one stream finish in order, so one
             * wake-up posts every queued window (half the wake-ups of a GPU-bound process at two
             * windows queued). Without cuEventQuery, or when an older window on another stream is
             * still running, wait on the oldest instead. */
            int newest = drv.query != NULL && !D->helper_waited_newest;
            window_t w = D->ring[(newest ? D->tail - 1 : D->head) % POOL];
            uint64_t h = D->head;
            pthread_mutex_unlock(&D->wlock);
            drv.sync(w.end);
            helper_woke(&D->s.proc->helper_wakes_window);
            helper_lock();
            if (newest) {
                resolve_finished(POOL);
                D->helper_waited_newest = D->head == h; /* nothing posted: the oldest is on another stream */
            } else {
                D->helper_waited_newest = 0;
                if (D->head == h) { /* not resolved by a launching thread meanwhile */
                    adapt(h, post_window(h));
                    D->head++;
                }
            }
            atomic_store_explicit(&D->s.proc->inflight, D->tail - D->head, memory_order_relaxed);
            pthread_mutex_unlock(&D->wlock);
            continue;
        }
        /* a slice holder, not a tenant running beside it: its going quiet ends the slice (a holder
         * alone has nobody to hand the rest of it to) */
        int binding = (g & 0xffffu) != 0xffffu && !beside() && !busy_accounting();
        uint64_t idle = now_ns() - atomic_load_explicit(&D->s.proc->last_launch_ns, memory_order_relaxed);
        if (D->win_open && (!allowed || idle > (binding ? 1000000ull : 20000000ull)) && close_window_and(WAKE_NONE)) {
            /* The gate closed (or the process went quiet) with a window open: end it here so the
             * slice's GPU time is posted and the controller can hand the GPU on. */
            went_quiet = allowed && binding && !alone;
            pthread_mutex_unlock(&D->wlock);
            continue;
        }
        if (went_quiet) {
            /* its windows are resolved: the GPU has finished the holder's work */
            went_quiet = 0;
            resolved_at = now_ns();
        }
        uint64_t synced_at = atomic_exchange(&D->synced_ns, 0);
        if (synced_at && !D->win_open && allowed && binding && !alone && synced_at > resolved_at) {
            /* the program waited for its work and went back to the host (a training step's host
             * work, a data loader): quiet from then on, unless it launches within QUIET_NS */
            resolved_at = synced_at;
        }
        if (resolved_at) {
            /* A program that syncs launches again within microseconds of the sync returning (a
             * training step, a matmul loop): only a holder that has not launched for QUIET_NS after
             * its work finished has nothing to do, and only then is the controller woken. */
            uint64_t last = atomic_load_explicit(&D->s.proc->last_launch_ns, memory_order_relaxed);
            if (D->win_open || last >= resolved_at || !allowed || !binding || alone) resolved_at = 0;
            else if (now_ns() - resolved_at >= QUIET_NS) {
                ring_bell();
                resolved_at = 0;
            }
        }
        if (!allowed && (g >> 16) != last_seen_closed) {
            if (D->untimed_queued) {
                /* Its launches beside the holder had no windows: wait for the last one's stream, so
                 * that a drain for another tenant's probe ends when this process's kernels have (they
                 * would run through the probe and be timed as the probed tenant's). Its launching
                 * threads wait at the closed gate meanwhile. */
                D->untimed_queued = 0;
                CUevent e = drain_untimed();
                pthread_mutex_unlock(&D->wlock);
                if (e) {
                    if (drv.sync(e) != 0) atomic_fetch_add(&D->s.proc->hook_errors, 1);
                    helper_woke(&D->s.proc->helper_wakes_drain);
                }
                continue; /* the gate may have changed while it waited: look again */
            }
            last_seen_closed = g >> 16;
            post_drained(D->s.proc, g >> 16);
            if (yielded) ring_bell(); /* the controller hands over now, without a drain of its own */
        }
        /* while the gate binds and a window is open, look again soon: a quiet holder is handed on; so
         * too while a holder whose waits do not wake this thread (syncs_tight) waits for the GPU */
        int watching = resolved_at || alone || (binding && (D->win_open || (allowed && syncs_tight())));
        uint64_t nap = resolved_at ? QUIET_NS : alone ? ALONE_NAP_NS : watching ? watch_nap() : HELPER_SLEEP_NS;
        /* with the gate open a new window need not wake it either (see above) */
        atomic_store(&D->helper_sleeping, !watching && !open_gate ? ASLEEP : NAPPING);
        pthread_mutex_unlock(&D->wlock);
        if (atomic_load(&D->failed_open)) {
            struct timespec ts = {0, 100000000};
            nanosleep(&ts, NULL);
        } else {
            struct timespec ts;
            abs_after(&ts, nap);
            long rc = futex((void *)&D->s.policy->gate, FUTEX_WAIT_BITSET, g, &ts, D->helper_bit);
            if (watching) helper_slept_on_gate(rc, &D->s.proc->helper_wakes_watch, &D->s.proc->helper_wakes_watch_timeout);
            else helper_slept_on_gate(rc, &D->s.proc->helper_wakes_gate, &D->s.proc->helper_wakes_gate_timeout);
            if (!controller_alive()) fail_open("the share controller is gone");
        }
        atomic_store(&D->helper_sleeping, AWAKE);
    }
    return NULL;
}

/* ------------------------------------------------------------------------------------------------ */
/* The gate                                                                                         */

/* Whether a thread that starts waiting must wake the controller: it reads `waiting` at each decision,
 * and while a slice holder runs its next decision comes at the slice's end anyway. So only when no
 * tenant holds the gate, when this tenant lent its turn to the holder, or when this tenant's priority
 * is higher than every holder's (it may preempt). */
static int waiter_rings(uint32_t g) {
    uint32_t holders = g & 0xffffu & ~atomic_load_explicit(&D->s.policy->beside_mask, memory_order_relaxed);
    /* the holder waiting out a priority burst: the keeper reopens its gate at the burst's end */
    if (atomic_load_explicit(&D->s.policy->hold_mask, memory_order_relaxed) & D->s.slot_bit) return 0;
    if (!holders) return 1;
    /* this tenant lent the rest of its turn while it had nothing queued: it takes it back now */
    if (atomic_load_explicit(&D->s.policy->lender_mask, memory_order_relaxed) & D->s.slot_bit) return 1;
    int slot = __builtin_ctz(D->s.slot_bit);
    for (uint32_t i = 0; i < D->s.policy->ntenants && i < MAX_TENANTS; i++)
        if ((holders & (1u << i)) && D->s.policy->tenants[i].priority >= D->s.policy->tenants[slot].priority) return 0;
    return 1;
}

static void wait_turn(void) {
    uint64_t t0 = now_ns();
    proc_t *me = D->s.proc; /* the page counted on: a controller restart meanwhile swaps `proc` */
    /* only the process's first waiter, and only when the controller would not look soon anyway */
    if (atomic_fetch_add(&me->waiting, 1) == 0 && waiter_rings(atomic_load(D->gate))) ring_bell();
    atomic_fetch_add(&me->waits, 1);
    for (;;) {
        uint32_t g = atomic_load(D->gate);
        if (g & D->s.slot_bit) break;
        /* A process held from its first launch has no helper yet (it starts at the first launch let
         * through) and nothing queued: its waiting thread answers the controller's drains, which
         * otherwise waited out --share.drain-timeout for it at every hand-over and probe. Under the
         * lock, so that no launch is let through between the look and the answer. */
        pthread_mutex_lock(&D->wlock);
        if (!D->acct_ready && atomic_load(&me->drained_gen) != (g >> 16)) post_drained(me, g >> 16);
        pthread_mutex_unlock(&D->wlock);
        struct timespec ts;
        abs_after(&ts, 200000000ull);
        long r = futex((void *)D->gate, FUTEX_WAIT_BITSET, g, &ts, LAUNCHERS_BITSET);
        if (r != 0 && errno == ETIMEDOUT && !controller_alive()) fail_open("the share controller is gone");
    }
    atomic_fetch_sub(&me->waiting, 1);
    atomic_fetch_add(&me->throttled_ns, now_ns() - t0);
}

/* Draining hand-overs: whether this process holds the GPU past its slice's end (its previous launch
 * came after it). A tenant beside the holder, or in a probe, is not the holder. */
static inline int slice_over(void) {
    if (!D->s.policy || atomic_load_explicit(&D->failed_open, memory_order_relaxed)) return 0;
    uint64_t end = atomic_load_explicit(&D->s.policy->slice_end_ns, memory_order_relaxed);
    return end && atomic_load_explicit(&D->s.proc->last_launch_ns, memory_order_relaxed) >= end && !beside() &&
           !busy_accounting();
}

/* The holder's slice is over: stop launching until the controller hands the GPU on or gives this
 * holder another slice (the gate or the slice's end changes), and have the helper drain the queue
 * and ring the bell meanwhile. Only ever a thread of this process waits: it restrains nobody else. */
static void yield_slice(void) {
    uint32_t g = atomic_load(D->gate);
    uint64_t end = atomic_load(&D->s.policy->slice_end_ns);
    if (!(g & D->s.slot_bit)) return; /* not the holder after all: the gate decides */
    uint64_t t0 = now_ns();
    proc_t *me = D->s.proc;
    atomic_store(&D->yielded_gen, g >> 16);
    atomic_fetch_add(&me->waiting, 1);
    wake_helper(WAKE_NOW);
    while (atomic_load(D->gate) == g && atomic_load(&D->s.policy->slice_end_ns) == end &&
           !atomic_load_explicit(&D->failed_open, memory_order_relaxed)) {
        struct timespec ts;
        abs_after(&ts, 200000000ull);
        long r = futex((void *)D->gate, FUTEX_WAIT_BITSET, g, &ts, LAUNCHERS_BITSET);
        if (r != 0 && errno == ETIMEDOUT && !controller_alive()) fail_open("the share controller is gone");
    }
    uint32_t mine = g >> 16;
    atomic_compare_exchange_strong(&D->yielded_gen, &mine, 0);
    atomic_fetch_sub(&me->waiting, 1);
    atomic_fetch_add(&me->throttled_ns, now_ns() - t0);
}

/* A tenant beside the holder that needs more of the GPU than its share (its probes show it busy for
 * longer) launches only in the first `duty` of every DUTY_PERIOD_NS: its launching threads sleep
 * through the rest (no spinning, no controller wake-up), while the GPU runs the holder's work alone.
 * Its steps slow down by about what it is over its share, evenly, instead of waiting for another
 * tenant's whole turn. A period starts at the first launch after the previous one ended, so a
 * tenant that was idle starts with its full part.
 * The one tenant taking turns while every other runs beside it has nobody to hand the GPU to, so the
 * controller may give it a duty too (--share.lone-holder duty): it then keeps a short queue
 * (short_queue()) and closes its window before it sleeps, so that the GPU is the others' alone for
 * the rest of each period and the sleep is not charged to it as GPU time. */
#define DUTY_PERIOD_NS 10000000ull

static inline void end_burst(void);

static void keep_duty(void) {
    uint32_t ppm = duty_ppm();
    if (ppm == 0 || ppm >= 1000000u || atomic_load_explicit(&D->failed_open, memory_order_relaxed)) return;
    uint64_t now = now_ns(), start = atomic_load_explicit(&D->duty_started_ns, memory_order_relaxed);
    if (now - start >= DUTY_PERIOD_NS) {
        atomic_store_explicit(&D->duty_started_ns, now, memory_order_relaxed);
        return;
    }
    if (now - start < DUTY_PERIOD_NS * ppm / 1000000u) return;
    end_burst(); /* the holder runs while this tenant sleeps */
    if (D->acct_ready) {
        /* a holder's open window would span the sleep: end it at the last launch */
        pthread_mutex_lock(&D->wlock);
        if (D->win_open) close_window_and(WAKE_IF_ASLEEP);
        pthread_mutex_unlock(&D->wlock);
    }
    uint64_t until = start + DUTY_PERIOD_NS;
    struct timespec ts = {(time_t)(until / 1000000000ull), (long)(until % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
    atomic_fetch_add(&D->s.proc->throttled_ns, now_ns() - now);
    uint64_t expected = start;
    atomic_compare_exchange_strong(&D->duty_started_ns, &expected, now_ns());
}

/* Priority holds (--share.priority-hold on): a tenant beside a slice holder of lower priority posts
 * when each burst of its launches begins and rings the bell; the turn keeper then holds the holder's
 * launches until the burst ends, at this process's next wait for the GPU (or its duty's sleep), which
 * rings again. On a GPU that time-slices the contexts, a latency tenant's request beside a GPU-bound
 * holder otherwise waits for one of the holder's time slices at each gap between its own kernels: on
 * an H100 a ResNet-18 batch-1 request took 3.76 ms at the median beside a training loop, 2.17 ms
 * alone. The holder's queued work still runs first (--share.beside-queue of it). What a burst can
 * cost the holder is bounded by the keeper, not here: a burst holds it for at most HOLD_MAX_S, and
 * all of them for at most this tenant's share of the time. */
static int outranks_holder(uint32_t g) {
    const policy_t *p = D->s.policy;
    if (!p || !p->priority_hold || !D->s.slot_bit || (g & 0xffffu) == 0xffffu) return 0;
    uint32_t holders = ((g & 0xffffu) | atomic_load_explicit(&p->hold_mask, memory_order_relaxed)) &
                       ~atomic_load_explicit(&p->beside_mask, memory_order_relaxed) & ((1u << MAX_TENANTS) - 1);
    uint32_t mine = p->tenants[__builtin_ctz(D->s.slot_bit) % MAX_TENANTS].priority;
    for (int i = 0; holders; i++, holders >>= 1)
        if ((holders & 1u) && p->tenants[i].priority < mine) return 1;
    return 0;
}

static inline void start_burst(uint32_t g) {
    if (atomic_load_explicit(&D->bursting, memory_order_relaxed) || !outranks_holder(g)) return;
    if (atomic_exchange(&D->bursting, 1)) return;
    atomic_store_explicit(&D->s.proc->burst_ns, now_ns(), memory_order_release);
    ring_bell();
}

static inline void end_burst(void) {
    if (!atomic_load_explicit(&D->bursting, memory_order_relaxed) || !atomic_exchange(&D->bursting, 0)) return;
    atomic_store_explicit(&D->s.proc->burst_ns, 0, memory_order_release);
    ring_bell();
}

/* A launching thread that finds the gate closed: its open window ends at its last launch first, so
 * that the time it waits is not charged to it as GPU time (the helper may not be awake to end it: a
 * priority hold wakes nobody). */
static void wait_at_gate(void) {
    if (D->acct_ready) {
        pthread_mutex_lock(&D->wlock);
        if (D->win_open && !(atomic_load_explicit(D->gate, memory_order_relaxed) & D->s.slot_bit))
            close_window_and(WAKE_NONE);
        pthread_mutex_unlock(&D->wlock);
    }
    wait_turn();
}

/* Everything a launch does around the real call. `graph` counts graph launches. */
#define ADMIT_AND_RUN(STREAM, PTSZ, GRAPH, CALL)                                                         \
    do {                                                                                                 \
        D = dev_here();                                                                                  \
        ensure_joined();                                                                                 \
        /* before any wait at the gate: time held there is not the program's own */                     \
        if (atomic_load_explicit(&D->last_sync_ns, memory_order_relaxed)) note_relaunch(now_ns());       \
        if (!(atomic_load_explicit(D->gate, memory_order_relaxed) & D->s.slot_bit)) wait_at_gate();              \
        else if (slice_over()) yield_slice();                                                            \
        else if (!busy_accounting()) keep_duty(); /* beside the holder, or the lone holder */             \
        if (!D->s.policy || atomic_load_explicit(&D->failed_open, memory_order_relaxed)) {                       \
            atomic_fetch_add_explicit(&D->s.proc->launches, 1, memory_order_relaxed);                         \
            if (GRAPH) atomic_fetch_add_explicit(&D->s.proc->graph_launches, 1, memory_order_relaxed);        \
            return CALL;                                                                                 \
        }                                                                                                \
        pthread_mutex_lock(&D->wlock);                                                                      \
        while (!(atomic_load_explicit(D->gate, memory_order_relaxed) & D->s.slot_bit)) {                         \
            pthread_mutex_unlock(&D->wlock); /* closed between the check and the lock: wait again */       \
            wait_turn();                                                                                 \
            pthread_mutex_lock(&D->wlock);                                                                  \
        }                                                                                                \
        if (!D->acct_ready) start_accounting();                                                             \
        int busy_ = !D->acct_failed && busy_accounting();                                                   \
        if (!busy_ && beside()) {                                                                        \
            if (D->win_open) close_window_and(WAKE_IF_ASLEEP); /* untimed beside the holder */             \
            start_burst(atomic_load_explicit(D->gate, memory_order_relaxed));                            \
            D->untimed_queued = 1, D->untimed_stream = (STREAM), D->untimed_ptsz = (PTSZ);               \
        } else if (!D->acct_failed) open_window((STREAM), (PTSZ), busy_);                                   \
        CUresult rc_ = CALL;                                                                             \
        atomic_fetch_add_explicit(&D->s.proc->launches, 1, memory_order_relaxed);                             \
        if (GRAPH) atomic_fetch_add_explicit(&D->s.proc->graph_launches, 1, memory_order_relaxed);            \
        uint64_t launched_ = now_ns();                                                                   \
        atomic_store_explicit(&D->s.proc->last_launch_ns, launched_, memory_order_relaxed);                   \
        if (D->win_open) {                                                                                  \
            window_t *w_ = &D->ring[D->tail % POOL];                                                           \
            D->win_launches += (GRAPH) ? 8 : 1;                                                             \
            if (busy_) w_->submit_ns = launched_ - w_->started_ns;                                       \
            /* busy time: the end event follows every launch, so the window ends at its last kernel */   \
            w_->end_recorded = busy_ && record(w_->end, w_) == 0;                                        \
            if (w_->end_recorded) atomic_fetch_add_explicit(&D->s.proc->busy_launches, 1, memory_order_relaxed); \
            if (!(atomic_load_explicit(D->gate, memory_order_relaxed) & D->s.slot_bit)) close_window_and(WAKE_NOW); \
        }                                                                                                \
        pthread_mutex_unlock(&D->wlock);                                                                    \
        return rc_;                                                                                      \
    } while (0)

#define REAL(i, T) ((T)real(i))
#define MISSING 500 /* CUDA_ERROR_NOT_FOUND */

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*launch_ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*graph_fn)(CUgraphExec, CUstream);
typedef CUresult (*gpa_fn)(const char *, void **, int, uint64_t);
typedef CUresult (*gpa2_fn)(const char *, void **, int, uint64_t, int *);

static inline CUstream ptsz_stream(CUstream s) { return s ? s : CU_STREAM_PER_THREAD; }

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shm, CUstream s, void **params, void **extra) {
    launch_fn fn = REAL(H_LAUNCH, launch_fn);
    if (!fn) return MISSING;
    ADMIT_AND_RUN(s, 0, 0, fn(f, gx, gy, gz, bx, by, bz, shm, s, params, extra));
}

EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                    unsigned bz, unsigned shm, CUstream s, void **params, void **extra) {
    launch_fn fn = REAL(H_LAUNCH_PTSZ, launch_fn);
    if (!fn) return MISSING;
    ADMIT_AND_RUN(ptsz_stream(s), 1, 0, fn(f, gx, gy, gz, bx, by, bz, shm, s, params, extra));
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
    launch_ex_fn fn = REAL(H_LAUNCH_EX, launch_ex_fn);
    if (!fn) return MISSING;
    ADMIT_AND_RUN(c ? c->hStream : NULL, 0, 0, fn(c, f, params, extra));
}

EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
    launch_ex_fn fn = REAL(H_LAUNCH_EX_PTSZ, launch_ex_fn);
    if (!fn) return MISSING;
    ADMIT_AND_RUN(ptsz_stream(c ? c->hStream : NULL), 1, 0, fn(c, f, params, extra));
}

EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s) {
    graph_fn fn = REAL(H_GRAPH, graph_fn);
    if (!fn) return MISSING;
    ADMIT_AND_RUN(s, 0, 1, fn(g, s));
}

EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) {
    graph_fn fn = REAL(H_GRAPH_PTSZ, graph_fn);
    if (!fn) return MISSING;
    ADMIT_AND_RUN(ptsz_stream(s), 1, 1, fn(g, s));
}

/* The program waits for the GPU (a stream, its context or an event). First its open window is
 * closed, so that the window ends at its last launch instead of spanning the wait and the host work
 * after it (a training step's host work was charged as GPU time, and the tenant held below its
 * share). Once the wait returns, a slice holder is on the host with its work done: its helper
 * watches, and if no launch comes within QUIET_NS the holder lends the rest of its turn. */
static inline int holding_slice(void) {
    if (!D->s.policy || atomic_load_explicit(&D->failed_open, memory_order_relaxed)) return 0;
    uint32_t g = atomic_load_explicit(D->gate, memory_order_relaxed);
    return (g & 0xffffu) != 0xffffu && (g & D->s.slot_bit) && !beside() && !busy_accounting();
}

static void before_sync(void) {
    D = dev_here();
    if (!holding_slice() || !D->acct_ready) return;
    pthread_mutex_lock(&D->wlock);
    if (D->win_open) close_window_and(WAKE_NONE);
    pthread_mutex_unlock(&D->wlock);
}

static void after_sync(void) {
    end_burst();
    if (!holding_slice()) return;
    /* Its windows have finished (it waited for its work): post them here, awake anyway, so that the
     * helper of a program that syncs every step need not wake for each window (on an H100 the
     * helpers of an encoder and a graph loop taking turns woke 300 and 500 times a second). Once the
     * wait returns, what it waited for is posted. */
    if (D->acct_ready) {
        pthread_mutex_lock(&D->wlock);
        resolve_finished(POOL);
        pthread_mutex_unlock(&D->wlock);
    }
    uint64_t t = now_ns();
    atomic_store(&D->synced_ns, t);
    atomic_store_explicit(&D->last_sync_ns, t, memory_order_relaxed);
    /* a program that launches again at once after its waits, or a holder alone: the helper sees it at
     * its next look */
    wake_helper(syncs_tight() || holding_alone(atomic_load_explicit(D->gate, memory_order_relaxed)) ? WAKE_IF_ASLEEP
                                                                                                   : WAKE_NOW);
}

typedef CUresult (*stream_sync_fn)(CUstream);
typedef CUresult (*ctx_sync_fn)(void);

/* The time spent in the wait is counted (sync_wait_ns): against the same in its probes, running alone,
 * it tells a tenant beside the holder that waits behind the holder's work from one slowed on the host. */
#define WAIT_FOR_GPU(CALL)                                                                               \
    do {                                                                                                 \
        before_sync();                                                                                   \
        proc_t *p_ = D->s.proc;                                                                          \
        uint64_t t0_ = now_ns();                                                                         \
        /* under way: the start first, so a reader that sees the count sees the start too */            \
        atomic_fetch_add_explicit(&p_->sync_open_since_ns, t0_, memory_order_release);                  \
        atomic_fetch_add_explicit(&p_->sync_open, 1, memory_order_release);                              \
        CUresult rc_ = CALL;                                                                             \
        atomic_fetch_add_explicit(&p_->sync_open, (uint64_t)-1, memory_order_release);                   \
        atomic_fetch_add_explicit(&p_->sync_wait_ns, now_ns() - t0_, memory_order_release);              \
        atomic_fetch_sub_explicit(&p_->sync_open_since_ns, t0_, memory_order_release);                   \
        after_sync();                                                                                    \
        return rc_;                                                                                      \
    } while (0)

EXPORT CUresult cuStreamSynchronize(CUstream s) {
    stream_sync_fn fn = REAL(H_STREAM_SYNC, stream_sync_fn);
    if (!fn) return MISSING;
    WAIT_FOR_GPU(fn(s));
}

EXPORT CUresult cuStreamSynchronize_ptsz(CUstream s) {
    stream_sync_fn fn = REAL(H_STREAM_SYNC_PTSZ, stream_sync_fn);
    if (!fn) return MISSING;
    WAIT_FOR_GPU(fn(s));
}

EXPORT CUresult cuCtxSynchronize(void) {
    ctx_sync_fn fn = REAL(H_CTX_SYNC, ctx_sync_fn);
    if (!fn) return MISSING;
    WAIT_FOR_GPU(fn());
}

EXPORT CUresult cuEventSynchronize(CUevent e) {
    event_sync_fn fn = REAL(H_EVENT_SYNC, event_sync_fn);
    if (!fn) return MISSING;
    WAIT_FOR_GPU(fn(e));
}

/* The hook for a symbol name, or -1. cuGetProcAddress is asked for base names ("cuLaunchKernel");
 * the per-thread flag selects the _ptsz variant. */
static int hook_index(const char *symbol, uint64_t flags) {
    if (!symbol || symbol[0] != 'c' || symbol[1] != 'u') return -1;
    for (int i = 0; i < H_N; i++)
        if (strcmp(symbol, hook_names[i]) == 0) {
            int ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
            if (ptsz && (i == H_LAUNCH || i == H_LAUNCH_EX || i == H_GRAPH || i == H_STREAM_SYNC)) return i + 1;
            return i;
        }
    return -1;
}

/* A driver pointer handed out for `i`: keep it as the real one and hand out the hook instead. */
static void *wrap(int i, void *p) {
    if (!p || p == hook_fn[i]) return p;
    void *expected = NULL;
    atomic_compare_exchange_strong(&real_fn[i], &expected, p);
    return hook_fn[i];
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
    gpa_fn fn = REAL(H_GPA, gpa_fn);
    if (!fn) return MISSING;
    CUresult rc = fn(symbol, pfn, version, flags);
    int i = hook_index(symbol, flags);
    if (rc == 0 && pfn && i >= 0) *pfn = wrap(i, *pfn);
    else if (rc == 0 && pfn) *pfn = memory_wrap(symbol, flags, *pfn);
    return rc;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
    gpa2_fn fn = REAL(H_GPA_V2, gpa2_fn);
    if (!fn) return MISSING;
    CUresult rc = fn(symbol, pfn, version, flags, status);
    int i = hook_index(symbol, flags);
    if (rc == 0 && pfn && i >= 0) *pfn = wrap(i, *pfn);
    else if (rc == 0 && pfn) *pfn = memory_wrap(symbol, flags, *pfn);
    return rc;
}

/* dlsym: the runtime finds cuGetProcAddress on its own dlopen handle of libcuda.so.1. RTLD_NEXT lookups
 * pass through unchanged (resolved relative to this library, as every dlsym-hooking preload does). */
EXPORT void *dlsym(void *handle, const char *symbol) {
    if (!real_dlsym) find_real_dlsym();
    if (!real_dlsym) return NULL;
    void *p = real_dlsym(handle, symbol);
    if (handle == RTLD_NEXT) return p;
    int i = hook_index(symbol, 0);
    if (i < 0) return memory_wrap(symbol, 0, p); /* p itself unless a memory or NVML entry point */
    if (!p) return p;
    if (p == hook_fn[i]) return p; /* found this library's own export: real() resolves the driver's */
    return wrap(i, p);
}

/* Counters for tests and for a process that wants to read its own numbers. */
EXPORT void gpuscope_share_stats(uint64_t out[8]) {
    share_here();
    out[0] = atomic_load(&D->s.proc->launches);
    out[1] = atomic_load(&D->s.proc->graph_launches);
    out[2] = atomic_load(&D->s.proc->hook_errors);
    out[3] = atomic_load(&D->s.proc->throttled_ns);
    out[4] = atomic_load(&D->s.proc->gpu_ns);
    out[5] = atomic_load(&D->s.proc->windows);
    out[6] = (uint64_t)atomic_load(&D->failed_open);
    out[7] = (uint64_t)(D->s.policy != NULL);
}

/* Before any other constructor of this library: a hook may run from another library's constructor. */
__attribute__((constructor(101))) static void init(void) {
    for (int i = 0; i <= MAX_DEVICES; i++) reset_dev(&devs[i], i);
    find_real_dlsym();
    pthread_atfork(NULL, NULL, after_fork_in_child);
    hook_fn[H_LAUNCH] = (void *)cuLaunchKernel;
    hook_fn[H_LAUNCH_PTSZ] = (void *)cuLaunchKernel_ptsz;
    hook_fn[H_LAUNCH_EX] = (void *)cuLaunchKernelEx;
    hook_fn[H_LAUNCH_EX_PTSZ] = (void *)cuLaunchKernelEx_ptsz;
    hook_fn[H_GRAPH] = (void *)cuGraphLaunch;
    hook_fn[H_GRAPH_PTSZ] = (void *)cuGraphLaunch_ptsz;
    hook_fn[H_STREAM_SYNC] = (void *)cuStreamSynchronize;
    hook_fn[H_STREAM_SYNC_PTSZ] = (void *)cuStreamSynchronize_ptsz;
    hook_fn[H_CTX_SYNC] = (void *)cuCtxSynchronize;
    hook_fn[H_EVENT_SYNC] = (void *)cuEventSynchronize;
    hook_fn[H_GPA] = (void *)cuGetProcAddress;
    hook_fn[H_GPA_V2] = (void *)cuGetProcAddress_v2;
}
