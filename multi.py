import http.client, time, threading, sys, math, random
W,L,P=2000,5,500
key=sys.argv[1]; ports=[int(p) for p in sys.argv[2].split(",")]; dur=float(sys.argv[3]); nthreads=int(sys.argv[4])
costs=list(map(int,sys.argv[5].split(","))) if len(sys.argv)>5 else [1]
adm=[]; lock=threading.Lock(); stat={}
def worker(port):
    c=http.client.HTTPConnection("127.0.0.1",port)
    end=time.time()+dur
    while time.time()<end:
        cost=random.choice(costs)
        t0=time.time()*1000
        c.request("GET","/",headers={"x-k":key,"x-cost":str(cost)})
        r=c.getresponse(); r.read(); t1=time.time()*1000
        with lock:
            stat[r.status]=stat.get(r.status,0)+1
            if r.status==200: adm.append((t0,t1,cost))
        time.sleep(random.uniform(0,0.02))
ts=[threading.Thread(target=worker,args=(ports[i%len(ports)],)) for i in range(nthreads)]
[t.start() for t in ts]; [t.join() for t in ts]
adm.sort()
worst=0
for i in range(len(adm)):
    tot=0
    for j in range(i,len(adm)):
        if adm[j][1]-adm[i][0] < W: tot+=adm[j][2]
        else: break
    worst=max(worst,tot)
    if tot> L: print("OVER", tot, adm[i])
# sanity: also admitted per bucket-aligned
print("stat",stat,"admitted units",sum(a[2] for a in adm),"worst span",worst, "expected max ~", L*dur*1000/W)
