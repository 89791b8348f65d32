/* A program linked against libcuda (the fake one): its launches reach the preload library by symbol
 * interposition alone. Prints the library's launch counter, or -1 without the library. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shm, void *s, void **p, void **e);

int main(void) {
    for (unsigned i = 0; i < 10; i++)
        if (cuLaunchKernel(NULL, 1000 + i, 1, 1, 5, 1, 1, 0, (void *)(uintptr_t)7, NULL, NULL) != 0) return 1;
    void (*stats)(uint64_t *) = (void (*)(uint64_t *))dlsym(RTLD_DEFAULT, "gpuscope_share_stats");
    uint64_t out[8] = {0};
    if (stats) stats(out);
    printf("%lld\n", stats ? (long long)out[0] : -1LL);
    return 0;
}
