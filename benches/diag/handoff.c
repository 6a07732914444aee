// Diagnostic (session 17) for the bounce path's copies on one host: a "writer" thread (standing
// for UCX's cma write into the target's arena) fills a 1 MiB region, then a "scatterer" thread on
// another CPU scatters it in 4 KiB pieces; regions either reused (the same 1 MiB each time) or
// swept through a 256 MiB arena (next-fit placement). Also the gather into a reused or swept
// staging region.   gcc -O2 -pthread -static -o handoff benches/diag/handoff.c && ./handoff
#define _GNU_SOURCE
#include <emmintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#define PIECE 4096
#define CHUNK (1u<<20)
#define ARENA (256u<<20)
#define NP (CHUNK/PIECE)
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static void stream_copy(const uint8_t*s,uint8_t*d,size_t n){for(size_t o=0;o<n;o+=64){__m128i a=_mm_loadu_si128((const __m128i*)(s+o)),b=_mm_loadu_si128((const __m128i*)(s+o+16)),c=_mm_loadu_si128((const __m128i*)(s+o+32)),e=_mm_loadu_si128((const __m128i*)(s+o+48));_mm_stream_si128((__m128i*)(d+o),a);_mm_stream_si128((__m128i*)(d+o+16),b);_mm_stream_si128((__m128i*)(d+o+32),c);_mm_stream_si128((__m128i*)(d+o+48),e);}_mm_sfence();}
static uint8_t *arena,*src,*dst,*gsrc; static size_t perm[NP];
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);sched_setaffinity(0,sizeof s,&s);}
static atomic_int phase; static size_t roff; static int nt, wcpu, scpu; static double wt, st;
static void* writer(void*p){(void)p;pin(wcpu);for(;;){while(atomic_load(&phase)!=1){if(atomic_load(&phase)<0)return 0;}
  double a=now();memcpy(arena+roff,src,CHUNK);wt=now()-a;atomic_store(&phase,2);}}
static void* scatterer(void*p){(void)p;pin(scpu);for(;;){while(atomic_load(&phase)!=2){if(atomic_load(&phase)<0)return 0;}
  double a=now();for(size_t i=0;i<NP;i++){uint8_t*d=dst+perm[i]*2*PIECE;if(nt)stream_copy(arena+roff+i*PIECE,d,PIECE);else memcpy(d,arena+roff+i*PIECE,PIECE);}st=now()-a;atomic_store(&phase,0);}}
static int cmpd(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
#define R 101
int main(int argc,char**argv){
  int ncpu=sysconf(_SC_NPROCESSORS_ONLN);
  arena=mmap(0,ARENA,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); madvise(arena,ARENA,MADV_HUGEPAGE); memset(arena,0,ARENA);
  src=aligned_alloc(4096,CHUNK);memset(src,3,CHUNK); dst=aligned_alloc(4096,2*CHUNK);memset(dst,0,2*CHUNK);
  gsrc=aligned_alloc(4096,2*CHUNK);memset(gsrc,5,2*CHUNK);
  for(size_t i=0;i<NP;i++)perm[i]=i; srand(1); for(size_t i=NP-1;i>0;i--){size_t j=rand()%(i+1),t=perm[i];perm[i]=perm[j];perm[j]=t;}
  printf("%d cpus; 1 MiB chunk, 4 KiB pieces, p50 of %d (us)\n",ncpu,R);
  // gather into staging: reused vs swept
  for(int sweep=0;sweep<2;sweep++){double t[R];pin(0);size_t off=0;for(int r=0;r<R;r++){off=sweep?(off+4*CHUNK)%ARENA:0;double a=now();for(size_t i=0;i<NP;i++)memcpy(arena+off+i*PIECE,gsrc+perm[i]*2*PIECE,PIECE);t[r]=now()-a;}
    qsort(t,R,sizeof(double),cmpd);printf("  gather 1 MiB into %s staging: %.1f us\n",sweep?"swept":"reused",t[R/2]);}
  int others[]={0,1,2,ncpu/4,ncpu/2,ncpu/2+1,ncpu-1};
  pthread_t a,b;
  for(size_t k=1;k<sizeof others/sizeof *others;k++){
    wcpu=0;scpu=others[k]; if(scpu>=ncpu||(k>1&&scpu==others[k-1]))continue;
    atomic_store(&phase,0);pthread_create(&a,0,writer,0);pthread_create(&b,0,scatterer,0);
    for(int sweep=0;sweep<2;sweep++)for(nt=0;nt<2;nt++){double w[R],s[R];size_t off=0;
      for(int r=0;r<R;r++){off=sweep?(off+CHUNK)%ARENA:0;roff=off;atomic_store(&phase,1);while(atomic_load(&phase)!=0);w[r]=wt;s[r]=st;usleep(50);}
      qsort(w,R,sizeof(double),cmpd);qsort(s,R,sizeof(double),cmpd);
      printf("  writer cpu 0 -> scatterer cpu %2d, %s region, %s scatter: write %6.1f us, scatter %6.1f us\n",scpu,sweep?"swept ":"reused",nt?"streaming":"memcpy   ",w[R/2],s[R/2]);}
    atomic_store(&phase,-1);pthread_join(a,0);pthread_join(b,0);
  }
  return 0;}
