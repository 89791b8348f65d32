/* A stand-in libnvidia-ml.so.1 for the memory-cap tests: one device whose memory is
 * FAKE_CUDA_MEM_TOTAL bytes (default 80 GiB, as the fake libcuda), FAKE_NVML_USED of them in use
 * (default 0). Prototypes and structs follow nvml.h. */
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

static unsigned long long env_u64(const char *name, unsigned long long fallback) {
    const char *v = getenv(name);
    return v ? strtoull(v, NULL, 10) : fallback;
}

static int device_token;
int nvmlInit_v2(void) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void **device) {
    if (index != 0) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    *device = &device_token;
    return 0;
}
int nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *m) {
    (void)device;
    m->total = env_u64("FAKE_CUDA_MEM_TOTAL", 80ull << 30);
    m->used = env_u64("FAKE_NVML_USED", 0);
    m->free = m->total - m->used;
    return 0;
}
int nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *m) {
    (void)device;
    m->total = env_u64("FAKE_CUDA_MEM_TOTAL", 80ull << 30);
    m->reserved = 1ull << 28;
    m->used = env_u64("FAKE_NVML_USED", 0);
    m->free = m->total - m->used - m->reserved;
    return 0;
}
