/* gpuscope share: the controller's turn keeper, hand-overs between slice holders in C.
 *
 * While two or more tenants take turns, the controller's only frequent job is the hand-over at each
 * slice's end: read who is waiting, pick the next holder, write the gate, wake its threads. Done by
 * the Python loop, each hand-over is a wake-up of the interpreter on a cold cache (docs/share.md,
 * "The turn keeper", has the cost). take_turns() does the same
 * decisions here and returns to Python only at a deadline (the controller's bookkeeping: charging,
 * the active set, probes, every KEEPER_RETURN_S, 500 ms), when a tenant rings the bell (a preempting priority, a quiet
 * holder) or when a tenant process has exited, so a hand-over costs a futex wake-up, a few loads and
 * a kill(pid, 0) per process.
 *
 * The decisions mirror scheduler.py's SliceScheduler.pick and quantum, on the deficits the
 * controller passed in, advanced by each holder's held time (a holder's GPU time while it holds the
 * GPU alone); the controller charges what the tenants really posted when it gets control back.
 * Offsets into the ledger's pages are passed in by ledger.py, the one place that defines them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "_wake_bits.h"

#define MAX_SLOTS 16
#define MAX_PROCS 1024
#define OPEN_MASK 0xFFFFu

enum { RETURN_DEADLINE = 0, RETURN_BELL = 1, RETURN_IDLE = 2, RETURN_GONE = 3 };

typedef struct {
    int slot;
    pid_t pid;
    const uint8_t *page;
} proc_t;

typedef struct {
    /* the ledger */
    uint32_t *gate, *bell;
    uint64_t *heartbeat; /* the controller's: tenants fail open when it goes stale (2 s) */
    uint32_t bell_seen, gen, beside;
    size_t off_waiting, off_window_open, off_inflight, off_last_launch, off_drained, off_burst;
    int64_t drain_timeout; /* 0: overlapping hand-overs; else wait this long for the old holder's work */
    uint64_t *slice_end_word; /* draining: the holder's slice end, published so that it can yield */
    int64_t grace;            /* draining: how long past the slice's end a yield is awaited */
    /* the tenants */
    int nslots;
    double share[MAX_SLOTS], used[MAX_SLOTS];
    long priority[MAX_SLOTS];
    proc_t procs[MAX_PROCS];
    int nprocs;
    /* the turn */
    int holder;
    int64_t slice_start, slice_end, return_at, base_slice, recent;
    /* what happened, for the controller's counters */
    unsigned long grants[MAX_SLOTS];
    int64_t held[MAX_SLOTS];
    unsigned long drain_timeouts, yields;
    int yield_due; /* the holder was told its slice's end: wait the grace for its yield */
    /* a lent turn: the lender went quiet with its slice not over and others waiting; the holder
     * runs in the rest of it until the lender launches again (its held thread rings) or it ends */
    uint32_t *lender_word;
    int lender; /* -1: no lend */
    int64_t lend_end;
    unsigned long lends, reclaims;
    /* priority holds: while a tenant of higher priority beside the holder is in a burst of launches
     * (its page's burst_ns), the holder's bit stays clear, so that the burst runs alone once the
     * holder's queue has finished; hold_word NULL: off */
    uint32_t *hold_word;
    int holding;
    /* hold_since: when the hold under way (or the last) began; cut_at: when the last hold cut at
     * hold_max began (a burst must begin after it to hold again) */
    int64_t hold_since, cut_at, hold_max, credit, credit_at, credit_cap;
    double hold_rate; /* credit earned per ns: the share of the tenants that may hold */
    unsigned long holds;
    int64_t hold_ns;
} keeper_t;

/* A turn with less than this left is not lent: the hand-over would cost more than it fills. */
#define LEND_MIN_NS 1000000
/* A priority hold starts only with this much credit. */
#define HOLD_MIN_CREDIT_NS 1000000

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static uint32_t load32(const void *p) { return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE); }
static uint64_t load64(const void *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE); }

static int within_share(const keeper_t *k, int slot, uint32_t wanting) {
    double total_used = 0, total_share = 0;
    for (int s = 0; s < k->nslots; s++)
        if (wanting >> s & 1) {
            total_used += k->used[s];
            total_share += k->share[s];
        }
    if (total_used <= 0 || total_share <= 0) return 1;
    return k->used[slot] / total_used <= k->share[slot] / total_share + 1e-9;
}

/* SliceScheduler.pick: among those within their share (or all, if none is), the highest priority,
 * then the lowest used/share. */
static int pick(const keeper_t *k, uint32_t wanting) {
    uint32_t eligible = 0;
    for (int s = 0; s < k->nslots; s++)
        if ((wanting >> s & 1) && within_share(k, s, wanting)) eligible |= 1u << s;
    if (!eligible) eligible = wanting;
    int best = -1;
    for (int s = 0; s < k->nslots; s++) {
        if (!(eligible >> s & 1)) continue;
        if (best < 0 || k->priority[s] > k->priority[best]) {
            best = s;
            continue;
        }
        if (k->priority[s] == k->priority[best] &&
            k->used[s] / (k->share[s] > 1e-9 ? k->share[s] : 1e-9) <
                k->used[best] / (k->share[best] > 1e-9 ? k->share[best] : 1e-9))
            best = s;
    }
    return best;
}

/* SliceScheduler.quantum: the base slice for the smallest share among those taking turns, longer in
 * proportion to the share, at most eight times (a tenant without a share, removed from the policy
 * while it runs, gets the base slice and sets no scale). */
static int64_t quantum(const keeper_t *k, int slot, uint32_t wanting) {
    double smallest = 0;
    for (int s = 0; s < k->nslots; s++)
        if ((wanting >> s & 1 || s == slot) && k->share[s] > 0 && (smallest == 0 || k->share[s] < smallest))
            smallest = k->share[s];
    double ratio = smallest > 0 ? k->share[slot] / smallest : 1.0;
    ratio = ratio < 1.0 ? 1.0 : ratio;
    return (int64_t)((double)k->base_slice * (ratio < 8.0 ? ratio : 8.0));
}

/* Slots with a thread held at the gate (tenants beside the holder excluded), and whether the holder
 * still has work: a thread that yielded at its slice's end, a window open or queued, or a launch
 * within `recent`. */
static uint32_t wanting_slots(const keeper_t *k, int64_t now, int *holder_wants) {
    uint32_t wanting = 0;
    *holder_wants = 0;
    for (int i = 0; i < k->nprocs; i++) {
        const proc_t *p = &k->procs[i];
        if (k->beside >> p->slot & 1) continue;
        if (load32(p->page + k->off_waiting)) wanting |= 1u << p->slot;
        if (p->slot == k->holder &&
            (k->holding || load32(p->page + k->off_waiting) || load64(p->page + k->off_window_open) ||
             load64(p->page + k->off_inflight) || now - (int64_t)load64(p->page + k->off_last_launch) < k->recent))
            *holder_wants = 1;
    }
    return wanting;
}

/* Whether the holder is quiet (QUIET_NS): nothing held at the gate, no window open or queued, and
 * no launch for that long. Its helper rang for this; the words say whether it still holds. */
static int holder_quiet(const keeper_t *k, int64_t now) {
    for (int i = 0; i < k->nprocs; i++) {
        const proc_t *p = &k->procs[i];
        if (p->slot != k->holder) continue;
        if (load32(p->page + k->off_waiting) || load64(p->page + k->off_window_open) ||
            load64(p->page + k->off_inflight) || now - (int64_t)load64(p->page + k->off_last_launch) < (int64_t)QUIET_NS)
            return 0;
    }
    return 1;
}

/* Whether process `pid` has exited. `zombie`: a process that exited but was not reaped yet counts as
 * gone too (telling one costs a read of /proc, so only where a wait would otherwise run out). */
static int gone(pid_t pid, int zombie) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    if (!zombie) return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *close = strrchr(buf, ')');
    return close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

/* Whether a tenant process has exited (its share goes back once the controller forgets it). */
static int any_gone(const keeper_t *k) {
    for (int i = 0; i < k->nprocs; i++)
        if (gone(k->procs[i].pid, 0)) return 1;
    return 0;
}

/* The holder's time since the last hand-over counts as its use (it held the GPU alone). */
static void account(keeper_t *k, int64_t *mark, int64_t now) {
    k->held[k->holder] += now - *mark;
    k->used[k->holder] += (double)(now - *mark) / 1e9;
    *mark = now;
}

/* A new gate generation with the slots in `mask`; wakes the threads waiting with `bitset` (0: none). */
static void set_gate(keeper_t *k, uint32_t mask, uint32_t bitset) {
    k->gen = (k->gen + 1) & 0xFFFF;
    if (!k->gen) k->gen = 1;
    __atomic_store_n(k->gate, (k->gen << 16) | (mask & OPEN_MASK), __ATOMIC_RELEASE);
    if (bitset) syscall(SYS_futex, k->gate, FUTEX_WAKE_BITSET, 0x7fffffff, NULL, NULL, bitset);
}

/* The gate with `slot` holding the GPU: its bit set unless a priority hold keeps it waiting. */
static uint32_t holder_mask(const keeper_t *k, int slot) { return (k->holding ? 0u : 1u << slot) | k->beside; }

/* The credit for priority holds, earned at hold_rate since it was last counted, spent while holding. */
static void count_credit(keeper_t *k, int64_t now) {
    int64_t dt = now - k->credit_at;
    k->credit_at = now;
    k->credit += (int64_t)((double)dt * k->hold_rate) - (k->holding ? dt : 0);
    if (k->credit > k->credit_cap) k->credit = k->credit_cap;
}

/* Whether a process of a tenant beside the holder, of higher priority than the holder's, is in a burst
 * of launches that began after `after` and less than hold_max ago. The time is the tenant's own word:
 * one in the future, or older, holds nothing. */
static int priority_burst(const keeper_t *k, int64_t now, int64_t after) {
    for (int i = 0; i < k->nprocs; i++) {
        const proc_t *p = &k->procs[i];
        if (!(k->beside >> p->slot & 1) || k->priority[p->slot] <= k->priority[k->holder]) continue;
        int64_t since = (int64_t)load64(p->page + k->off_burst);
        if (since > after && since <= now && now - since < k->hold_max) return 1;
    }
    return 0;
}

/* Starts or ends a priority hold: the holder's launches wait while a burst of a tenant of higher
 * priority runs, within the credit. Its queued work is not drained: it finishes (at most
 * --share.beside-queue of it) and the burst then has the GPU alone. Its launching threads are woken at
 * the end. Returns whether the gate changed. */
static int update_hold(keeper_t *k, int64_t now) {
    if (!k->hold_word) return 0;
    count_credit(k, now);
    int want;
    if (k->holding) {
        /* a hold lasts at most hold_max by the keeper's clock, whatever the bursts' words say (one
         * burst after another of a tenant's processes, or a word rewritten) */
        int cut = now - k->hold_since >= k->hold_max;
        if (cut) k->cut_at = k->hold_since;
        want = !cut && k->credit > 0 && priority_burst(k, now, 0);
    } else {
        /* a hold starts with at least HOLD_MIN_CREDIT_NS saved up (not a hand-over for a few
         * microseconds), for a burst that began after the last hold cut at hold_max */
        want = k->credit > HOLD_MIN_CREDIT_NS && priority_burst(k, now, k->cut_at);
    }
    if (want == k->holding) return 0;
    k->holding = want;
    if (want) {
        k->holds++;
        k->hold_since = now;
    } else {
        k->hold_ns += now - k->hold_since;
    }
    __atomic_store_n(k->hold_word, want ? 1u << k->holder : 0u, __ATOMIC_RELEASE);
    set_gate(k, holder_mask(k, k->holder), want ? 0 : LAUNCHERS_BITSET);
    return 1;
}

/* When a hold must end though no bell rings: hold_max after it began, or the credit spent. */
static int64_t hold_ends(const keeper_t *k) {
    if (!k->holding) return INT64_MAX;
    int64_t by_credit = k->credit_at + (k->hold_rate < 1.0 ? (int64_t)((double)k->credit / (1.0 - k->hold_rate)) : INT64_MAX / 2);
    int64_t by_max = k->hold_since + k->hold_max;
    return by_credit < by_max ? by_credit : by_max;
}

/* A draining hand-over: hold the old holder (its helper threads, woken by the gate change, post each
 * process's drained generation once its queued work has finished) and wait for that, at most
 * drain_timeout; a process that died meanwhile never posts, and is no timeout. */
static void beat(keeper_t *k) { __atomic_store_n(k->heartbeat, (uint64_t)now_ns(), __ATOMIC_RELEASE); }

static void drain(keeper_t *k) {
    /* the old holder's helper threads alone: the next holder's launching threads would wake only to
     * find their bit still clear, and the other tenants' helpers have nothing to post */
    uint32_t helpers = 0;
    for (int i = 0; i < k->nprocs; i++)
        if (k->procs[i].slot == k->holder) helpers |= helper_wake_bit(k->procs[i].pid);
    set_gate(k, k->beside, helpers);
    int64_t deadline = now_ns() + k->drain_timeout;
    for (int i = 0; i < k->nprocs; i++) {
        const proc_t *p = &k->procs[i];
        if (p->slot != k->holder) continue;
        const uint32_t *word = (const uint32_t *)(p->page + k->off_drained);
        for (;;) {
            uint32_t seen = load32(word);
            if (seen == k->gen) break;
            int64_t left = deadline - now_ns();
            if (left <= 0) {
                if (!gone(p->pid, 1)) k->drain_timeouts++;
                break;
            }
            if (left > 50000000) left = 50000000; /* look at the pid, and beat, now and then */
            beat(k);
            struct timespec ts = {0, (long)left};
            if (syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0) != 0 && errno == ETIMEDOUT &&
                gone(p->pid, 1))
                break; /* an exiting process never posts its drain */
        }
    }
}

/* Gives `slot` a slice from `now`, ending no sooner than `not_before`. */
static void grant(keeper_t *k, int slot, uint32_t wanting, int64_t now, int64_t not_before) {
    k->grants[slot]++;
    k->slice_start = now;
    k->slice_end = now + quantum(k, slot, wanting | 1u << slot);
    if (k->slice_end < not_before) k->slice_end = not_before;
    /* Published before the gate opens: the holder yields at this time. Only while others wait: a
     * holder given more time because nobody else wants the GPU must not drain its queue for nothing. */
    k->yield_due = k->drain_timeout > 0 && (wanting & ~(1u << slot));
    if (k->drain_timeout > 0)
        __atomic_store_n(k->slice_end_word, k->yield_due ? (uint64_t)k->slice_end : 0, __ATOMIC_RELEASE);
    /* Only the launching threads held at the gate (they wait with bitset 1): the tenants' helper
     * threads wait on the same word with other bits, and a hand-over needs nothing of them. A
     * holder given another slice is woken too when draining: it may have yielded. */
    int changed = slot != k->holder;
    k->holder = slot;
    if (k->holding) __atomic_store_n(k->hold_word, 1u << slot, __ATOMIC_RELEASE);
    if (changed || k->drain_timeout > 0) set_gate(k, holder_mask(k, slot), LAUNCHERS_BITSET);
}

/* Whether the holder yielded at its slice's end and drained: each of its processes posted the
 * current generation as drained (under a closed gate it would be a newer one). */
static int holder_yielded(const keeper_t *k) {
    if (k->holding) return 0; /* held for a priority burst: what it posted answers the hold's gate */
    int procs = 0;
    for (int i = 0; i < k->nprocs; i++) {
        if (k->procs[i].slot != k->holder) continue;
        if (load32(k->procs[i].page + k->off_drained) != k->gen) return 0;
        procs++;
    }
    return procs > 0;
}

/* The slice's end, published to a draining holder (it yields there while others wait). */
static void set_slice_end(keeper_t *k, int64_t end) {
    k->slice_end = end;
    if (k->drain_timeout > 0)
        __atomic_store_n(k->slice_end_word, k->yield_due ? (uint64_t)end : 0, __ATOMIC_RELEASE);
}

static void set_lender(keeper_t *k, int slot, int64_t end) {
    k->lender = slot;
    k->lend_end = end;
    __atomic_store_n(k->lender_word, slot < 0 ? 0u : 1u << slot, __ATOMIC_RELEASE);
}

/* Work-conserving turns, decided at a bell: the holder went quiet with its slice not over while
 * others wait (it lends them the rest of its turn, keeping its claim), or the lender launches again
 * (the turn comes back at once, after the borrower's one queued window when draining). Each is
 * charged only the time it held the GPU. Returns whether it acted. */
static int lend_or_reclaim(keeper_t *k, int64_t *mark, int draining) {
    int64_t now = now_ns();
    int holder_wants;
    uint32_t wanting = wanting_slots(k, now, &holder_wants);
    if (k->lender >= 0) {
        if (!(wanting >> k->lender & 1)) return 0;
        if (draining) drain(k);
        now = now_ns();
        account(k, mark, now); /* the borrower's work ran until the drain ended */
        int lender = k->lender;
        int64_t end = k->lend_end;
        set_lender(k, -1, 0);
        k->reclaims++;
        grant(k, lender, wanting, now, 0);
        set_slice_end(k, end > now ? end : now); /* the rest of the lender's own turn */
        return 1;
    }
    uint32_t others = wanting & ~(1u << k->holder);
    if (!holder_quiet(k, now) || !others || k->slice_end - now < LEND_MIN_NS) return 0;
    int borrower = pick(k, others);
    if (borrower < 0) return 0;
    /* no drain: the holder has nothing queued (holder_quiet), and waiting for its helper to say so
     * would cost the borrower two wake-ups of the lent time */
    now = now_ns();
    account(k, mark, now);
    int lender = k->holder;
    int64_t end = k->slice_end;
    set_lender(k, lender, end); /* before the gate opens to the borrower: the lender's waiter rings */
    k->lends++;
    grant(k, borrower, others, now, 0);
    set_slice_end(k, end); /* the borrower runs in the rest of the lender's turn */
    return 1;
}

/* Whether a bell needs the Python loop: the holder may have nothing left to do, or a tenant of
 * higher priority waits (it may preempt). Anything else is a thread that began to wait while the gate
 * was closed for a drain, which the hand-over that follows serves: returning to Python for it cost a
 * wake-up of the interpreter per lent turn taken back. */
static int bell_needs_python(const keeper_t *k) {
    int holder_wants;
    uint32_t wanting = wanting_slots(k, now_ns(), &holder_wants);
    if (!holder_wants) return 1;
    for (int s = 0; s < k->nslots; s++)
        if ((wanting >> s & 1) && k->priority[s] > k->priority[k->holder]) return 1;
    return 0;
}

static int keep(keeper_t *k) {
    int64_t mark = now_ns();
    int draining = k->drain_timeout > 0;
    if (draining) { /* the running slice may yield only if someone else waits for the GPU */
        int holder_wants;
        uint32_t others = wanting_slots(k, mark, &holder_wants) & ~(1u << k->holder);
        k->yield_due = others != 0;
        __atomic_store_n(k->slice_end_word, others ? (uint64_t)k->slice_end : 0, __ATOMIC_RELEASE);
    }
    update_hold(k, mark);
    for (;;) {
        int64_t now = now_ns();
        int yielded = 0;
        beat(k);
        update_hold(k, now); /* a priority burst began or ended (its process rang), or its hold ran out */
        if (load32(k->bell) != k->bell_seen) {
            /* the holder's helper rings once its yield has drained: hand over here */
            if (!draining || !holder_yielded(k)) {
                uint32_t rung = load32(k->bell);
                if (!any_gone(k) && (lend_or_reclaim(k, &mark, draining) || !bell_needs_python(k))) {
                    k->bell_seen = rung;
                    continue;
                }
                account(k, &mark, now_ns());
                return RETURN_BELL;
            }
            k->bell_seen = load32(k->bell);
            yielded = 1;
        }
        if (!yielded && now >= k->return_at) {
            account(k, &mark, now);
            return RETURN_DEADLINE;
        }
        int64_t end = k->slice_end + (k->yield_due ? k->grace : 0);
        int64_t wake = end < k->return_at ? end : k->return_at;
        if (!yielded && now < wake) {
            int64_t until = hold_ends(k) < wake ? hold_ends(k) : wake;
            if (until <= now) until = now + 1000;
            struct timespec ts = {(time_t)((until - now) / 1000000000), (long)((until - now) % 1000000000)};
            syscall(SYS_futex, k->bell, FUTEX_WAIT, k->bell_seen, &ts, NULL, 0);
            continue;
        }
        account(k, &mark, now);
        if (any_gone(k)) return RETURN_GONE;
        if (draining && !yielded) yielded = holder_yielded(k);
        int holder_wants;
        uint32_t wanting = wanting_slots(k, now, &holder_wants);
        uint32_t others = wanting & ~(1u << k->holder);
        /* The tenant whose turn ends (the holder, or the one that lent it its turn) keeps its claim
         * while it is idle and within its share: the turn it would be picked for is lent at once to
         * those who want the GPU, and its next launch takes it back. Without this a training loop
         * on the host at its turn's end waited out the other tenant's whole turn. */
        int claimant = k->lender >= 0 ? k->lender : k->holder;
        if (k->lender >= 0) set_lender(k, -1, 0);
        uint32_t want_all = wanting | (holder_wants ? 1u << k->holder : 0);
        uint32_t borrowers = want_all & ~(1u << claimant);
        if (borrowers && !(want_all >> claimant & 1) && within_share(k, claimant, want_all | 1u << claimant) &&
            pick(k, want_all | 1u << claimant) == claimant) {
            int borrower = pick(k, borrowers);
            if (borrower != k->holder && yielded) k->yields++;
            if (borrower != k->holder && draining && !yielded && holder_wants) {
                drain(k);
                now = now_ns();
                account(k, &mark, now);
            }
            int64_t end = now + quantum(k, claimant, want_all | 1u << claimant);
            set_lender(k, claimant, end);
            k->lends++;
            grant(k, borrower, borrowers, now, 0);
            set_slice_end(k, end);
            continue;
        }
        if (!others) {
            if (!holder_wants) return RETURN_IDLE; /* nobody wants a turn: the controller decides */
            /* nobody else waits: the holder goes on, and the keeper looks again at its deadline (a
             * tenant that starts waiting meanwhile waits that long, as under the Python loop) */
            grant(k, k->holder, wanting, now, k->return_at);
            continue;
        }
        uint32_t candidates = holder_wants ? wanting | 1u << k->holder : others;
        int next = pick(k, candidates);
        if (next != k->holder && yielded) k->yields++;
        if (next != k->holder && draining && !yielded) {
            drain(k);
            now = now_ns();
            account(k, &mark, now); /* the drain is the old holder's time: its work ran */
        }
        /* the quantum weighs the share against everyone who wants the GPU, the holder too */
        grant(k, next, candidates, now, 0);
    }
}

static int as_long(PyObject *o, long *out) {
    *out = PyLong_AsLong(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int as_i64(PyObject *o, int64_t *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static int as_ptr(PyObject *o, void **out) {
    unsigned long long a = PyLong_AsUnsignedLongLong(o);
    if (a == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (void *)(uintptr_t)a;
    return 0;
}

/* Reads a sequence of `n` floats (or ints) into `out`. */
static int doubles(PyObject *seq, int n, double *out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    int rc = 0;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %d values expected", what, n);
        rc = -1;
    }
    for (int i = 0; rc == 0 && i < n; i++) {
        out[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1.0 && PyErr_Occurred()) rc = -1;
    }
    Py_DECREF(fast);
    return rc;
}

/* Keyword arguments only, named as the keeper's fields: a positional call of this many values is
 * where a swapped pair goes unnoticed. */
static char *KEYWORDS[] = {"gate", "bell", "heartbeat", "bell_seen", "gen", "beside", "holder", "slice_start_ns",
                           "slice_end_ns", "return_ns", "base_slice_ns", "recent_ns", "drain_timeout_ns",
                           "slice_end_word", "grace_ns", "shares", "priorities", "used", "procs", "offsets",
                           "lender_word", "lender", "lend_end_ns", "hold_word", "hold_max_ns", "hold_rate",
                           "hold_credit_ns", "hold_credit_cap_ns", NULL};
#define NARGS 28

#define USAGE \
    "take_turns(*, gate, bell, heartbeat, bell_seen, gen, beside, holder, slice_start_ns, slice_end_ns, " \
    "return_ns, base_slice_ns, recent_ns, drain_timeout_ns, slice_end_word, grace_ns, shares, priorities, " \
    "used, procs=[(slot, pid, page)], offsets, lender_word, lender, lend_end_ns, hold_word, hold_max_ns, " \
    "hold_rate, hold_credit_ns, hold_credit_cap_ns) -> {reason, holder, gen, slice_start_ns, slice_end_ns, " \
    "grants, held_ns, drain_timeouts, yields, lender, lend_end_ns, lends, reclaims, holds, hold_ns, " \
    "hold_credit_ns}"


static PyObject *take_turns(PyObject *self, PyObject *posargs, PyObject *kwargs) {
    PyObject *args[NARGS];
    if (!PyArg_ParseTupleAndKeywords(posargs, kwargs, "|$OOOOOOOOOOOOOOOOOOOOOOOOOOOO:take_turns", KEYWORDS,
                                     &args[0], &args[1], &args[2], &args[3], &args[4], &args[5], &args[6],
                                     &args[7], &args[8], &args[9], &args[10], &args[11], &args[12], &args[13],
                                     &args[14], &args[15], &args[16], &args[17], &args[18], &args[19], &args[20],
                                     &args[21], &args[22], &args[23], &args[24], &args[25], &args[26], &args[27]))
        return NULL;
    if (!kwargs || PyDict_Size(kwargs) != NARGS) {
        PyErr_SetString(PyExc_TypeError, USAGE);
        return NULL;
    }
    keeper_t *k = PyMem_Calloc(1, sizeof *k);
    if (!k) return PyErr_NoMemory();
    PyObject *result = NULL, *procs = NULL, *offsets = NULL;
    long v, holder;
    double priority[MAX_SLOTS];
    if (as_ptr(args[0], (void **)&k->gate) || as_ptr(args[1], (void **)&k->bell) ||
        as_ptr(args[2], (void **)&k->heartbeat))
        goto done;
    if (as_long(args[3], &v)) goto done;
    k->bell_seen = (uint32_t)v;
    if (as_long(args[4], &v)) goto done;
    k->gen = (uint32_t)v & 0xFFFF;
    if (as_long(args[5], &v)) goto done;
    k->beside = (uint32_t)v & OPEN_MASK;
    if (as_long(args[6], &holder)) goto done;
    if (as_i64(args[7], &k->slice_start) || as_i64(args[8], &k->slice_end) || as_i64(args[9], &k->return_at) ||
        as_i64(args[10], &k->base_slice) || as_i64(args[11], &k->recent) || as_i64(args[12], &k->drain_timeout) ||
        as_ptr(args[13], (void **)&k->slice_end_word) || as_i64(args[14], &k->grace))
        goto done;
    if (k->drain_timeout > 0 && !k->slice_end_word) {
        PyErr_SetString(PyExc_ValueError, "draining needs the slice-end word");
        goto done;
    }
    Py_ssize_t nslots = PySequence_Size(args[15]);
    if (nslots < 1 || nslots > MAX_SLOTS) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "between 1 and %d tenants", MAX_SLOTS);
        goto done;
    }
    k->nslots = (int)nslots;
    if (doubles(args[15], k->nslots, k->share, "shares") || doubles(args[16], k->nslots, priority, "priorities") ||
        doubles(args[17], k->nslots, k->used, "used"))
        goto done;
    for (int s = 0; s < k->nslots; s++) k->priority[s] = (long)priority[s];
    if (holder < 0 || holder >= k->nslots) {
        PyErr_SetString(PyExc_ValueError, "holder must be a tenant slot");
        goto done;
    }
    k->holder = (int)holder;
    procs = PySequence_Fast(args[18], "procs must be a sequence of (slot, pid, page address)");
    offsets = PySequence_Fast(args[19], "offsets must be (waiting, window_open, inflight, last_launch_ns, "
                                        "drained, burst_ns)");
    if (!procs || !offsets) goto done;
    if (PySequence_Fast_GET_SIZE(procs) > MAX_PROCS || PySequence_Fast_GET_SIZE(offsets) != 6) {
        PyErr_SetString(PyExc_ValueError, "too many processes, or not six offsets");
        goto done;
    }
    size_t *off[6] = {&k->off_waiting, &k->off_window_open, &k->off_inflight, &k->off_last_launch,
                      &k->off_drained, &k->off_burst};
    for (int i = 0; i < 6; i++) {
        if (as_long(PySequence_Fast_GET_ITEM(offsets, i), &v)) goto done;
        if (v < 0 || v > 4088) {
            PyErr_SetString(PyExc_ValueError, "offsets lie inside a page");
            goto done;
        }
        *off[i] = (size_t)v;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(procs); i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(procs, i);
        long slot, pid;
        void *page;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 3) {
            PyErr_SetString(PyExc_ValueError, "procs must be (slot, pid, page address) triples");
            goto done;
        }
        if (as_long(PyTuple_GET_ITEM(pair, 0), &slot) || as_long(PyTuple_GET_ITEM(pair, 1), &pid) ||
            as_ptr(PyTuple_GET_ITEM(pair, 2), &page))
            goto done;
        if (slot < 0 || slot >= k->nslots) continue; /* not ours: the controller skips it too */
        k->procs[k->nprocs] = (proc_t){(int)slot, (pid_t)pid, page};
        k->nprocs++;
    }
    long lender;
    if (as_ptr(args[20], (void **)&k->lender_word) || as_long(args[21], &lender) || as_i64(args[22], &k->lend_end))
        goto done;
    if (!k->lender_word || lender < -1 || lender >= k->nslots) {
        PyErr_SetString(PyExc_ValueError, "the lender word is needed, and the lender is -1 or a tenant slot");
        goto done;
    }
    k->lender = (int)lender;
    if (as_ptr(args[23], (void **)&k->hold_word) || as_i64(args[24], &k->hold_max) ||
        as_i64(args[26], &k->credit) || as_i64(args[27], &k->credit_cap))
        goto done;
    k->hold_rate = PyFloat_AsDouble(args[25]);
    if (k->hold_rate == -1.0 && PyErr_Occurred()) goto done;
    if (k->hold_max < 0 || k->credit_cap < 0 || !(k->hold_rate >= 0.0 && k->hold_rate <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "hold_max_ns and hold_credit_cap_ns are >= 0, hold_rate in [0, 1]");
        goto done;
    }
    k->credit_at = now_ns();
    int reason;
    Py_BEGIN_ALLOW_THREADS
    reason = keep(k);
    int was_holding = k->holding;
    if (k->holding) { /* the Python loop decides until the next call, which looks at the bursts again */
        count_credit(k, now_ns());
        k->hold_ns += now_ns() - k->hold_since;
        k->holding = 0;
        __atomic_store_n(k->hold_word, 0u, __ATOMIC_RELEASE);
    }
    if (k->drain_timeout > 0) {
        /* the Python loop decides until the next call: no yields meanwhile, and a holder that has
         * yielded is released (its slice goes on until the loop decides otherwise) */
        __atomic_store_n(k->slice_end_word, 0, __ATOMIC_RELEASE);
        set_gate(k, (1u << k->holder) | k->beside, LAUNCHERS_BITSET);
    } else if (was_holding) {
        set_gate(k, (1u << k->holder) | k->beside, LAUNCHERS_BITSET);
    }
    Py_END_ALLOW_THREADS
    PyObject *grants = PyTuple_New(k->nslots), *held = PyTuple_New(k->nslots);
    if (grants && held) {
        for (int s = 0; s < k->nslots; s++) {
            PyTuple_SET_ITEM(grants, s, PyLong_FromUnsignedLong(k->grants[s]));
            PyTuple_SET_ITEM(held, s, PyLong_FromLongLong(k->held[s]));
        }
        result = Py_BuildValue("{s:i,s:i,s:i,s:L,s:L,s:O,s:O,s:k,s:k,s:i,s:L,s:k,s:k,s:k,s:L,s:L}", "reason", reason,
                               "holder", k->holder, "gen", (int)k->gen, "slice_start_ns", (long long)k->slice_start,
                               "slice_end_ns", (long long)k->slice_end, "grants", grants, "held_ns", held,
                               "drain_timeouts", k->drain_timeouts, "yields", k->yields, "lender", k->lender,
                               "lend_end_ns", (long long)k->lend_end, "lends", k->lends, "reclaims", k->reclaims,
                               "holds", k->holds, "hold_ns", (long long)k->hold_ns, "hold_credit_ns",
                               (long long)k->credit);
    }
    Py_XDECREF(grants);
    Py_XDECREF(held);
done:
    Py_XDECREF(procs);
    Py_XDECREF(offsets);
    PyMem_Free(k);
    return result;
}

static PyObject *py_helper_wake_bit(PyObject *self, PyObject *arg) {
    long pid = PyLong_AsLong(arg);
    if (pid == -1 && PyErr_Occurred()) return NULL;
    if (pid < 0 || pid > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a pid is between 0 and 2**31 - 1");
        return NULL;
    }
    return PyLong_FromUnsignedLong(helper_wake_bit((int32_t)pid));
}

static PyMethodDef methods[] = {
    {"take_turns", (PyCFunction)(void (*)(void))take_turns, METH_VARARGS | METH_KEYWORDS, USAGE},
    {"helper_wake_bit", py_helper_wake_bit, METH_O,
     "helper_wake_bit(pid) -> the futex bit the helper thread of process `pid` sleeps with on the gate"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_turns", NULL, -1, methods};

PyMODINIT_FUNC PyInit__turns(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "RETURN_DEADLINE", RETURN_DEADLINE) ||
        PyModule_AddIntConstant(m, "RETURN_BELL", RETURN_BELL) || PyModule_AddIntConstant(m, "RETURN_IDLE", RETURN_IDLE) ||
        PyModule_AddIntConstant(m, "RETURN_GONE", RETURN_GONE) || PyModule_AddIntConstant(m, "QUIET_NS", QUIET_NS)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
