/* gpuscope share: the futex bitsets that threads sleep with on the ledger's gate word, shared by the
 * preload library (the sleepers) and the controller's turn keeper (the waker), so that a gate write
 * wakes only the threads it concerns.
 *
 * A tenant's launching threads held at the gate sleep with LAUNCHERS_BITSET: a grant wakes them. Each
 * process's helper thread sleeps with a bit of its own, derived from its pid: a draining hand-over
 * wakes only the old holder's helpers, which post its queued work; waking every helper there cost
 * each other tenant's helper a wake-up per hand-over for nothing. Two processes whose bits collide
 * (31 bits) only wake each other now and then. The pid is the one the process writes in its ledger
 * page (its own getpid()), which is also the one the controller reads, pid namespaces or not.
 */
#ifndef GPUSCOPE_SHARE_WAKE_BITS_H
#define GPUSCOPE_SHARE_WAKE_BITS_H

#include <stdint.h>

#define LAUNCHERS_BITSET 1u

/* A slice holder with nothing queued that has not launched for this long, after its work finished or
 * its program's wait for the GPU returned, is quiet: its helper rings, and the keeper lends the rest
 * of its turn (a program that syncs and launches again within microseconds, a matmul loop, is not
 * quiet). Shorter lends more of a training step's host work; each lend taken back costs the lender
 * the borrower's queued work (LENT_WINDOW_US at most twice) and two wake-ups. ledger.QUIET_NS is
 * this value for the Python loop (a test holds them equal). */
#define QUIET_NS 300000

static inline uint32_t helper_wake_bit(int32_t pid) { return 1u << (1 + (uint32_t)pid % 31u); }

#endif
