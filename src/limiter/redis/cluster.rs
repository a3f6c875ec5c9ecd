//! Redis Cluster: a decision's keys grouped by hash tag, each group one
//! atomic call, several groups a dry run everywhere first (see the module
//! above for what that leaves open).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use tokio::sync::Notify;

use super::RedisStore;
use super::script::{OwnedCheck, single};
use crate::limiter::{CheckCount, StoreAnswer, StoreError};

/// The Cluster client and its one multiplexed connection.
pub(super) struct ClusterConn {
    pub(super) client: ClusterClient,
    /// The connection, made on first use and again after a failed call.
    conn: ArcSwapOption<ClusterConnection>,
    /// Whether a task is making one.
    making: Mutex<bool>,
    /// Told when that task ends, with the connection made or not.
    made: Notify,
    /// Why the last making failed.
    failure: Mutex<Option<String>>,
    /// When the connection was last let go for a failed call.
    renewed: Mutex<Option<Instant>>,
}

/// Least time between two renewals of the connection.
const RENEW_EVERY: Duration = Duration::from_secs(1);

impl ClusterConn {
    pub(super) fn new(client: ClusterClient) -> Self {
        ClusterConn {
            client,
            conn: ArcSwapOption::empty(),
            making: Mutex::new(false),
            made: Notify::new(),
            failure: Mutex::new(None),
            renewed: Mutex::new(None),
        }
    }

    /// The connection. One is made on a task of its own: a node that does
    /// not answer holds its connection attempt for a second, longer than a
    /// decision waits, and a making cut short with every decision would
    /// never end.
    async fn get(self: &Arc<Self>) -> Result<ClusterConnection, StoreError> {
        if let Some(conn) = self.conn.load_full() {
            return Ok((*conn).clone());
        }
        let made = self.made.notified();
        tokio::pin!(made);
        made.as_mut().enable();
        self.start_making();
        // Made between the first look and the wait's registration.
        if let Some(conn) = self.conn.load_full() {
            return Ok((*conn).clone());
        }
        made.await;
        match self.conn.load_full() {
            Some(conn) => Ok((*conn).clone()),
            None => {
                let failure = self.failure.lock().unwrap_or_else(|e| e.into_inner()).clone();
                Err(super::failed(failure.unwrap_or_else(|| "no Cluster connection".into())))
            }
        }
    }

    /// Starts making a connection, unless one is being made.
    fn start_making(self: &Arc<Self>) {
        let mut making = self.making.lock().unwrap_or_else(|e| e.into_inner());
        if !*making {
            *making = true;
            tokio::spawn(self.clone().make());
        }
    }

    async fn make(self: Arc<Self>) {
        // However this task ends (its runtime stopping included), the
        // next caller may start another and the waiters look again.
        struct Done(Arc<ClusterConn>);
        impl Drop for Done {
            fn drop(&mut self) {
                *self.0.making.lock().unwrap_or_else(|e| e.into_inner()) = false;
                self.0.made.notify_waiters();
            }
        }
        let done = Done(self);
        match done.0.client.get_async_connection().await {
            // Replaces the one in use, if any: calls already on it finish.
            Ok(conn) => done.0.conn.store(Some(Arc::new(conn))),
            Err(e) => *done.0.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string()),
        }
    }

    /// After a failed call: a master that stopped answering without closing
    /// (frozen, or cut off by the network) sends no MOVED, so the client
    /// would ask it for good, after the cluster promoted its replica. A new
    /// connection is made beside the one in use, reading the slots as the
    /// cluster has them now, and replaces it once made (decisions meanwhile
    /// go on with the old one); at most once a second.
    pub(super) fn renew(self: &Arc<Self>) {
        {
            let mut renewed = self.renewed.lock().unwrap_or_else(|e| e.into_inner());
            if renewed.is_some_and(|t| t.elapsed() < RENEW_EVERY) {
                return;
            }
            *renewed = Some(Instant::now());
        }
        self.start_making();
    }
}

impl RedisStore {
    /// Decides one request's checks over the slots they fall in.
    pub(super) async fn decide_cluster(&self, cluster: &Arc<ClusterConn>, checks: Vec<OwnedCheck>) -> Result<StoreAnswer, StoreError> {
        let mut conn = cluster.get().await?;
        let groups = tag_groups(&checks);
        if groups.len() == 1 {
            return single(self.script.call(&mut conn, &[(&checks, false)], Instant::now()).await?);
        }
        let parts = parts(&groups, &checks);
        let dry = self.dry_run(&mut conn, &groups, &parts, &checks).await?;
        if !dry.admitted {
            return Ok(dry);
        }
        // Between the dry run and a part's charge, any other decision on
        // its counters (this instance's own included) may fill one. The
        // part with the least room is charged first, and the first part
        // that refuses ends the charging: a counter filled meanwhile is
        // most likely the tightest, and then nothing stays charged.
        let mut counts = dry.checks;
        let mut admitted = true;
        let indexes: Vec<&Vec<usize>> = groups.values().collect();
        for g in tightest_first(&groups, &checks, &counts) {
            let (Some(part), Some(idx)) = (parts.get(g), indexes.get(g)) else {
                continue;
            };
            let answer = single(self.script.call(&mut conn, &[(part, false)], Instant::now()).await?)?;
            for (&i, count) in idx.iter().zip(answer.checks) {
                if let Some(slot) = counts.get_mut(i) {
                    *slot = count;
                }
            }
            if !answer.admitted {
                admitted = false;
                break;
            }
        }
        Ok(StoreAnswer {
            admitted,
            checks: counts,
        })
    }

    /// What `checks` would get, charging nothing, over the slots they fall in.
    pub(super) async fn peek_cluster(&self, cluster: &Arc<ClusterConn>, checks: Vec<OwnedCheck>) -> Result<StoreAnswer, StoreError> {
        let mut conn = cluster.get().await?;
        let groups = tag_groups(&checks);
        let parts = parts(&groups, &checks);
        self.dry_run(&mut conn, &groups, &parts, &checks).await
    }

    /// A dry run of every part, and the whole request's verdict from them.
    async fn dry_run(
        &self,
        conn: &mut ClusterConnection,
        groups: &BTreeMap<&str, Vec<usize>>,
        parts: &[Vec<OwnedCheck>],
        checks: &[OwnedCheck],
    ) -> Result<StoreAnswer, StoreError> {
        let mut answers = Vec::with_capacity(parts.len());
        for part in parts {
            answers.push(single(self.script.call(conn, &[(part, true)], Instant::now()).await?)?);
        }
        let enforced = answers.iter().all(|a| a.admitted);
        let counts = in_order(groups, answers, checks.len());
        let quotas: Vec<bool> = checks
            .iter()
            .zip(&counts)
            .filter(|(c, _)| c.quota)
            .map(|(c, n)| c.shadow || n.windows.iter().all(|w| !w.over()))
            .collect();
        Ok(StoreAnswer {
            admitted: enforced && (quotas.is_empty() || quotas.contains(&true)),
            checks: counts,
        })
    }
}

/// The checks' indexes by hash tag: keys with one tag share a slot and can
/// be decided in one call.
fn tag_groups(checks: &[OwnedCheck]) -> BTreeMap<&str, Vec<usize>> {
    let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, c) in checks.iter().enumerate() {
        groups.entry(hash_tag(&c.key)).or_default().push(i);
    }
    groups
}

/// One part per group. Each part is decided alone, but quota mode is a rule
/// about the whole request: parts carry quota checks as shadow ones
/// (charged when they fit, never refusing) and the quota rule is applied
/// over the parts' answers.
fn parts(groups: &BTreeMap<&str, Vec<usize>>, checks: &[OwnedCheck]) -> Vec<Vec<OwnedCheck>> {
    let as_part = |c: &OwnedCheck| OwnedCheck {
        shadow: c.shadow || c.quota,
        quota: false,
        ..c.clone()
    };
    groups
        .values()
        .map(|idx| idx.iter().filter_map(|&i| checks.get(i).map(as_part)).collect())
        .collect()
}

/// The groups' numbers (their order in `groups`), the one with the least
/// room first: a group's room is the least, over its checks that can refuse
/// and their windows, of what `counts` (a dry run's) leave after the check's
/// cost. A group nothing in can refuse comes last; ties keep their order.
fn tightest_first(groups: &BTreeMap<&str, Vec<usize>>, checks: &[OwnedCheck], counts: &[CheckCount]) -> Vec<usize> {
    let room = |idx: &Vec<usize>| {
        idx.iter()
            .filter_map(|&i| Some((checks.get(i)?, counts.get(i)?)))
            .filter(|(c, _)| !c.shadow && !c.quota)
            .flat_map(|(c, n)| {
                c.windows
                    .iter()
                    .zip(&n.windows)
                    .map(|(w, n)| w.requests.saturating_sub(n.used.saturating_add(c.cost)))
            })
            .min()
            .unwrap_or(u64::MAX)
    };
    let mut order: Vec<(u64, usize)> = groups.values().map(room).zip(0..).collect();
    order.sort_by_key(|&(room, _)| room);
    order.into_iter().map(|(_, g)| g).collect()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::WindowCount;

    fn check(key: &str, requests: u64, cost: u64, shadow: bool) -> OwnedCheck {
        OwnedCheck::per_minute(key, requests, cost, shadow)
    }

    fn used(n: u64) -> CheckCount {
        CheckCount {
            charged: false,
            windows: vec![WindowCount {
                used: n,
                reset_ms: 0,
                retry_ms: None,
                never: false,
            }],
        }
    }

    #[test]
    fn the_slot_with_the_least_room_is_charged_first() {
        // Slots a (room 10 - 2 - 1 = 7), b (room 5 - 1 - 3 = 1, and a wide
        // check with room 90), c (a shadow check only: it never refuses).
        let checks = [
            check("tg:2{a}x", 10, 1, false),
            check("tg:2{b}x", 5, 3, false),
            check("tg:2{b}y", 100, 3, false),
            check("tg:2{c}x", 1, 1, true),
        ];
        let counts = [used(2), used(1), used(7), used(50)];
        let groups = tag_groups(&checks);
        assert_eq!(groups.keys().copied().collect::<Vec<_>>(), ["a", "b", "c"]);
        assert_eq!(tightest_first(&groups, &checks, &counts), [1, 0, 2]);
        // Equal room keeps the slots' order.
        let counts = [used(2), used(0), used(0), used(0)];
        let checks = [
            check("tg:2{a}x", 10, 1, false),
            check("tg:2{b}x", 10, 3, false),
            check("tg:2{b}y", 100, 3, false),
            check("tg:2{c}x", 1, 1, true),
        ];
        assert_eq!(tightest_first(&groups, &checks, &counts), [0, 1, 2]);
    }

    #[test]
    fn hash_tags_as_redis_cluster_reads_them() {
        assert_eq!(hash_tag("tg:{3=api|8=10.0.0.7|}5=login|"), "3=api|8=10.0.0.7|");
        assert_eq!(hash_tag("tg:{}x"), "tg:{}x");
        assert_eq!(hash_tag("tg:{a}b}"), "a");
        assert_eq!(hash_tag("plain"), "plain");
    }
}
