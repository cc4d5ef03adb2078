#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>
#include <time.h>
static const char *root; static int total; static int NT=2;
static void *work(void *a){ long t=(long)a; int per=(total+NT-1)/NT; int first=t*per, last=(t+1)*per; if(last>total) last=total;
 char buf[200]; memset(buf,'a',200); char p[512];
 for(int i=first;i<last;i++){ int a1=i/(128*128), a2=(i/128)%128, f=i%128;
  if(i==first||i%128==0){ snprintf(p,sizeof p,"%s/d%d",root,a1); mkdir(p,0755); snprintf(p,sizeof p,"%s/d%d/d%d",root,a1,a2); mkdir(p,0755);}
  snprintf(p,sizeof p,"%s/d%d/d%d/f%d",root,a1,a2,f); int fd=open(p,O_CREAT|O_WRONLY|O_TRUNC,0644); if(fd<0){perror(p);exit(1);} if(write(fd,buf,200)!=200) exit(1); close(fd);} return 0;}
int main(int c,char**v){ root=v[1]; total=atoi(v[2]); struct timespec s,e; clock_gettime(CLOCK_MONOTONIC,&s);
 NT=getenv("NT")?atoi(getenv("NT")):2; pthread_t th[8]; for(long t=0;t<NT;t++) pthread_create(&th[t],0,work,(void*)t); for(int t=0;t<NT;t++) pthread_join(th[t],0); clock_gettime(CLOCK_MONOTONIC,&e); printf("before sync %.2fs\n",(e.tv_sec-s.tv_sec)+(e.tv_nsec-s.tv_nsec)/1e9); sync();
 clock_gettime(CLOCK_MONOTONIC,&e); double d=(e.tv_sec-s.tv_sec)+(e.tv_nsec-s.tv_nsec)/1e9; printf("%d files %.2fs %.0f files/s\n",total,d,total/d); }
