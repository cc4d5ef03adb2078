#define _GNU_SOURCE
// toku DIR TOTAL THREADS: tokubench-like: 200-byte files, 128 per directory, THREADS
// processes, then syncfs. Prints files/s and, over all processes' open, write and close
// calls, the p99, p99.9 and longest call in ms: what a client waited, queueing in a FUSE
// daemon included (docs/benchmarks/request-wait.md).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

#define BUCKETS 200000 /* 1 us each: up to 200 ms, longer calls in the last */

static unsigned long *hist;

static double now_us(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void note(double start) {
  long us = (long)(now_us() - start);
  if (us >= BUCKETS) us = BUCKETS - 1;
  __atomic_fetch_add(&hist[us], 1, __ATOMIC_RELAXED);
}

static double quantile(double q, unsigned long total) {
  unsigned long rank = (unsigned long)(q * total), seen = 0;
  for (long i = 0; i < BUCKETS; i++) { seen += hist[i]; if (seen > rank) return (i + 1) / 1e3; }
  return BUCKETS / 1e3;
}

int main(int argc, char **argv) {
  if (argc != 4) { fprintf(stderr, "usage: toku DIR TOTAL THREADS\n"); return 2; }
  const char *root = argv[1]; long total = atol(argv[2]); int threads = atoi(argv[3]);
  hist = mmap(NULL, BUCKETS * sizeof *hist, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (hist == MAP_FAILED) { perror("mmap"); return 1; }
  char buf[200]; memset(buf, 'x', sizeof buf);
  double a = now_us();
  long per = (total + threads - 1) / threads;
  for (int t = 0; t < threads; t++) {
    if (fork() == 0) {
      char path[512];
      for (long i = t * per; i < (t + 1) * per && i < total; i++) {
        long d = i / 128;
        if (i == t * per || i % 128 == 0) {
          snprintf(path, sizeof path, "%s/d%03ld", root, d / 128); mkdir(path, 0755);
          snprintf(path, sizeof path, "%s/d%03ld/d%05ld", root, d / 128, d); mkdir(path, 0755);
        }
        snprintf(path, sizeof path, "%s/d%03ld/d%05ld/f%07ld", root, d / 128, d, i);
        double s = now_us();
        int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0644);
        note(s);
        if (fd < 0) { perror(path); _exit(1); }
        s = now_us();
        if (write(fd, buf, sizeof buf) != sizeof buf) { perror("write"); _exit(1); }
        note(s);
        s = now_us();
        close(fd);
        note(s);
      }
      _exit(0);
    }
  }
  int st; while (wait(&st) > 0) {}
  int fd = open(root, O_RDONLY); syncfs(fd); close(fd);
  double secs = (now_us() - a) / 1e6;
  unsigned long calls = 0; long longest = 0;
  for (long i = 0; i < BUCKETS; i++) if (hist[i]) { calls += hist[i]; longest = i; }
  printf("%ld files %.2f s %.0f files/s | calls %lu p99 %.3f p99.9 %.3f longest %.3f ms\n",
         total, secs, total / secs, calls, quantile(0.99, calls), quantile(0.999, calls), (longest + 1) / 1e3);
  return 0;
}
