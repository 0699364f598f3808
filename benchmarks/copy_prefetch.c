/* The streaming copy's source prefetch, measured alone (docs/measurements.md, "Prefetching the
 * shared map's source"): statebridge's own nt_copy (statebridge/connector/data/shared/_copy.c, included
 * below) built with another PREFETCH_AHEAD (0: no prefetch) or PREFETCH_HINT copies runs of
 * RUN bytes from scattered offsets of a written 256 MiB memfd (4 KiB pages, as a prefill
 * rank's buffer) into a huge-page-backed 64 MiB buffer for SECONDS and prints GB/s. Run two at
 * once for both cores:
 *
 *   for pf in 0 3072; do
 *     gcc -O2 $(python3-config --includes) -DPREFETCH_AHEAD=$pf benchmarks/copy_prefetch.c \
 *         $(python3-config --embed --ldflags) -o /tmp/copy_prefetch_$pf
 *     /tmp/copy_prefetch_$pf 3145728 3 & /tmp/copy_prefetch_$pf 3145728 3; wait
 *   done
 */
#define _GNU_SOURCE
#include "../statebridge/connector/data/shared/_copy.c"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s RUN SECONDS\n", argv[0]);
        return 2;
    }
    size_t src_bytes = (size_t)256 << 20, dst_bytes = (size_t)64 << 20;
    size_t run = strtoull(argv[1], NULL, 10);
    double seconds = atof(argv[2]);
    if (run == 0 || run > dst_bytes) {
        fprintf(stderr, "RUN must be 1 to %zu bytes\n", dst_bytes);
        return 2;
    }
    if (!have_avx2()) {
        fprintf(stderr, "no AVX2: statebridge copies with memcpy here\n");
        return 1;
    }
    int fd = memfd_create("copy-prefetch", 0);
    if (fd < 0 || ftruncate(fd, src_bytes) != 0)
        return perror("memfd"), 1;
    char *src = mmap(NULL, src_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    char *dst = aligned_alloc(2 << 20, dst_bytes);
    if (src == MAP_FAILED || dst == NULL)
        return perror("buffers"), 1;
    madvise(dst, dst_bytes, MADV_HUGEPAGE);
    memset(src, 9, src_bytes);
    memset(dst, 1, dst_bytes);
    size_t nsrc = src_bytes / run, ndst = dst_bytes / run, k = 0;
    unsigned long long moved = 0;
    double t0 = now();
    while (now() - t0 < seconds) {
        for (int r = 0; r < 20; r++, k++) {
            nt_copy(dst + (k * 31 % ndst) * run, src + (k * 7919 % nsrc) * run, run);
            moved += run;
        }
    }
    printf("run=%zu prefetch_ahead=%d %.2f GB/s\n", run, PREFETCH_AHEAD,
           moved / (now() - t0) / 1e9);
    return 0;
}
