#define _GNU_SOURCE
// toku DIR TOTAL THREADS: tokubench-like: 200-byte files, 128 per directory, THREADS processes, then sync
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
int main(int argc, char **argv) {
  const char *root = argv[1]; long total = atol(argv[2]); int threads = atoi(argv[3]);
  char buf[200]; memset(buf, 'x', sizeof buf);
  struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
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
        int fd = open(path, O_CREAT | O_WRONLY | O_TRUNC, 0644);
        if (fd < 0) { perror(path); _exit(1); }
        if (write(fd, buf, sizeof buf) != sizeof buf) { perror("write"); _exit(1); }
        close(fd);
      }
      _exit(0);
    }
  }
  int st; while (wait(&st) > 0) {}
  int fd = open(root, O_RDONLY); syncfs(fd); close(fd); /* needs _GNU_SOURCE */
  clock_gettime(CLOCK_MONOTONIC, &b);
  double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
  printf("%ld files %.2f s %.0f files/s\n", total, s, total / s);
  return 0;
}
