/* The streaming copy's source prefetch, measured alone (README, "Prefetching the shared map's
 * source"): one process copies runs of RUN bytes from scattered offsets of a written 256 MiB
 * memfd (4 KiB pages, as a prefill rank's buffer) into a huge-page-backed 64 MiB buffer for
 * SECONDS, with statebridge's AVX2 streaming loop prefetching PF bytes ahead into L2 (PF 0: no
 * prefetch; MODE 1: rep movsb, MODE 2: memcpy, for comparison). Run two at once for both cores:
 *
 *   gcc -O2 -mavx2 -DHINT=_MM_HINT_T1 benchmarks/copy_prefetch.c -o /tmp/copy_prefetch
 *   for pf in 0 3072; do /tmp/copy_prefetch 3145728 0 $pf 3 & /tmp/copy_prefetch 3145728 0 $pf 3; wait; done
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <time.h>
#include <stdint.h>
#ifndef HINT
#define HINT _MM_HINT_T1
#endif
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void nt_copy(char *d, const char *s, size_t n, size_t pf)
{
    size_t head = (32 - ((uintptr_t)d & 31)) & 31; if (head > n) head = n;
    memcpy(d, s, head); size_t i = head;
    for (; i + 256 <= n; i += 256) {
        if (pf && i + pf < n) { _mm_prefetch(s+i+pf, HINT); _mm_prefetch(s+i+pf+64, HINT); _mm_prefetch(s+i+pf+128, HINT); _mm_prefetch(s+i+pf+192, HINT);}
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        __m256i f = _mm256_loadu_si256((const __m256i *)(s + i + 128));
        __m256i g = _mm256_loadu_si256((const __m256i *)(s + i + 160));
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i + 192));
        __m256i k = _mm256_loadu_si256((const __m256i *)(s + i + 224));
        _mm256_stream_si256((__m256i *)(d + i), a); _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c); _mm256_stream_si256((__m256i *)(d + i + 96), e);
        _mm256_stream_si256((__m256i *)(d + i + 128), f); _mm256_stream_si256((__m256i *)(d + i + 160), g);
        _mm256_stream_si256((__m256i *)(d + i + 192), h); _mm256_stream_si256((__m256i *)(d + i + 224), k);
    }
    _mm_sfence(); if (i < n) memcpy(d + i, s + i, n - i);
}
static void movsb(char*d,const char*s,size_t n){__asm__ volatile("rep movsb":"+D"(d),"+S"(s),"+c"(n)::"memory");}
int main(int argc,char**argv){
  if(argc<5){fprintf(stderr,"usage: %s RUN MODE PF SECONDS\n",argv[0]);return 2;}
  size_t SRC=256<<20, DST=64<<20, run=atol(argv[1]); int mode=atoi(argv[2]); size_t pf=atol(argv[3]); double secs=atof(argv[4]);
  int fd=memfd_create("x",0); ftruncate(fd,SRC);
  char*s=mmap(0,SRC,PROT_READ|PROT_WRITE,MAP_SHARED,fd,0); memset(s,9,SRC);
  char*d=aligned_alloc(2<<20,DST); madvise(d,DST,MADV_HUGEPAGE); memset(d,1,DST);
  size_t nsrc=SRC/run, ndst=DST/run; unsigned long long bytes=0; double t0=now(); size_t k=0;
  while(now()-t0<secs){ for(int r=0;r<20;r++){ size_t so=((k*7919)%nsrc)*run, dof=((k*31)%ndst)*run; k++;
     if(mode==0) nt_copy(d+dof,s+so,run,pf); else if(mode==1) movsb(d+dof,s+so,run); else memcpy(d+dof,s+so,run); bytes+=run;}}
  double t=now()-t0; printf("run=%zu mode=%d pf=%zu %.2f GB/s\n",run,mode,pf,bytes/t/1e9); return 0;}
