# opdiff.py BEFORE AFTER: per-request counts and time in the daemon between two `betreefs stats` snapshots.
import json,sys
a=json.load(open(sys.argv[1]))['fuse']; b=json.load(open(sys.argv[2]))['fuse']
for k,v in b.items():
  if isinstance(v,dict) and 'count' in v:
    c=v['count']-a.get(k,{}).get('count',0); n=v['nanos']-a.get(k,{}).get('nanos',0)
    if c: print(f"{k:14} {c:8} {n/c/1000:8.2f} us {n/1e9:7.3f} s")
