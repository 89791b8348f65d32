/* gpuscope share: what the preload library's two parts share. _preload.c joins the controller and
 * gates launches; _memory.c holds allocations to the tenant's memory cap and reports the cap as the
 * card's size. Built with -fvisibility=hidden: none of this is exported from the library. */
#ifndef GPUSCOPE_SHARE_PRELOAD_H
#define GPUSCOPE_SHARE_PRELOAD_H

#include <stdatomic.h>
#include <stdint.h>

#include "_ledger.h"

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef void *(*dlsym_fn)(void *, const char *);

/* One GPU as this process sees it (by the ordinal of its context's device): the part of each
 * device's state both files read (_preload.c keeps the rest beside it). */
typedef struct {
    policy_t *policy;         /* NULL until joined */
    proc_t *proc;             /* this process's page (a local one when not joined) */
    tenant_mem_t *tenant_mem; /* its tenant's memory page (NULL when not joined) */
    uint32_t slot_bit;        /* 1 << its tenant's slot */
    int ordinal;              /* the device's CUdevice in this process */
} share_dev_t;

extern dlsym_fn real_dlsym;

/* The device of the calling thread's current context, joined to its controller at the first call
 * that needs it (and from then on the device the thread's other calls into _preload.c work on). */
share_dev_t *share_here(void);
share_dev_t *share_device(int ordinal); /* by ordinal (an allocation freed in another context) */
share_dev_t *share_on(int ordinal);     /* by ordinal, joined (-1: share_here) */
void find_real_dlsym(void);
void *driver_symbol(const char *name);  /* from libcuda.so.1, never a hook */
void say(const char *fmt, ...);         /* one line on stderr (or GPUSCOPE_SHARE_FD) */

/* _memory.c: the hook for a memory or NVML entry point `symbol` (an exported name, or the base name
 * cuGetProcAddress is asked for, `flags` its flags), keeping `p` as the real one; `p` itself for any
 * other symbol. */
void *memory_wrap(const char *symbol, uint64_t flags, void *p);
/* _memory.c: a process that joins (or joins again, after a controller restart) brings what it holds
 * from its old page to the new one and to its tenant's count. */
void memory_carry(tenant_mem_t *tenant, proc_t *new_proc, const proc_t *old_proc);

#endif
