// Diagnostic (session 17): what a 1 MiB scatter of 4 KiB pieces costs on this host, by store
// kind (memcpy or the streaming stores of src/shell/copy/kernels.rs), hot or cold caches, on the
// calling thread or handed to one or two parked workers, and what a hand-off alone costs.
//   gcc -O2 -pthread -static -o copybw benches/diag/copybw.c && ./copybw [KiB, default 1024]
#define _GNU_SOURCE
#include <emmintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static void stream_copy(const uint8_t*s,uint8_t*d,size_t n){for(size_t o=0;o<n;o+=64){__m128i a=_mm_loadu_si128((const __m128i*)(s+o)),b=_mm_loadu_si128((const __m128i*)(s+o+16)),c=_mm_loadu_si128((const __m128i*)(s+o+32)),e=_mm_loadu_si128((const __m128i*)(s+o+48));_mm_stream_si128((__m128i*)(d+o),a);_mm_stream_si128((__m128i*)(d+o+16),b);_mm_stream_si128((__m128i*)(d+o+32),c);_mm_stream_si128((__m128i*)(d+o+48),e);}_mm_sfence();}
#define PIECE 4096
static uint8_t *arena,*dst; static size_t npieces; static size_t *perm;
static void scatter(size_t from,size_t to,int nt){for(size_t i=from;i<to;i++){uint8_t*d=dst+perm[i]*2*PIECE;if(nt)stream_copy(arena+i*PIECE,d,PIECE);else memcpy(d,arena+i*PIECE,PIECE);}}
typedef struct{size_t from,to;int nt;volatile int go;volatile int done;pthread_mutex_t m;pthread_cond_t c;}W;
static void* worker(void*p){W*w=p;for(;;){pthread_mutex_lock(&w->m);while(!w->go)pthread_cond_wait(&w->c,&w->m);w->go=0;pthread_mutex_unlock(&w->m);if(w->to==(size_t)-1)return 0;scatter(w->from,w->to,w->nt);pthread_mutex_lock(&w->m);w->done=1;pthread_cond_signal(&w->c);pthread_mutex_unlock(&w->m);}}
static void kick(W*w){pthread_mutex_lock(&w->m);w->done=0;w->go=1;pthread_cond_signal(&w->c);pthread_mutex_unlock(&w->m);}
static void wait_done(W*w){pthread_mutex_lock(&w->m);while(!w->done)pthread_cond_wait(&w->c,&w->m);pthread_mutex_unlock(&w->m);}
static int cmpd(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  size_t total=(argc>1?atol(argv[1]):1024)*1024; npieces=total/PIECE; int reps=200;
  arena=aligned_alloc(4096,total); dst=aligned_alloc(4096,2*total+4096); perm=malloc(npieces*sizeof *perm);
  memset(arena,1,total); memset(dst,0,2*total+4096);
  for(size_t i=0;i<npieces;i++)perm[i]=i; srand(1); for(size_t i=npieces-1;i>0;i--){size_t j=rand()%(i+1),t=perm[i];perm[i]=perm[j];perm[j]=t;}
  double *t=malloc(reps*sizeof(double));
  printf("%ld cpus; scatter of %zu KiB in 4 KiB pieces into a %zu KiB buffer, p50 of %d (us)\n",sysconf(_SC_NPROCESSORS_ONLN),total>>10,(2*total)>>10,reps);
  for(int nt=0;nt<2;nt++){
    for(int r=0;r<reps;r++){double a=now();scatter(0,npieces,nt);t[r]=now()-a;} qsort(t,reps,sizeof(double),cmpd);
    printf("  same thread, %s: %.1f us (%.2f GB/s)\n",nt?"streaming":"memcpy",t[reps/2],total/t[reps/2]/1e3);
  }
  // cold arena: flush by touching a 64 MiB buffer in between
  size_t big=64<<20; uint8_t*junk=malloc(big); memset(junk,2,big);
  for(int nt=0;nt<2;nt++){
    for(int r=0;r<40;r++){memset(junk,r,big);double a=now();scatter(0,npieces,nt);t[r]=now()-a;} qsort(t,40,sizeof(double),cmpd);
    printf("  same thread, cold caches, %s: %.1f us\n",nt?"streaming":"memcpy",t[20]);
  }
  W w[2]; pthread_t th[2];
  for(int i=0;i<2;i++){memset(&w[i],0,sizeof w[i]);pthread_mutex_init(&w[i].m,0);pthread_cond_init(&w[i].c,0);pthread_create(&th[i],0,worker,&w[i]);}
  // hand-off cost: empty job
  for(int r=0;r<reps;r++){w[0].from=w[0].to=0;usleep(200);double a=now();kick(&w[0]);wait_done(&w[0]);t[r]=now()-a;} qsort(t,reps,sizeof(double),cmpd);
  printf("  empty job to a parked worker and back (after 200 us idle): p50 %.1f us p90 %.1f\n",t[reps/2],t[reps*9/10]);
  for(int nt=0;nt<2;nt++){
    for(int r=0;r<reps;r++){w[0].from=0;w[0].to=npieces;w[0].nt=nt;usleep(200);double a=now();kick(&w[0]);wait_done(&w[0]);t[r]=now()-a;} qsort(t,reps,sizeof(double),cmpd);
    printf("  one worker, %s (after 200 us idle): %.1f us\n",nt?"streaming":"memcpy",t[reps/2]);
    for(int r=0;r<reps;r++){w[0].from=0;w[0].to=npieces/2;w[1].from=npieces/2;w[1].to=npieces;w[0].nt=w[1].nt=nt;usleep(200);double a=now();kick(&w[0]);kick(&w[1]);wait_done(&w[0]);wait_done(&w[1]);t[r]=now()-a;} qsort(t,reps,sizeof(double),cmpd);
    printf("  two workers, %s (after 200 us idle): %.1f us\n",nt?"streaming":"memcpy",t[reps/2]);
  }
  return 0;}
