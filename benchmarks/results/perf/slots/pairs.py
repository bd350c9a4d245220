# Per-pair new/old ratios of ab.sh printouts (overhead, output phase, step, forward), and each side sorted.
# usage: pairs.py FILE...
import re, statistics, sys
for f in sys.argv[1:]:
    rows=[]
    for line in open(f):
        w=line.split()[0]
        ov=float(re.search(r"overhead\(med diff\) (\d+)",line).group(1)); out=float(re.search(r"output ([\d.]+)",line).group(1)); st=float(re.search(r"step (\d+)",line).group(1))
        fw=float(re.search(r"forward (\d+)",line).group(1))
        rows.append((w,ov,out,st,fw))
    pairs=[rows[i:i+2] for i in range(0,len(rows),2)]
    r={k:[] for k in ("overhead","output","step","forward")}
    for p in pairs:
        d={w:(ov,out,st,fw) for w,ov,out,st,fw in p}
        for i,k in enumerate(r): r[k].append(d['new'][i]/d['old'][i])
    print(f)
    for k,v in r.items(): print(f"  {k} new/old", " ".join(f"{x:.2f}" for x in v), "median", round(statistics.median(v),3))
    for w in ("old","new"):
        print("  ", w, "overhead", sorted(r[1] for r in rows if r[0]==w), "output", sorted(r[2] for r in rows if r[0]==w),
              "forward", sorted(r[4] for r in rows if r[0]==w))
