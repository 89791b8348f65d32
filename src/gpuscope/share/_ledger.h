/* gpuscope share: the layout of the ledger's pages, as the preload library sees them. ledger.py
 * mirrors every offset; tests/share/test_layout.py builds a program from this header and compares
 * them. Each page is a sealed memfd the controller hands over the join socket (joins.py): the policy
 * (read-only to tenants), the bell, one page per tenant process, and one per tenant shared by all its
 * processes (its memory use against its cap).
 */
#ifndef GPUSCOPE_SHARE_LEDGER_H
#define GPUSCOPE_SHARE_LEDGER_H

#include <stdatomic.h>
#include <stdint.h>

#define POLICY_MAGIC 0x48535347u /* "GSSH" */
#define PROC_MAGIC 0x50535347u   /* "GSSP" */
#define TENANT_MAGIC 0x54535347u /* "GSST" */
#define LAYOUT_VERSION 14u
#define MAX_TENANTS 16
#define NAME_LEN 40
/* A tenant's memory cap: bytes, or with this bit set a fraction of the card in parts per million. */
#define MEM_CAP_FRACTION 0x8000000000000000ull
/* Defaults, the controller's and the library's (the library uses them where the policy page leaves a
 * word 0, and before it has a page; beside_queue_us 0 means the usual queue): ledger.py and preload.py
 * read the same figures. */
#define DEFAULT_LEDGER "/dev/shm/gpuscope-share" /* path prefix, when GPUSCOPE_SHARE_LEDGER is unset */
#define DEFAULT_WINDOW_US 2000u   /* GPU time one accounting window aims at */
#define DEFAULT_QUEUED_WINDOWS 2u /* finished-but-unresolved windows a slice holder may queue */
#define DEFAULT_INFLIGHT_OPEN 16u /* the same while shares do not bind */
#define DEFAULT_STALE_MS 2000u    /* a controller whose heartbeat is older is taken for dead */
#define DEFAULT_BESIDE_QUEUE_US 500u /* a slice holder's queue beside a tenant of higher priority (0: the usual queue) */

typedef struct {
    uint32_t magic, version;
    int32_t controller_pid;
    uint32_t ntenants;
    _Atomic uint64_t heartbeat_ns; /* the controller's CLOCK_MONOTONIC */
    _Atomic uint32_t gate;         /* futex word: bit i = tenant slot i may launch; bits 16..31 generation */
    uint32_t mode;                 /* 0 events, 1 nvml */
    uint32_t window_us, inflight_slice, inflight_open, stale_ms;
    _Atomic uint32_t busy_mask;    /* bit i: slot i times each launch on its own (a probe, running alone) */
    _Atomic uint32_t beside_mask;  /* bit i: slot i runs beside the slice holder, its launches untimed */
    _Atomic uint64_t slice_end_ns; /* draining hand-overs: when the holder's slice ends (0: none) */
    _Atomic uint32_t lender_mask;  /* bit i: slot i lent the rest of its turn; its first held thread rings */
    uint32_t beside_queue_us;      /* the holder's queue while a tenant runs beside it (short_queue()) */
    _Atomic uint32_t turns_mask;   /* bit i: slot i takes turns (active, not beside): holding_alone() */
    _Atomic uint32_t hold_mask;    /* bit i: slot i holds the GPU but waits out a burst of a tenant of higher priority */
    uint32_t priority_hold;        /* 1: tenants of higher priority than the holder post their bursts (burst_ns) */
    uint32_t reserved[11];
    struct {
        char name[NAME_LEN];
        uint32_t share_ppm, priority, active;
        _Atomic uint32_t duty_ppm; /* beside the holder, or the lone holder: its part of each DUTY_PERIOD_NS */
        uint64_t mem_cap;          /* 0: none; bytes, or MEM_CAP_FRACTION | ppm of the card */
    } tenants[MAX_TENANTS];
} policy_t;

typedef struct {
    uint32_t magic, version;
    int32_t pid; /* as the controller knows it (its pid namespace), written by the controller */
    int32_t slot;
    char tenant[NAME_LEN];
    _Atomic uint32_t waiting;     /* threads held at the gate */
    _Atomic uint32_t drained_gen; /* futex word: generation of the last closed gate with no work queued */
    _Atomic uint64_t launches, graph_launches, hook_errors, throttled_ns, gpu_ns, windows, last_launch_ns,
        inflight, failed_open, started_ns, waits, window_open, busy_launches, busy_ns;
    _Atomic uint64_t mem_bytes, mem_refused; /* device memory this process holds; allocations refused */
    _Atomic uint64_t sync_wait_ns; /* time the program spent in its waits for the GPU (syncs), those ended */
    /* The waits under way: how many, and the sum of their start times (CLOCK_MONOTONIC ns). A reader
     * adds count * now - sum to sync_wait_ns for the time waited up to now, so an interval's waits are
     * exact at both ends: a wait that began before a 10 ms probe and ended in it is not its own. */
    _Atomic uint64_t sync_open, sync_open_since_ns;
    /* The helper thread's own cost, which no other reader can see per process: its wake-ups by what it
     * slept on (a probe's batch posting, the window lock held by a launching thread, a window's end
     * event, a drain's event; on the gate word, a nap while the launching thread posts, a watch for
     * quiet and a plain sleep, each either woken or run out: _timeout) and its CPU time
     * (CLOCK_THREAD_CPUTIME_ID, as of its last wake-up). */
    _Atomic uint64_t helper_wakes_probe, helper_wakes_lock, helper_wakes_window, helper_wakes_drain,
        helper_wakes_nap, helper_wakes_nap_timeout, helper_wakes_watch, helper_wakes_watch_timeout,
        helper_wakes_gate, helper_wakes_gate_timeout, helper_cpu_ns;
    /* Beside a slice holder of lower priority, with priority holds on: when its current burst of
     * launches began (CLOCK_MONOTONIC ns; 0 between bursts, which end at its waits for the GPU). The
     * turn keeper holds the holder's launches meanwhile, within this tenant's share of the time. */
    _Atomic uint64_t burst_ns;
} proc_t;

/* One per tenant, written by all its processes: what they hold together, reserved atomically before
 * each allocation goes to the driver, so two processes of a tenant never pass its cap together. */
typedef struct {
    uint32_t magic, version;
    _Atomic uint64_t used, refused, peak;
    _Atomic uint64_t card_bytes; /* the device's real total, as the first process to ask saw it */
} tenant_mem_t;

_Static_assert(sizeof(policy_t) == 128 + MAX_TENANTS * 64, "policy layout");
_Static_assert(__builtin_offsetof(policy_t, lender_mask) == 64, "policy lender layout");
_Static_assert(__builtin_offsetof(policy_t, beside_queue_us) == 68, "policy beside queue layout");
_Static_assert(__builtin_offsetof(policy_t, turns_mask) == 72, "policy turns layout");
_Static_assert(__builtin_offsetof(policy_t, priority_hold) == 80, "policy hold layout");
_Static_assert(__builtin_offsetof(policy_t, tenants[0].mem_cap) == 128 + 56, "policy tenant layout");
_Static_assert(__builtin_offsetof(proc_t, launches) == 64, "proc layout");
_Static_assert(__builtin_offsetof(proc_t, mem_bytes) == 64 + 14 * 8, "proc memory layout");
_Static_assert(__builtin_offsetof(tenant_mem_t, used) == 8, "tenant memory layout");

#endif
