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
//! for Redis are sent together in one `EVALSHA` (up to `lanes::MAX_BATCH`, one
//! call in flight per thread): the script decides them one after the other,
//! each atomically, and the per-call cost on both sides is paid once per
//! batch; alike decisions in a row on one counter go as one run.
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
//! Between the two steps any other decision on the same counters (this
//! instance's own too) may fill a group; then the groups charged before it
//! stay charged. That window is one round trip wide; the tightest group is
//! charged first and charging stops at a refusal, which closes it whenever
//! only one group's counter fills meanwhile.

mod cluster;
mod lanes;
mod script;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManagerConfig;
use redis::cluster::ClusterClient;
use redis::io::tcp::TcpSettings;
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{Client, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo, TlsMode};
use thread_local::ThreadLocal;
use tokio::sync::oneshot;

use super::{Check, Clock, CounterStore, StoreAnswer, StoreError};
use cluster::ClusterConn;
use lanes::{Lane, Pending};

use script::{DecideScript, OwnedCheck, owned_checks, single};

/// Longest wait for one Cluster node's answer: past any usual decision
/// deadline, so it cuts a node that stopped answering (a `--redis-timeout`
/// past it is cut to it on Cluster).
const CLUSTER_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest a Sentinel lookup (the Sentinels' answer, the master's role) is waited for.
const LOOKUP_LIMIT: Duration = Duration::from_secs(2);

/// How often the Sentinels are asked where the master is, failures or not.
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// Least time between two Sentinel look-ups of the master after failures.
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
        /// How to log in to the Sentinels themselves (the login in the
        /// URLs is the master's); `None`: they take no password.
        auth: Option<SentinelAuth>,
    },
}

/// A login to Redis Sentinels (`requirepass` in sentinel.conf), kept apart
/// from the master's as envoyproxy/ratelimit keeps `REDIS_SENTINEL_AUTH`
/// apart from `REDIS_AUTH`. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelAuth {
    user: Option<String>,
    password: String,
}

impl SentinelAuth {
    /// From `password` or `user:password`.
    pub fn parse(text: &str) -> SentinelAuth {
        match text.split_once(':') {
            Some((user, password)) if !user.is_empty() => SentinelAuth {
                user: Some(user.to_string()),
                password: password.to_string(),
            },
            Some(("", password)) => SentinelAuth {
                user: None,
                password: password.to_string(),
            },
            _ => SentinelAuth {
                user: None,
                password: text.to_string(),
            },
        }
    }

    fn login(&self) -> RedisConnectionInfo {
        let login = quiet(RedisConnectionInfo::default()).set_password(&self.password);
        match &self.user {
            Some(user) => login.set_username(user),
            None => login,
        }
    }
}

impl std::fmt::Debug for SentinelAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SentinelAuth(..)")
    }
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

struct SentinelResolver {
    client: tokio::sync::Mutex<SentinelClient>,
    last: Mutex<Option<Instant>>,
    /// Whether a refused login was logged (once, until a lookup succeeds).
    refusal_told: AtomicBool,
}

/// Small pipelined writes must never wait for a delayed ACK (Nagle).
fn tcp_settings() -> TcpSettings {
    TcpSettings::default().set_nodelay(true)
}

/// Redis before 7.2 answers redis-rs's `CLIENT SETINFO` with an error on
/// every new connection, and operators alert on the error statistics.
fn quiet(redis: RedisConnectionInfo) -> RedisConnectionInfo {
    redis.set_skip_set_lib_name()
}

fn node_info(url: &str) -> redis::RedisResult<ConnectionInfo> {
    let info = url.into_connection_info()?;
    let redis = quiet(info.redis_settings().clone());
    Ok(info.set_redis_settings(redis).set_tcp_settings(tcp_settings()))
}

/// A lane's connection, whose calls are given up after `response_timeout`
/// (redis-rs's own default, 500 ms, failed every decision slower than that
/// whatever `--redis-timeout` said).
fn manager_config(response_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(response_timeout))
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
        let script = DecideScript::new(pinned_clock, COMPACT_ENTRIES);
        let conn = match mode {
            RedisMode::Standalone => {
                let [url] = urls else {
                    return Err(StoreError::Config("standalone mode takes one --redis URL".into()));
                };
                Conn::Node(Arc::new(NodeConn {
                    client: RwLock::new(Some(Client::open(node_info(url)?)?)),
                    generation: AtomicU64::new(0),
                    sentinel: None,
                }))
            }
            RedisMode::Sentinel { master, auth } => {
                let (sentinels, nodes) = sentinel_logins(urls, auth.as_ref())?;
                let client = SentinelClient::build(sentinels, master.clone(), Some(nodes), SentinelServerType::Master)?;
                let node = Arc::new(NodeConn {
                    client: RwLock::new(None),
                    generation: AtomicU64::new(0),
                    sentinel: Some(SentinelResolver {
                        client: tokio::sync::Mutex::new(client),
                        last: Mutex::new(None),
                        refusal_told: AtomicBool::new(false),
                    }),
                });
                node.clone().failed();
                node.watch();
                Conn::Node(node)
            }
            RedisMode::Cluster => Conn::Cluster(Arc::new(ClusterConn::new(
                ClusterClient::builder(urls.iter().map(|u| node_info(u)).collect::<Result<Vec<_>, _>>()?)
                    .tcp_settings(tcp_settings())
                    // A node that stopped answering (frozen) must not hold
                    // the reading of the slots for good (`ClusterConn::renew`).
                    .response_timeout(CLUSTER_RESPONSE_TIMEOUT)
                    .build()?,
            ))),
        };
        Ok(RedisStore {
            conn,
            script,
            lanes: Box::new(ThreadLocal::new()),
            display,
        })
    }

    /// Connects once, with time to spare, and sends a PING, logging a
    /// failure that asking again will not mend: a wrong password or a
    /// database that does not exist otherwise shows only as decisions
    /// timing out ("no answer within 50ms"), the connection's own error
    /// coming after the deadline. A Redis that is down is not reported
    /// here (decisions say so). On Cluster, through its seed nodes; with
    /// Sentinel, once a master is known.
    pub fn probe(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (node, cluster) = match &self.conn {
            Conn::Node(node) => (node.client.read().unwrap_or_else(|e| e.into_inner()).clone(), None),
            Conn::Cluster(cluster) => (None, Some(cluster.client.clone())),
        };
        async move {
            let attempt = async {
                let ping = redis::cmd("PING");
                if let Some(client) = node {
                    let mut conn = client.get_multiplexed_async_connection().await?;
                    ping.query_async::<redis::Value>(&mut conn).await?;
                }
                if let Some(client) = cluster {
                    let mut conn = client.get_async_connection().await?;
                    ping.query_async::<redis::Value>(&mut conn).await?;
                }
                Ok::<_, redis::RedisError>(())
            };
            if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(5), attempt).await {
                let e = StoreError::from(e);
                if let StoreError::Failed { transient: false, .. } = &e {
                    tracing::error!(error = %e, "redis refuses tollgate's connection: every decision fails until this is fixed");
                    crate::activity::get().store_failed(&e);
                }
            }
        }
    }

    /// The decision deadline the limiter applies (`--redis-timeout`): a
    /// call Redis runs only after it (a Redis paused, stopped or slow)
    /// charges nothing, as its callers have already applied their failure
    /// mode. Not on Cluster: the bound is read on one server's clock, and
    /// its nodes' clocks differ. Call before the first decision.
    #[must_use]
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        if matches!(self.conn, Conn::Node(_)) {
            self.script.deadline = Some(deadline);
        }
        self
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
                let asked = Instant::now();
                let mut conn = self.lane(node).link.connection().await?;
                self.script.call(&mut conn, &decisions, asked).await
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
}

/// The Sentinels' connections (logged in with `auth`, or not at all) and
/// the master's: the login, database and TLS of the URLs are the master's,
/// the node the counters are on, as envoyproxy/ratelimit's `REDIS_AUTH` is;
/// sent to a Sentinel without a password, a login is refused.
fn sentinel_logins(
    urls: &[String],
    auth: Option<&SentinelAuth>,
) -> Result<(Vec<ConnectionInfo>, SentinelNodeConnectionInfo), StoreError> {
    let infos = urls.iter().map(|u| node_info(u)).collect::<Result<Vec<_>, _>>()?;
    let Some(first) = infos.first() else {
        return Err(StoreError::Config("sentinel mode takes the Sentinels' URLs in --redis".into()));
    };
    let master = first.redis_settings().clone();
    let same = |i: &ConnectionInfo| {
        let r = i.redis_settings();
        r.username() == master.username() && r.password() == master.password() && r.db() == master.db()
    };
    if !infos.iter().all(same) {
        return Err(StoreError::Config(
            "the Sentinel URLs in --redis log in differently: the login and database in them are the master's, \
             the same in each (--redis-sentinel-auth is the Sentinels' own)"
                .into(),
        ));
    }
    let mut nodes = SentinelNodeConnectionInfo::default()
        .set_tcp_settings(tcp_settings())
        .set_redis_connection_info(quiet(master));
    if let ConnectionAddr::TcpTls { insecure, .. } = first.addr() {
        nodes = nodes.set_tls_mode(if *insecure { TlsMode::Insecure } else { TlsMode::Secure });
    }
    let login = auth.map_or_else(|| quiet(RedisConnectionInfo::default()), SentinelAuth::login);
    let sentinels = infos.into_iter().map(|i| i.set_redis_settings(login.clone())).collect();
    Ok((sentinels, nodes))
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
        tokio::spawn(self.resolve(false));
    }

    /// With Sentinel, asks where the master is every [`WATCH_EVERY`] while
    /// the store lives, failures or not: a master frozen for less than a
    /// failover takes wakes answering as a master after its Sentinels have
    /// promoted its replica, and until they make it a replica (seconds
    /// later) nothing fails, while every count written to it is lost.
    fn watch(self: &Arc<Self>) {
        if self.sentinel.is_none() {
            return;
        }
        let node = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(WATCH_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await;
            loop {
                every.tick().await;
                let Some(node) = node.upgrade() else { return };
                node.resolve(true).await;
            }
        });
    }

    /// Asks the Sentinels where the master is and points every lane there
    /// if it moved. `quiet`: a failure to ask is not a warning (the watch
    /// asks every second; the decisions' failures say so).
    async fn resolve(self: Arc<Self>, quiet: bool) {
        let Some(sentinel) = &self.sentinel else { return };
        // Bounded: the lookup checks the named master's role on a
        // connection of its own, and a frozen master would hold it, and
        // the lookups after it, for good.
        let lookup = async { sentinel.client.lock().await.async_get_client().await };
        let client = tokio::time::timeout(LOOKUP_LIMIT, lookup)
            .await
            .unwrap_or_else(|_| Err(redis::RedisError::from((redis::ErrorKind::Io, "no answer from the Sentinels or the master they name", format!("{LOOKUP_LIMIT:?}")))));
        match client {
            Ok(c) => {
                sentinel.refusal_told.store(false, Ordering::Relaxed);
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
            Err(e) if refused_login(&e) => {
                if !sentinel.refusal_told.swap(true, Ordering::Relaxed) {
                    let e = StoreError::from(e);
                    tracing::error!(error = %e, "the Sentinels, or the master they name, refuse tollgate's login: every decision fails until this is fixed (--redis-sentinel-auth is the Sentinels' login, the one in --redis the master's)");
                    crate::activity::get().store_failed(&e);
                }
            }
            Err(e) if quiet => tracing::debug!(error = %e, "sentinel did not name a master"),
            Err(e) => tracing::warn!(error = %e, "sentinel did not name a master"),
        }
    }
}

/// Asks Sentinel where the master is when dropped armed: a decision its
/// caller gave up on before Redis answered.
struct Abandoned<'a>(Option<&'a Arc<NodeConn>>);

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some(node) = self.0.take() {
            node.clone().failed();
        }
    }
}

/// Makes the Cluster connection anew when dropped armed: a decision that
/// failed, or that its caller gave up on before Redis answered.
struct RenewIfAbandoned<'a>(Option<&'a Arc<ClusterConn>>);

impl Drop for RenewIfAbandoned<'_> {
    fn drop(&mut self) {
        if let Some(cluster) = self.0.take() {
            cluster.renew();
        }
    }
}

/// A script call bounded by `limit`: one Redis never answers (frozen, or
/// cut off without a reset) would hold its lane's call slot for good, and
/// with it held no decision of that thread could go out, to this master or
/// to the one Sentinel names next.
pub(super) async fn bounded<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    // Pinned in place: the timeout wraps a pointer, not a copy of the call.
    let call = std::pin::pin!(call);
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or_else(|_| Err(failed(format!("no answer within {limit:?}; the call was given up"))))
}

/// Whether `e` is a login refused: the Cluster client reports a seed node's
/// refusal only as text inside its own "initial connections" error.
fn refused_login(e: &redis::RedisError) -> bool {
    let text = e.to_string();
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
        || ["AuthenticationFailed", "WRONGPASS", "NOAUTH"].iter().any(|w| text.contains(w))
}

/// Whether `e` is Redis refusing a client that never logged in: a password
/// set (`requirepass`, an ACL) after tollgate connected without one. Redis
/// says it only as a protocol error ("unauthenticated multibulk length")
/// once a command is longer than it lets such a client send.
fn unauthenticated(e: &redis::RedisError) -> bool {
    e.to_string().contains("unauthenticated")
}

impl From<::redis::RedisError> for StoreError {
    fn from(e: ::redis::RedisError) -> Self {
        // A refused login is never transient, though the Cluster client
        // wraps a seed node's refusal in an I/O-kind error of its own.
        let refused = refused_login(&e) || unauthenticated(&e);
        let transient = (e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_timeout()
            || e.is_cluster_error())
            && !refused;
        let source: Box<dyn std::error::Error + Send + Sync> = match unauthenticated(&e) {
            true => format!("Redis asks for a password tollgate was not given (--redis redis://:password@host:port): {e}").into(),
            false => Box::new(e),
        };
        StoreError::Failed {
            store: "redis",
            transient,
            source,
        }
    }
}

/// A failure of tollgate's own side of the Redis connection (a batching
/// task gone, no master known yet): transient.
pub(super) fn failed(reason: impl Into<String>) -> StoreError {
    StoreError::Failed {
        store: "redis",
        transient: true,
        source: reason.into().into(),
    }
}

/// A reply the script never gives.
pub(super) fn bad_reply(reason: impl Into<String>) -> StoreError {
    StoreError::Reply {
        store: "redis",
        reason: reason.into(),
    }
}

impl CounterStore for RedisStore {
    async fn decide(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        let checks = owned_checks(checks);
        match &self.conn {
            Conn::Node(node) => {
                let lane = self.lane(node);
                // A decision given up on (its deadline passed) counts as a
                // failed call: a master that stopped answering without
                // closing (frozen, or cut off by the network) fails no call,
                // and Sentinel would never be asked for the new one.
                let mut abandoned = Abandoned(Some(node));
                // Nothing waiting and a call slot free: go straight out and
                // save the hand-off to the batching task.
                if lane.queued.load(Ordering::Acquire) == 0
                    && let Ok(slot) = lane.slots.clone().try_acquire_owned()
                {
                    let result = lane
                        .link
                        .call(&self.script, &[(&checks, false)], Instant::now())
                        .await
                        .and_then(single);
                    drop(slot);
                    abandoned.0 = None;
                    if result.is_err() {
                        node.clone().failed();
                    }
                    return result;
                }
                lane.queued.fetch_add(1, Ordering::AcqRel);
                let (reply, answer) = oneshot::channel();
                let pending = Pending {
                    checks,
                    asked: Instant::now(),
                    reply,
                };
                if lane.queue.send(pending).is_err() {
                    lane.queued.fetch_sub(1, Ordering::AcqRel);
                    return Err(failed("batching task stopped"));
                }
                let answer = answer.await;
                abandoned.0 = None;
                answer.map_err(|_| failed("batching task stopped"))?
            }
            Conn::Cluster(cluster) => {
                // Given up on (its deadline) or failed: see `ClusterConn::renew`.
                let mut abandoned = RenewIfAbandoned(Some(cluster));
                let answer = self.decide_cluster(cluster, checks).await;
                if answer.is_ok() {
                    abandoned.0 = None;
                }
                answer
            }
        }
    }

    async fn peek(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        let checks = owned_checks(checks);
        match &self.conn {
            Conn::Node(node) => {
                let mut conn = self.lane(node).link.connection().await?;
                single(self.script.call(&mut conn, &[(&checks, true)], Instant::now()).await?)
            }
            Conn::Cluster(cluster) => self.peek_cluster(cluster, checks).await,
        }
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_logins_are_the_masters_and_the_sentinels_own() {
        let auth = SentinelAuth::parse("ops:s3cret");
        assert_eq!(auth.user.as_deref(), Some("ops"));
        assert_eq!(SentinelAuth::parse("s3cret").user, None);
        assert_eq!(SentinelAuth::parse(":s3cret").password, "s3cret");
        assert!(!format!("{auth:?}").contains("s3cret"));
        let urls = ["redis://:pw@127.0.0.1:26379/2".to_string(), "redis://:pw@127.0.0.1:26380/2".to_string()];
        let (sentinels, _) = sentinel_logins(&urls, Some(&auth)).unwrap();
        for s in &sentinels {
            let login = s.redis_settings();
            assert_eq!((login.username(), login.password(), login.db()), (Some("ops"), Some("s3cret"), 0));
        }
        let (sentinels, _) = sentinel_logins(&urls, None).unwrap();
        assert_eq!(sentinels[0].redis_settings().password(), None);
        let mixed = ["redis://:pw@127.0.0.1:26379".to_string(), "redis://127.0.0.1:26380".to_string()];
        assert!(matches!(sentinel_logins(&mixed, None), Err(StoreError::Config(_))));
    }
}
