//! Counters in Redis, shared by every tollgate instance.
//!
//! A decision is one `EVALSHA` of `decide.lua` with every key of the request:
//! atomic on the server, and its cost does not grow with the number of
//! entries in a window (see the script for the prefix-sum layout). A counter
//! is a short string while it holds few entries (most counters: a caller's
//! few requests, a flood of fresh keys) and a stream once it grows past
//! [`COMPACT_ENTRIES`]. Time is Redis's own `TIME`, so instances with skewed
//! clocks agree.
//!
//! On one node (standalone, or the master Sentinel names), decisions waiting
//! for Redis are sent together in one `EVALSHA` (up to [`MAX_BATCH`], a few
//! calls in flight): the script decides them one after the other, each
//! atomically, and the per-call cost on both sides is paid once per batch.
//! An idle caller waits for no one: a batch is whatever is queued when a call
//! can go out. Each thread that decides has its own lane to the node (its
//! connection, queue and batching task), as NGINX workers keep their own
//! upstream connections: a proxy thread never hands a decision to another
//! thread and waits to be woken back.
//!
//! On Redis Cluster a decision's keys are grouped by hash tag (see
//! `limits/keys.rs`). One group is one atomic call. Several groups are
//! decided in two steps: a dry run of every group (checks with the real
//! costs, charges nothing), then, only if all have room, the charging calls.
//! Between the two steps another instance may fill a group; then the groups
//! charged before it stay charged. That window is one round trip wide.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::TcpSettings;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{Client, ConnectionInfo, IntoConnectionInfo, Script};
use thread_local::ThreadLocal;
use tokio::sync::{OnceCell, Semaphore, mpsc, oneshot};

use super::{Check, CheckCount, Clock, CounterStore, StoreAnswer, StoreError, WindowCount};
use crate::config::Window;

/// The decision script, loaded once per server and then called by hash.
const DECIDE_LUA: &str = include_str!("decide.lua");
/// Most decisions sent in one call.
pub const MAX_BATCH: usize = 64;
/// Most counters in one batched call: Redis runs a script alone, so one
/// call must stay short next to the decision deadline (~10 us per counter).
const MAX_BATCH_KEYS: usize = 256;
/// Calls in flight at once on one lane's connection. Fewer in flight means
/// more decisions wait for the next call and share it: with a lane per
/// thread, 2 (4 before lanes) halved the calls per decision under load and
/// did not cost throughput (BENCHMARKS.md, change 8).
const MAX_IN_FLIGHT: usize = 2;
/// Least time between two Sentinel look-ups of the master.
const RESOLVE_EVERY: Duration = Duration::from_millis(250);

/// How tollgate finds Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisMode {
    /// One server.
    Standalone,
    /// Redis Cluster, from one or more seed nodes.
    Cluster,
    /// The master that these Sentinels name.
    Sentinel {
        /// The monitored master's name (`sentinel monitor <name> ...`).
        master: String,
    },
}

/// Most entries a counter keeps in its compact form (a string) before it
/// becomes a stream: below this a string is smaller, and reading it whole
/// costs the script about what a stream's two seeks do.
pub const COMPACT_ENTRIES: usize = 8;

/// Counters kept in Redis.
pub struct RedisStore {
    conn: Conn,
    script: DecideScript,
    /// Per thread, its way to the node (unused on Cluster). Boxed: the
    /// table of threads is large and lives as long as the store.
    lanes: Box<ThreadLocal<Lane>>,
    /// The servers as they may be logged: no user name or password.
    display: String,
}

#[derive(Clone)]
enum Conn {
    Node(Arc<NodeConn>),
    Cluster(Arc<ClusterConn>),
}

/// The one node decisions go to; with Sentinel, re-pointed after a failover.
struct NodeConn {
    client: RwLock<Option<Client>>,
    /// Bumped whenever `client` changes, so every lane reconnects.
    generation: AtomicU64,
    sentinel: Option<SentinelResolver>,
}

/// One thread's way to the node: its own connection, queue and batching
/// task, all on that thread's runtime.
struct Lane {
    link: Arc<LaneLink>,
    queue: mpsc::UnboundedSender<Pending>,
    /// Decisions in the queue, so an idle lane can skip it.
    queued: Arc<AtomicUsize>,
    /// Calls in flight on this lane's connection (batched or direct).
    slots: Arc<Semaphore>,
}

/// A lane's connection, made again when the node's client changes.
struct LaneLink {
    node: Arc<NodeConn>,
    conn: Mutex<Option<(u64, ConnectionManager)>>,
}

struct SentinelResolver {
    client: tokio::sync::Mutex<SentinelClient>,
    last: Mutex<Option<Instant>>,
}

struct ClusterConn {
    client: ClusterClient,
    conn: OnceCell<ClusterConnection>,
}

/// One decision waiting for a call.
struct Pending {
    checks: Vec<OwnedCheck>,
    reply: oneshot::Sender<Result<StoreAnswer, StoreError>>,
}

#[derive(Clone)]
struct OwnedCheck {
    key: String,
    windows: Vec<Window>,
    cost: u64,
    shadow: bool,
    quota: bool,
}

/// The decision script and what every call of it carries.
#[derive(Clone)]
struct DecideScript {
    script: Arc<Script>,
    pinned_clock: Option<Arc<dyn Clock>>,
    compact_entries: usize,
}

/// Small pipelined writes must never wait for a delayed ACK (Nagle).
fn tcp_settings() -> TcpSettings {
    TcpSettings::default().set_nodelay(true)
}

fn node_info(url: &str) -> redis::RedisResult<ConnectionInfo> {
    Ok(url.into_connection_info()?.set_tcp_settings(tcp_settings()))
}

fn manager_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(200))
}

impl RedisStore {
    /// Prepares connections to `urls` (`redis[s]://[user:password@]host:port/db`):
    /// one server, Cluster seed nodes, or Sentinels. Connecting happens on
    /// first use, so tollgate starts while Redis is down. Must be called
    /// inside a tokio runtime (it starts background tasks).
    ///
    /// `pinned_clock` replaces Redis `TIME` and is meant for tests that step
    /// time by hand; production passes `None`.
    pub fn connect(
        urls: &[String],
        mode: &RedisMode,
        pinned_clock: Option<Arc<dyn Clock>>,
    ) -> Result<Self, StoreError> {
        let display = urls
            .iter()
            .map(|u| Client::open(u.as_str()).map(|c| c.get_connection_info().addr().to_string()))
            .collect::<Result<Vec<_>, _>>()?
            .join(",");
        let script = DecideScript {
            script: Arc::new(Script::new(DECIDE_LUA)),
            pinned_clock,
            compact_entries: COMPACT_ENTRIES,
        };
        let conn = match mode {
            RedisMode::Standalone => {
                let [url] = urls else {
                    return Err(StoreError::Reply("standalone mode takes one --redis URL".into()));
                };
                Conn::Node(Arc::new(NodeConn {
                    client: RwLock::new(Some(Client::open(node_info(url)?)?)),
                    generation: AtomicU64::new(0),
                    sentinel: None,
                }))
            }
            RedisMode::Sentinel { master } => {
                let nodes = SentinelNodeConnectionInfo::default().set_tcp_settings(tcp_settings());
                let client =
                    SentinelClient::build(urls.to_vec(), master.clone(), Some(nodes), SentinelServerType::Master)?;
                let node = Arc::new(NodeConn {
                    client: RwLock::new(None),
                    generation: AtomicU64::new(0),
                    sentinel: Some(SentinelResolver {
                        client: tokio::sync::Mutex::new(client),
                        last: Mutex::new(None),
                    }),
                });
                node.clone().failed();
                Conn::Node(node)
            }
            RedisMode::Cluster => Conn::Cluster(Arc::new(ClusterConn {
                client: ClusterClient::builder(urls.iter().map(|u| node_info(u)).collect::<Result<Vec<_>, _>>()?)
                    .tcp_settings(tcp_settings())
                    .build()?,
                conn: OnceCell::new(),
            })),
        };
        Ok(RedisStore {
            conn,
            script,
            lanes: Box::new(ThreadLocal::new()),
            display,
        })
    }

    /// Keeps at most `entries` entries in a counter's compact form (0: every
    /// counter is a stream from its first request). For tests that cross
    /// the switch at every point; call before the first decision.
    #[must_use]
    pub fn with_compact_entries(mut self, entries: usize) -> Self {
        self.script.compact_entries = entries;
        self
    }

    /// Decides several requests in one script call, in order, each as if it
    /// had come alone (what the batching task does under load). On Cluster
    /// they go one after the other.
    pub async fn decide_in_order(&self, requests: &[&[Check<'_>]]) -> Result<Vec<StoreAnswer>, StoreError> {
        let owned: Vec<Vec<OwnedCheck>> = requests.iter().map(|checks| owned_checks(checks)).collect();
        match &self.conn {
            Conn::Node(node) => {
                let decisions: Vec<(&[OwnedCheck], bool)> = owned.iter().map(|c| (&c[..], false)).collect();
                let mut conn = self.lane(node).link.get()?;
                self.script.call(&mut conn, &decisions).await
            }
            Conn::Cluster(cluster) => {
                let mut answers = Vec::with_capacity(owned.len());
                for checks in owned {
                    answers.push(self.decide_cluster(cluster, checks).await?);
                }
                Ok(answers)
            }
        }
    }

    /// This thread's lane to `node`, started on first use.
    fn lane(&self, node: &Arc<NodeConn>) -> &Lane {
        self.lanes
            .get_or(|| Lane::start(node.clone(), self.script.clone()))
    }

    /// The servers, safe to log (never carries credentials).
    pub fn server(&self) -> &str {
        &self.display
    }

    async fn decide_cluster(&self, cluster: &ClusterConn, checks: Vec<OwnedCheck>) -> Result<StoreAnswer, StoreError> {
        let mut conn = cluster.get().await?;
        // Keys with one hash tag share a slot and can be decided in one call.
        let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, c) in checks.iter().enumerate() {
            groups.entry(hash_tag(&c.key)).or_default().push(i);
        }
        if groups.len() == 1 {
            return single(self.script.call(&mut conn, &[(&checks, false)]).await?);
        }
        // Each part is decided alone, but quota mode is a rule about the
        // whole request: parts carry quota checks as shadow ones (charged
        // when they fit, never refusing) and the quota rule is applied here.
        let as_part = |c: &OwnedCheck| OwnedCheck {
            shadow: c.shadow || c.quota,
            quota: false,
            ..c.clone()
        };
        let parts: Vec<Vec<OwnedCheck>> = groups
            .values()
            .map(|idx| idx.iter().filter_map(|&i| checks.get(i).map(as_part)).collect())
            .collect();
        let mut answers = Vec::with_capacity(parts.len());
        for part in &parts {
            answers.push(single(self.script.call(&mut conn, &[(part, true)]).await?)?);
        }
        let enforced = answers.iter().all(|a| a.admitted);
        let counts = in_order(&groups, answers, checks.len());
        let quotas: Vec<bool> = checks
            .iter()
            .zip(&counts)
            .filter(|(c, _)| c.quota)
            .map(|(c, n)| c.shadow || n.windows.iter().all(|w| !w.over()))
            .collect();
        if !enforced || !(quotas.is_empty() || quotas.contains(&true)) {
            return Ok(StoreAnswer {
                admitted: false,
                checks: counts,
            });
        }
        let mut answers = Vec::with_capacity(parts.len());
        for part in &parts {
            answers.push(single(self.script.call(&mut conn, &[(part, false)]).await?)?);
        }
        let admitted = answers.iter().all(|a| a.admitted);
        Ok(StoreAnswer {
            admitted,
            checks: in_order(&groups, answers, checks.len()),
        })
    }
}

/// The parts' answers back in the order the checks came in.
fn in_order(groups: &BTreeMap<&str, Vec<usize>>, answers: Vec<StoreAnswer>, n: usize) -> Vec<CheckCount> {
    let mut merged: Vec<Option<CheckCount>> = vec![None; n];
    for (idx, answer) in groups.values().zip(answers) {
        for (&i, count) in idx.iter().zip(answer.checks) {
            if let Some(slot) = merged.get_mut(i) {
                *slot = Some(count);
            }
        }
    }
    merged
        .into_iter()
        .map(|c| {
            c.unwrap_or(CheckCount {
                charged: false,
                windows: Vec::new(),
            })
        })
        .collect()
}

fn owned_checks(checks: &[Check<'_>]) -> Vec<OwnedCheck> {
    checks
        .iter()
        .map(|c| OwnedCheck {
            key: c.key.to_string(),
            windows: c.windows.to_vec(),
            cost: c.cost,
            shadow: c.shadow,
            quota: c.quota,
        })
        .collect()
}

fn single(mut answers: Vec<StoreAnswer>) -> Result<StoreAnswer, StoreError> {
    answers.pop().ok_or_else(|| StoreError::Reply("empty reply".into()))
}

/// The part of a key Redis Cluster hashes: between the first `{` and the
/// next `}`, when not empty; otherwise the whole key.
fn hash_tag(key: &str) -> &str {
    if let Some((_, after)) = key.split_once('{')
        && let Some((tag, _)) = after.split_once('}')
        && !tag.is_empty()
    {
        return tag;
    }
    key
}

impl ClusterConn {
    async fn get(&self) -> Result<ClusterConnection, StoreError> {
        Ok(self
            .conn
            .get_or_try_init(|| self.client.get_async_connection())
            .await?
            .clone())
    }
}

impl LaneLink {
    fn get(&self) -> Result<ConnectionManager, StoreError> {
        let generation = self.node.generation.load(Ordering::Acquire);
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((g, manager)) = &*conn
            && *g == generation
        {
            return Ok(manager.clone());
        }
        let client = self
            .node
            .client
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| StoreError::Batch("no master known yet (asking Sentinel)".into()))?;
        // Lazy: connects on first use, on this lane's runtime.
        let manager = ConnectionManager::new_lazy_with_config(client, manager_config())?;
        *conn = Some((generation, manager.clone()));
        Ok(manager)
    }
}

impl Lane {
    fn start(node: Arc<NodeConn>, script: DecideScript) -> Lane {
        let link = Arc::new(LaneLink {
            node,
            conn: Mutex::new(None),
        });
        let queued = Arc::new(AtomicUsize::new(0));
        let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_batches(
            rx,
            link.clone(),
            script,
            queued.clone(),
            slots.clone(),
        ));
        Lane {
            link,
            queue,
            queued,
            slots,
        }
    }
}

impl NodeConn {
    /// After a failed call: with Sentinel, ask again where the master is.
    fn failed(self: Arc<Self>) {
        let Some(sentinel) = &self.sentinel else { return };
        {
            let mut last = sentinel.last.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|t| t.elapsed() < RESOLVE_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        tokio::spawn(async move {
            let Some(sentinel) = &self.sentinel else { return };
            let client = sentinel.client.lock().await.async_get_client().await;
            match client {
                Ok(c) => {
                    let addr = c.get_connection_info().addr().to_string();
                    let mut current = self.client.write().unwrap_or_else(|e| e.into_inner());
                    // Same master (Redis was only slow, or a script failed):
                    // keep every lane's connection instead of reconnecting them all.
                    if current
                        .as_ref()
                        .is_some_and(|old| old.get_connection_info().addr().to_string() == addr)
                    {
                        return;
                    }
                    tracing::info!(master = %addr, "redis master from sentinel");
                    *current = Some(c);
                    self.generation.fetch_add(1, Ordering::AcqRel);
                }
                Err(e) => tracing::warn!(error = %e, "sentinel did not name a master"),
            }
        });
    }
}

impl CounterStore for RedisStore {
    async fn decide(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        let checks = owned_checks(checks);
        match &self.conn {
            Conn::Node(node) => {
                let lane = self.lane(node);
                // Nothing waiting and a call slot free: go straight out and
                // save the hand-off to the batching task.
                if lane.queued.load(Ordering::Acquire) == 0
                    && let Ok(slot) = lane.slots.clone().try_acquire_owned()
                {
                    let result = match lane.link.get() {
                        Ok(mut conn) => self.script.call(&mut conn, &[(&checks, false)])
                            .await
                            .and_then(single),
                        Err(e) => Err(e),
                    };
                    drop(slot);
                    if result.is_err() {
                        node.clone().failed();
                    }
                    return result;
                }
                lane.queued.fetch_add(1, Ordering::AcqRel);
                let (reply, answer) = oneshot::channel();
                let pending = Pending {
                    checks,
                    reply,
                };
                if lane.queue.send(pending).is_err() {
                    lane.queued.fetch_sub(1, Ordering::AcqRel);
                    return Err(StoreError::Batch("batching task stopped".into()));
                }
                answer
                    .await
                    .map_err(|_| StoreError::Batch("batching task stopped".into()))?
            }
            Conn::Cluster(cluster) => self.decide_cluster(cluster, checks).await,
        }
    }
}

/// Takes whatever is queued (up to [`MAX_BATCH`]) whenever a call slot is
/// free, and sends it to the node as one script call.
async fn send_batches(
    mut rx: mpsc::UnboundedReceiver<Pending>,
    link: Arc<LaneLink>,
    script: DecideScript,
    queued: Arc<AtomicUsize>,
    slots: Arc<Semaphore>,
) {
    loop {
        let Some(first) = rx.recv().await else { return };
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        // A caller past its deadline has already applied its failure mode:
        // charging its request now would count one that was never admitted.
        let mut taken: usize = 1;
        let mut batch = Vec::with_capacity(8);
        let mut keys = first.checks.len();
        if !first.reply.is_closed() {
            batch.push(first);
        }
        while batch.len() < MAX_BATCH && keys < MAX_BATCH_KEYS {
            match rx.try_recv() {
                Ok(p) => {
                    taken = taken.saturating_add(1);
                    keys = keys.saturating_add(p.checks.len());
                    if !p.reply.is_closed() {
                        batch.push(p);
                    }
                }
                Err(_) => break,
            }
        }
        queued.fetch_sub(taken, Ordering::AcqRel);
        if batch.is_empty() {
            continue;
        }
        let (link, script) = (link.clone(), script.clone());
        tokio::spawn(async move {
            let decisions: Vec<(&[OwnedCheck], bool)> = batch.iter().map(|p| (&p.checks[..], false)).collect();
            let result = match link.get() {
                Ok(mut conn) => script.call(&mut conn, &decisions).await,
                Err(e) => Err(e),
            };
            drop(decisions);
            match result {
                Ok(answers) => {
                    for (p, a) in batch.into_iter().zip(answers) {
                        let _ = p.reply.send(Ok(a));
                    }
                }
                Err(e) => {
                    link.node.clone().failed();
                    let message = e.to_string();
                    let mut batch = batch.into_iter();
                    if let Some(p) = batch.next() {
                        let _ = p.reply.send(Err(e));
                    }
                    for p in batch {
                        let _ = p.reply.send(Err(StoreError::Batch(message.clone())));
                    }
                }
            }
            drop(slot);
        });
    }
}

impl DecideScript {
    /// One script call deciding `decisions` (each: its checks, and whether
    /// it is a dry run that charges nothing).
    async fn call<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        decisions: &[(&[OwnedCheck], bool)],
    ) -> Result<Vec<StoreAnswer>, StoreError> {
        let pinned = self.pinned_clock.as_ref().map_or(0, |c| c.now_ms());
        let mut call = self.script.prepare_invoke();
        call.arg(pinned).arg(self.compact_entries).arg(decisions.len());
    for (checks, dry_run) in decisions {
        call.arg(checks.len()).arg(u8::from(*dry_run));
        for check in checks.iter() {
            call.key(&check.key);
            call.arg(check.cost)
                .arg(u8::from(check.shadow) | u8::from(check.quota) << 1)
                .arg(check.windows.len());
            for w in &check.windows {
                call.arg(w.requests).arg(w.period_ms);
            }
        }
    }
    let reply: Vec<i64> = call.invoke_async(conn).await?;
    parse_reply(&reply, decisions)
    }
}

fn parse_reply(reply: &[i64], decisions: &[(&[OwnedCheck], bool)]) -> Result<Vec<StoreAnswer>, StoreError> {
    let expected: usize = decisions
        .iter()
        .map(|(c, _)| {
            c.iter()
                .map(|c| c.windows.len().saturating_mul(3).saturating_add(1))
                .fold(1usize, usize::saturating_add)
        })
        .sum();
    if reply.len() != expected {
        return Err(StoreError::Reply(format!(
            "{} integers, expected {expected}",
            reply.len()
        )));
    }
    let mut values = reply.iter().copied();
    let mut next = || values.next().unwrap_or(0);
    let answers = decisions
        .iter()
        .map(|(checks, _)| {
            let admitted = next() == 1;
            let checks = checks
                .iter()
                .map(|check| {
                    let charged = next() == 1;
                    let windows = check
                        .windows
                        .iter()
                        .map(|_| {
                            let used = u64::try_from(next()).unwrap_or(0);
                            let reset_ms = u64::try_from(next()).unwrap_or(0);
                            let retry = next();
                            WindowCount {
                                used,
                                reset_ms,
                                retry_ms: u64::try_from(retry).ok(),
                                never: retry == -2,
                            }
                        })
                        .collect();
                    CheckCount { charged, windows }
                })
                .collect();
            StoreAnswer { admitted, checks }
        })
        .collect();
    Ok(answers)
}

#[cfg(test)]
mod tests {
    use super::hash_tag;

    #[test]
    fn hash_tags_as_redis_cluster_reads_them() {
        assert_eq!(hash_tag("tg:{3=api|8=10.0.0.7|}5=login|"), "3=api|8=10.0.0.7|");
        assert_eq!(hash_tag("tg:{}x"), "tg:{}x");
        assert_eq!(hash_tag("tg:{a}b}"), "a");
        assert_eq!(hash_tag("plain"), "plain");
    }
}
