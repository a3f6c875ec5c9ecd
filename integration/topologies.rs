//! Past one Redis: a real 3-master Redis Cluster made with
//! `redis-cli --cluster create`, and a master/replica pair watched by a real
//! Sentinel that fails over when the master is killed.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use http::StatusCode;

use crate::common::*;
use crate::envoy::descriptor;

static CALLER: AtomicUsize = AtomicUsize::new(0);

/// Admissions a fresh caller gets on `path` before a 429.
async fn admitted(tg: &Tollgate, path: &str, headers: &[(&str, &str)]) -> usize {
    let c = client();
    let ip = format!(
        "10.{}.{}.1",
        CALLER.fetch_add(1, Ordering::SeqCst) / 250,
        CALLER.load(Ordering::SeqCst) % 250
    );
    let mut all: Vec<(&str, &str)> = vec![("x-forwarded-for", &ip)];
    all.extend_from_slice(headers);
    for n in 0..20 {
        if get(&c, &tg.url(path), &all).await.status != StatusCode::OK {
            return n;
        }
    }
    20
}

fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let started = Instant::now();
    while !ok() {
        assert!(started.elapsed() < limit, "{what} not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

const CLUSTER_LIMITS: &str = "\
domain: cl
rules:
  - name: wide
    match: { path: /a/* }
    by: [client_ip]
    limits: [{ requests: 5, per: 60s }]
  - name: narrow
    match: { path: /a/x }
    by: [client_ip]
    limits: [{ requests: 2, per: 60s }]
  - name: per-key
    match: { path: /k }
    by: [\"header:x-key\"]
    limits: [{ requests: 4, per: 60s }]
  - name: race-shared
    match: { path: /race/* }
    by: [\"header:x-shared\"]
    limits: [{ requests: 10, per: 1h }]
  - name: race-own
    match: { path: /race/both }
    by: [\"header:x-own\"]
    limits: [{ requests: 10, per: 1h }]
  - name: per-ip
    match: { path: /k }
    by: [client_ip]
    limits: [{ requests: 2, per: 60s }]
  - name: daily
    match: { path: /q }
    by: [client_ip]
    limits: [{ requests: 3, per: 1d, precision: 1m }, { requests: 10, per: 60s }]
  - name: resharded
    match: { path: /m }
    by: [client_ip]
    failure_mode: closed
    limits: [{ requests: 3, per: 60s, precision: 1s }, { requests: 100, per: 10s }]
";

/// A Redis Cluster of `n` nodes made by `redis-cli --cluster create`, with
/// `replicas` replicas per master, in a good state; and its node addresses.
fn cluster(n: usize, replicas: usize, node_timeout_ms: u32) -> (Vec<RedisServer>, Vec<String>) {
    let timeout = node_timeout_ms.to_string();
    let nodes: Vec<RedisServer> = (0..n)
        .map(|_| {
            let bus = free_port().to_string();
            RedisServer::start_with(&[
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                &bus,
                "--cluster-node-timeout",
                &timeout,
            ])
        })
        .collect();
    let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
    let out = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    wait_until("cluster_state:ok", Duration::from_secs(10), || {
        nodes.iter().all(|n| {
            n.cli(&["CLUSTER", "INFO"])
                .is_some_and(|i| i.contains("cluster_state:ok"))
        })
    });
    (nodes, addrs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_of_three_masters() {
    let (nodes, addrs) = cluster(3, 0, 2000);

    let upstream = TestUpstream::start().await;
    let seeds = format!("redis://{},redis://{}", addrs[0], addrs[1]);
    let tg = Tollgate::start(
        CLUSTER_LIMITS,
        upstream.addr,
        &[
            "--redis-mode",
            "cluster",
            "--redis",
            &seeds,
            "--redis-timeout",
            "1s",
            "--trusted-proxies",
            "127.0.0.1",
        ],
    );

    // Exact limits, for callers whose counters land on every master.
    for _ in 0..12 {
        assert_eq!(admitted(&tg, "/a/y", &[]).await, 5, "{}", tg.log_text());
    }
    // A window with a precision keeps its counts in a key of their own,
    // beside the counter: the same slot, decided in the same call.
    for _ in 0..12 {
        assert_eq!(admitted(&tg, "/q", &[]).await, 3, "{}", tg.log_text());
    }
    let per_node: Vec<usize> = nodes
        .iter()
        .map(|n| n.cli(&["DBSIZE"]).unwrap().trim().parse().unwrap())
        .collect();
    assert!(
        per_node.iter().filter(|&&n| n > 0).count() >= 2,
        "counters spread over the masters: {per_node:?}"
    );

    // Rules keyed first on the same value share a slot: refused by `narrow`,
    // nothing is charged to `wide`.
    let c = client();
    let me = [("x-forwarded-for", "192.0.2.77")];
    for _ in 0..2 {
        assert_eq!(get(&c, &tg.url("/a/x"), &me).await.status, StatusCode::OK);
    }
    for _ in 0..4 {
        assert_eq!(
            get(&c, &tg.url("/a/x"), &me).await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    let wide_left: usize = {
        let mut n = 0;
        while get(&c, &tg.url("/a/y"), &me).await.status == StatusCode::OK {
            n += 1;
        }
        n
    };
    assert_eq!(wide_left, 3, "2 of 5 used; the refused requests took nothing");

    // Rules on different values live in different slots: the dry run keeps a
    // refusal by one from charging the other.
    let key = [("x-forwarded-for", "192.0.2.88"), ("x-key", "shared-key")];
    for _ in 0..2 {
        assert_eq!(get(&c, &tg.url("/k"), &key).await.status, StatusCode::OK);
    }
    for _ in 0..3 {
        let a = get(&c, &tg.url("/k"), &key).await;
        assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(a.json()["rule"], "per-ip");
    }
    let other_ip = [("x-forwarded-for", "192.0.2.89"), ("x-key", "shared-key")];
    assert_eq!(get(&c, &tg.url("/k"), &other_ip).await.status, StatusCode::OK);
    assert_eq!(get(&c, &tg.url("/k"), &other_ip).await.status, StatusCode::OK);
    let a = get(&c, &tg.url("/k"), &other_ip).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "the key holds exactly 4");
    assert_eq!(a.json()["rule"], "per-key");

    // One instance's own requests race between a dry run and its charges:
    // requests on two slots (`race-own`, `race-shared`) while requests on
    // `race-shared` alone fill it. The tighter slot is charged first and a
    // refusal there ends the charging, so every refused request left
    // `race-own` as it was. (Before, slots were charged in their order, own
    // first, all of them even after one refused: 2 of 3 runs failed here.)
    for round in 0..6 {
        let (own, shared) = (format!("o-race{round}"), format!("s-race{round}"));
        for _ in 0..5 {
            let only = get(&c, &tg.url("/race/only"), &[("x-shared", &shared)]).await;
            assert_eq!(only.status, StatusCode::OK);
        }
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..45 {
            let (own, shared, url) = (
                own.clone(),
                shared.clone(),
                tg.url(if i % 3 == 0 { "/race/both" } else { "/race/only" }),
            );
            calls.spawn(async move {
                let both = url.ends_with("/both");
                let headers = [("x-shared", shared.as_str()), ("x-own", own.as_str())];
                let n = if both { 2 } else { 1 };
                (
                    both,
                    get(&client(), &url, headers.get(..n).unwrap_or_default()).await.status,
                )
            });
        }
        let (mut both_admitted, mut admitted) = (0, 0);
        while let Some(call) = calls.join_next().await {
            let (both, status) = call.unwrap();
            if status == StatusCode::OK {
                admitted += 1;
                both_admitted += usize::from(both);
            }
        }
        assert_eq!(admitted, 5, "race-shared had room for 5 more");
        // What `race-own` has left, with a fresh `race-shared` counter.
        let fresh = format!("s-fresh{round}");
        let mut own_left = 0;
        while own_left < 12
            && get(&c, &tg.url("/race/both"), &[("x-shared", &fresh), ("x-own", &own)])
                .await
                .status
                == StatusCode::OK
        {
            own_left += 1;
        }
        assert_eq!(
            own_left,
            10 - both_admitted,
            "round {round}: only the admitted requests charged race-own"
        );
    }

    // Resharding: a window with a precision is two keys (the counter and
    // its ring), both declared to the script, so while its slot migrates
    // Redis answers TRYAGAIN (the rule's failure mode) until both have
    // moved. Before, the ring was not declared: with the counter moved
    // first, the script ran on the new node without its ring and started a
    // fresh one (3 more admitted in a full window), and the ring's own
    // MIGRATE then failed (BUSYKEY), the resharding stuck.
    let me = [("x-forwarded-for", "192.0.2.99")];
    for _ in 0..3 {
        assert_eq!(get(&c, &tg.url("/m"), &me).await.status, StatusCode::OK);
    }
    // (No refusal yet: a cached one would answer without Redis.)
    let keys_on = |n: &RedisServer| -> Vec<String> {
        let out = n.cli(&["KEYS", "*192.0.2.99*"]).unwrap();
        out.lines().filter(|l| !l.is_empty()).map(str::to_string).collect()
    };
    let from = nodes.iter().position(|n| !keys_on(n).is_empty()).unwrap();
    let to = (from + 1) % nodes.len();
    let keys = keys_on(&nodes[from]);
    assert_eq!(keys.len(), 2, "the counter and its ring: {keys:?}");
    let slot = nodes[from]
        .cli(&["CLUSTER", "KEYSLOT", &keys[0]])
        .unwrap()
        .trim()
        .to_string();
    let id = |n: &RedisServer| n.cli(&["CLUSTER", "MYID"]).unwrap().trim().to_string();
    let (from_id, to_id) = (id(&nodes[from]), id(&nodes[to]));
    nodes[to]
        .cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id])
        .unwrap();
    nodes[from]
        .cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id])
        .unwrap();
    let migrate = |key: &str| {
        let to_port = nodes[to].port.to_string();
        let out = nodes[from].cli(&["MIGRATE", "127.0.0.1", &to_port, "", "0", "5000", "KEYS", key]);
        assert_eq!(out.as_deref().map(str::trim), Some("OK"), "MIGRATE {key}");
    };
    let counter = keys.iter().find(|k| !k.contains('/')).unwrap();
    migrate(counter);
    for _ in 0..3 {
        let a = get(&c, &tg.url("/m"), &me).await;
        assert_ne!(
            a.status,
            StatusCode::OK,
            "a full window admits nothing mid-migration:\n{}",
            tg.log_text()
        );
    }
    migrate(keys.iter().find(|k| k.contains('/')).unwrap());
    for n in &nodes {
        n.cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]).unwrap();
    }
    assert_eq!(keys_on(&nodes[to]).len(), 2);
    assert_eq!(get(&c, &tg.url("/m"), &me).await.status, StatusCode::TOO_MANY_REQUESTS);

    // Quota mode is a rule about the whole request, and its counters sit in
    // different slots here: decided across the slots, not per slot.
    let dir = tempfile::tempdir().unwrap();
    let quota = dir.path().join("q.yaml");
    std::fs::write(
        &quota,
        "domain: q\ndescriptors:\n  - key: user\n    quota_mode: true\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n  - key: org\n    quota_mode: true\n    rate_limit: { unit: hour, requests_per_unit: 2 }\n",
    )
    .unwrap();
    let rls = Tollgate::start_rls(
        std::slice::from_ref(&quota),
        &["--redis-mode", "cluster", "--redis", &seeds, "--redis-timeout", "1s"],
    );
    let mut client = RateLimitServiceClient::connect(format!("http://{}", rls.grpc.unwrap()))
        .await
        .unwrap();
    let mut overall = Vec::new();
    for _ in 0..4 {
        let r = client
            .should_rate_limit(RateLimitRequest {
                domain: "q".into(),
                descriptors: vec![
                    descriptor(&[("user", "u-cluster")]),
                    descriptor(&[("org", "o-cluster")]),
                ],
                hits_addend: 0,
            })
            .await
            .unwrap()
            .into_inner();
        overall.push(r.overall_code == Code::Ok as i32);
    }
    // The user quota is spent after one, the org quota after two: the
    // second request passes on the org's room, the third finds neither.
    assert_eq!(overall, [true, true, false, false], "{}", rls.log_text());
}

/// A Sentinel process watching `master`.
struct Sentinel {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    fn start(master_port: u16) -> Sentinel {
        Sentinel::start_with(master_port, "")
    }

    /// With more lines of sentinel.conf (`requirepass`, `sentinel auth-pass`).
    fn start_with(master_port: u16, extra_conf: &str) -> Sentinel {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor mymaster 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds mymaster 500\nsentinel failover-timeout mymaster 3000\n{extra_conf}",
                dir.path().display()
            ),
        )
        .unwrap();
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let s = Sentinel { child, port, _dir: dir };
        wait_until("sentinel up", Duration::from_secs(5), || s.master().is_some());
        s
    }

    fn master(&self) -> Option<u16> {
        let out = Command::new("redis-cli")
            // A Sentinel with `requirepass` (the tests' is "spw") is asked with it.
            .env("REDISCLI_AUTH", "spw")
            .args([
                "-p",
                &self.port.to_string(),
                "--raw",
                "SENTINEL",
                "get-master-addr-by-name",
                "mymaster",
            ])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout).lines().nth(1)?.trim().parse().ok()
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A replica of `master` in sync, and a Sentinel watching both.
fn replica_and_sentinel(master: &RedisServer) -> (RedisServer, Sentinel) {
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &master.port.to_string()]);
    wait_until("replica in sync", Duration::from_secs(10), || {
        replica
            .cli(&["INFO", "replication"])
            .is_some_and(|i| i.contains("master_link_status:up"))
    });
    let sentinel = Sentinel::start(master.port);
    wait_until("sentinel sees the replica", Duration::from_secs(10), || {
        let out = Command::new("redis-cli")
            .args(["-p", &sentinel.port.to_string(), "SENTINEL", "replicas", "mymaster"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).contains(&replica.port.to_string())
    });
    (replica, sentinel)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_is_survived() {
    let mut master = RedisServer::start();
    let (replica, sentinel) = replica_and_sentinel(&master);

    let limits = "domain: se\nrules:\n  - name: per-ip\n    by: [client_ip]\n    limits: [{ requests: 3, per: 60s }]\n";
    let upstream = TestUpstream::start().await;
    let tg = Tollgate::start(
        limits,
        upstream.addr,
        &[
            "--redis-mode",
            "sentinel",
            "--redis",
            &format!("redis://127.0.0.1:{}", sentinel.port),
            "--redis-master",
            "mymaster",
            "--trusted-proxies",
            "127.0.0.1",
        ],
    );
    let exact = || async { admitted(&tg, "/", &[]).await == 3 };
    let started = Instant::now();
    while !exact().await {
        assert!(started.elapsed() < Duration::from_secs(5), "{}", tg.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    master.kill();
    let killed = Instant::now();
    let c = client();
    let mut answered = 0;
    let mut promoted = None;
    // Keep asking through the failover: every request is answered.
    while killed.elapsed() < Duration::from_secs(20) {
        let a = get(&c, &tg.url("/"), &[("x-forwarded-for", "198.51.100.200")]).await;
        assert!(
            matches!(a.status, StatusCode::OK | StatusCode::TOO_MANY_REQUESTS),
            "{}",
            a.status
        );
        answered += 1;
        if promoted.is_none() && sentinel.master() == Some(replica.port) {
            promoted = Some(killed.elapsed());
        }
        if promoted.is_some() && exact().await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let promoted = promoted.expect("sentinel promoted the replica");
    assert!(exact().await, "exact limiting on the new master:\n{}", tg.log_text());
    eprintln!(
        "sentinel failover: replica promoted {promoted:?} after the kill, exact again {:?} after the kill, \
         {answered} requests answered meanwhile",
        killed.elapsed()
    );
    assert!(tg.logged("redis master from sentinel"));
}

const SENTINEL_LIMITS: &str =
    "domain: se\nrules:\n  - name: per-ip\n    by: [client_ip]\n    limits: [{ requests: 3, per: 60s }]\n";

/// tollgate in front of `upstream`, its counters on the master the
/// Sentinels at `url` name, with `extra` flags.
fn with_sentinels(upstream: &TestUpstream, url: &str, extra: &[&str]) -> Tollgate {
    let mut args = vec![
        "--redis-mode",
        "sentinel",
        "--redis",
        url,
        "--trusted-proxies",
        "127.0.0.1",
    ];
    args.extend_from_slice(extra);
    Tollgate::start(SENTINEL_LIMITS, upstream.addr, &args)
}

/// Waits until a fresh caller gets exactly the limit, as the master keeps it.
async fn exact_within(tg: &Tollgate, limit: Duration) {
    let started = Instant::now();
    while admitted(tg, "/", &[]).await != 3 {
        assert!(
            started.elapsed() < limit,
            "not exact within {limit:?}:\n{}",
            tg.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_logs_in_to_a_master_with_a_password_and_to_sentinels_with_their_own() {
    let master = RedisServer::start_with(&["--requirepass", "pw"]);
    let upstream = TestUpstream::start().await;
    // The Sentinels take no password: the URL's login is the master's only.
    let open = Sentinel::start_with(master.port, "sentinel auth-pass mymaster pw\n");
    let tg = with_sentinels(&upstream, &format!("redis://:pw@127.0.0.1:{}", open.port), &[]);
    exact_within(&tg, Duration::from_secs(5)).await;
    drop(tg);
    // Sentinels with a password of their own, as envoyproxy/ratelimit's
    // variables give them: REDIS_AUTH the master's, REDIS_SENTINEL_AUTH theirs.
    let guarded = Sentinel::start_with(master.port, "sentinel auth-pass mymaster pw\nrequirepass spw\n");
    let tg = Tollgate::start_with_env(
        SENTINEL_LIMITS,
        upstream.addr,
        &["--trusted-proxies", "127.0.0.1"],
        &[
            ("REDIS_TYPE", "SENTINEL"),
            ("REDIS_URL", &format!("mymaster,127.0.0.1:{}", guarded.port)),
            ("REDIS_AUTH", "pw"),
            ("REDIS_SENTINEL_AUTH", "spw"),
        ],
    );
    exact_within(&tg, Duration::from_secs(5)).await;
    assert!(
        !tg.log_text().contains("spw") && !tg.log_text().contains(":pw"),
        "{}",
        tg.log_text()
    );
    // Either password where the other belongs is refused, and said so.
    drop(tg);
    let tg = with_sentinels(
        &upstream,
        &format!("redis://:spw@127.0.0.1:{}", guarded.port),
        &["--redis-sentinel-auth", "pw"],
    );
    assert_eq!(admitted(&tg, "/", &[]).await, 20, "fails open");
    let started = Instant::now();
    while !tg.logged("refuse tollgate's login") {
        assert!(started.elapsed() < Duration::from_secs(5), "{}", tg.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // One line, though the Sentinels are asked again every second.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    assert_eq!(
        tg.log_text().matches("refuse tollgate's login").count(),
        1,
        "{}",
        tg.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_leaves_a_frozen_master_for_the_one_it_promotes() {
    let master = RedisServer::start();
    let (replica, sentinel) = replica_and_sentinel(&master);
    let upstream = TestUpstream::start().await;
    let tg = with_sentinels(&upstream, &format!("redis://127.0.0.1:{}", sentinel.port), &[]);
    exact_within(&tg, Duration::from_secs(5)).await;
    // Quiet for over a second: the next call on a connection is preceded by
    // a PING, which a frozen master never answers either.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // Frozen, not killed: its connections stay open and answer nothing.
    master.signal("STOP");
    let frozen = Instant::now();
    while sentinel.master() != Some(replica.port) {
        // Decisions meanwhile fail (open), and each asks Sentinel again.
        // Several at once: they wait for the thread's calls in flight, and
        // calls that never end (or their PINGs) held those for good.
        let burst: Vec<_> = (0..8)
            .map(|_| {
                let url = tg.url("/");
                tokio::spawn(async move { get(&client(), &url, &[("x-forwarded-for", "198.51.100.7")]).await })
            })
            .collect();
        for call in burst {
            let _ = call.await;
        }
        assert!(
            frozen.elapsed() < Duration::from_secs(20),
            "sentinel never promoted the replica"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let promoted = frozen.elapsed();
    // Exact on the new master while the old one is still frozen (before,
    // every decision failed until the old master woke up).
    exact_within(&tg, Duration::from_secs(5)).await;
    eprintln!(
        "frozen master: replica promoted {promoted:?} after the freeze, exact on it {:?} after",
        frozen.elapsed()
    );
    assert!(tg.logged(&format!("127.0.0.1:{}", replica.port)), "{}", tg.log_text());
    master.signal("CONT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_refusing_the_login_is_reported_at_start() {
    let bus = free_port().to_string();
    let node = RedisServer::start_with(&[
        "--cluster-enabled",
        "yes",
        "--cluster-port",
        &bus,
        "--requirepass",
        "right",
        "--masterauth",
        "right",
    ]);
    node.cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]).unwrap();
    wait_until("cluster_state:ok", Duration::from_secs(10), || {
        node.cli(&["CLUSTER", "INFO"])
            .is_some_and(|i| i.contains("cluster_state:ok"))
    });
    let upstream = TestUpstream::start().await;
    let start = |password: &str| {
        let seed = format!("redis://:{password}@127.0.0.1:{}", node.port);
        Tollgate::start(
            SENTINEL_LIMITS,
            upstream.addr,
            &[
                "--redis-mode",
                "cluster",
                "--redis",
                &seed,
                "--trusted-proxies",
                "127.0.0.1",
            ],
        )
    };
    // Before, only a WARN marked transient said so, at the first decision.
    let wrong = start("wrong");
    let started = Instant::now();
    while !wrong.logged("redis refuses tollgate's connection") {
        assert!(started.elapsed() < Duration::from_secs(5), "{}", wrong.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!wrong.log_text().contains("wrong@"), "{}", wrong.log_text());
    let right = start("right");
    exact_within(&right, Duration::from_secs(5)).await;
    assert!(!right.logged("redis refuses"), "{}", right.log_text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_cluster_master_is_left_for_the_replica_the_cluster_promotes() {
    let (nodes, addrs) = cluster(6, 1, 1000);
    wait_until("replicas in sync", Duration::from_secs(15), || {
        nodes.iter().all(|n| {
            n.cli(&["INFO", "replication"])
                .is_some_and(|i| i.contains("role:master") || i.contains("master_link_status:up"))
        })
    });
    let upstream = TestUpstream::start().await;
    let seeds = addrs
        .iter()
        .map(|a| format!("redis://{a}"))
        .collect::<Vec<_>>()
        .join(",");
    let tg = Tollgate::start(
        SENTINEL_LIMITS,
        upstream.addr,
        &[
            "--redis-mode",
            "cluster",
            "--redis",
            &seeds,
            "--trusted-proxies",
            "127.0.0.1",
        ],
    );
    exact_within(&tg, Duration::from_secs(5)).await;
    // A caller at its limit, its counter on one master (and its replica).
    let me = [("x-forwarded-for", "192.0.2.50")];
    let c = client();
    for _ in 0..3 {
        assert_eq!(get(&c, &tg.url("/"), &me).await.status, StatusCode::OK);
    }
    let master = nodes
        .iter()
        .find(|n| {
            n.cli(&["INFO", "replication"])
                .is_some_and(|i| i.contains("role:master"))
                && n.cli(&["KEYS", "*192.0.2.50*"]).is_some_and(|k| !k.trim().is_empty())
        })
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Frozen, not killed: no MOVED comes, nothing closes.
    master.signal("STOP");
    let frozen = Instant::now();
    // Failing open meanwhile; exact again once the replica is master (its
    // copy of the counter refuses the caller), while the old master is
    // still frozen. Before, every decision on its slots failed until it woke.
    loop {
        let a = get(&c, &tg.url("/"), &me).await;
        if a.status == StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        assert!(frozen.elapsed() < Duration::from_secs(15), "{}", tg.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "cluster master frozen: exact again on its replica {:?} after the freeze",
        frozen.elapsed()
    );
    master.signal("CONT");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_the_sentinels_name_anew_is_followed_though_nothing_failed() {
    // Two masters, both up. Before, tollgate asked the Sentinels only
    // after a failure, so a master woken from a freeze shorter than the
    // failover kept every decision (and lost them when made a replica).
    let first = RedisServer::start();
    let second = RedisServer::start();
    let sentinel = Sentinel::start(first.port);
    let upstream = TestUpstream::start().await;
    let tg = with_sentinels(&upstream, &format!("redis://127.0.0.1:{}", sentinel.port), &[]);
    exact_within(&tg, Duration::from_secs(5)).await;
    let sentinel_cli = |args: &[&str]| {
        let out = Command::new("redis-cli")
            .args(["-p", &sentinel.port.to_string()])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success());
    };
    sentinel_cli(&["SENTINEL", "REMOVE", "mymaster"]);
    sentinel_cli(&[
        "SENTINEL",
        "MONITOR",
        "mymaster",
        "127.0.0.1",
        &second.port.to_string(),
        "1",
    ]);
    let moved = Instant::now();
    let keys = |n: &RedisServer| n.cli(&["DBSIZE"]).unwrap().trim().parse::<u64>().unwrap();
    while keys(&second) == 0 {
        assert!(moved.elapsed() < Duration::from_secs(5), "{}", tg.log_text());
        let _ = admitted(&tg, "/", &[]).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    exact_within(&tg, Duration::from_secs(2)).await;
    assert!(
        tg.logged(&format!("master=127.0.0.1:{}", second.port)),
        "{}",
        tg.log_text()
    );
}
