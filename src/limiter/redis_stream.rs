//! Counters in Redis streams, shared by every tollgate instance.
//!
//! A decision is one `EVALSHA` of `decide.lua` with every key of the request:
//! atomic on the server, and its cost does not grow with the number of
//! entries in a window (see the script for the prefix-sum layout). Time is
//! Redis's own `TIME`, so instances with skewed clocks agree.
//!
//! Under concurrency, decisions waiting for Redis are sent together in one
//! `EVALSHA` (up to [`MAX_BATCH`], with a few calls in flight): the script
//! decides them one after the other, each atomically, and the per-call cost
//! on both sides (command parsing, script set-up, a wake-up per reply) is
//! paid once per batch instead of once per request. An idle caller waits for
//! no one: a batch is whatever is queued when a call can go out.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::{Check, CheckCount, Clock, CounterStore, StoreAnswer, StoreError, WindowCount};
use crate::config::Window;

/// The decision script, loaded once per server and then called by hash.
const DECIDE_LUA: &str = include_str!("decide.lua");
/// Most decisions sent in one call.
pub const MAX_BATCH: usize = 64;
/// Calls in flight at once on the connection.
const MAX_IN_FLIGHT: usize = 4;

/// Counters kept in one Redis server.
pub struct RedisStore {
    conn: ConnectionManager,
    queue: mpsc::UnboundedSender<Pending>,
    /// The server as it may be logged: no user name or password.
    display: String,
}

/// One decision waiting for a call.
struct Pending {
    checks: Vec<OwnedCheck>,
    reply: oneshot::Sender<Result<StoreAnswer, StoreError>>,
}

struct OwnedCheck {
    key: String,
    windows: Vec<Window>,
    cost: u64,
    shadow: bool,
}

impl RedisStore {
    /// Prepares a connection to `url` (`redis://[user:password@]host:port/db`).
    /// Connecting happens on first use, so tollgate starts while Redis is down.
    /// Must be called inside a tokio runtime (it starts the batching task).
    ///
    /// `pinned_clock` replaces Redis `TIME` and is meant for tests that step
    /// time by hand; production passes `None`.
    pub fn connect(url: &str, pinned_clock: Option<Arc<dyn Clock>>) -> Result<Self, StoreError> {
        let client = Client::open(url)?;
        let display = format!("{}", client.get_connection_info().addr());
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(200));
        let conn = ConnectionManager::new_lazy_with_config(client, config)?;
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_batches(rx, conn.clone(), Script::new(DECIDE_LUA), pinned_clock));
        Ok(RedisStore { conn, queue, display })
    }

    /// The server address, safe to log (never carries credentials).
    pub fn server(&self) -> &str {
        &self.display
    }
}

impl CounterStore for RedisStore {
    async fn decide(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        let checks = checks
            .iter()
            .map(|c| OwnedCheck {
                key: c.key.to_string(),
                windows: c.windows.to_vec(),
                cost: c.cost,
                shadow: c.shadow,
            })
            .collect();
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Pending { checks, reply })
            .map_err(|_| StoreError::Batch("batching task stopped".into()))?;
        answer
            .await
            .map_err(|_| StoreError::Batch("batching task stopped".into()))?
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        redis::cmd("PING").query_async::<()>(&mut conn).await?;
        Ok(())
    }
}

/// Takes whatever is queued (up to [`MAX_BATCH`]) whenever a call may go
/// out, and sends it as one script call.
async fn send_batches(
    mut rx: mpsc::UnboundedReceiver<Pending>,
    conn: ConnectionManager,
    script: Script,
    pinned_clock: Option<Arc<dyn Clock>>,
) {
    let script = Arc::new(script);
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = rx.recv().await else { return };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        let pinned = pinned_clock.as_ref().map_or(0, |c| c.now_ms());
        let (mut conn, script) = (conn.clone(), script.clone());
        tokio::spawn(async move {
            let result = call(&script, &mut conn, pinned, &batch).await;
            match result {
                Ok(answers) => {
                    for (p, a) in batch.into_iter().zip(answers) {
                        let _ = p.reply.send(Ok(a));
                    }
                }
                Err(e) => {
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

async fn call(
    script: &Script,
    conn: &mut ConnectionManager,
    pinned: u64,
    batch: &[Pending],
) -> Result<Vec<StoreAnswer>, StoreError> {
    let mut call = script.prepare_invoke();
    call.arg(pinned).arg(batch.len());
    for p in batch {
        call.arg(p.checks.len());
        for check in &p.checks {
            call.key(&check.key);
            call.arg(check.cost)
                .arg(u8::from(check.shadow))
                .arg(check.windows.len());
            for w in &check.windows {
                call.arg(w.requests).arg(w.period_ms);
            }
        }
    }
    let reply: Vec<i64> = call.invoke_async(conn).await?;
    parse_reply(&reply, batch)
}

fn parse_reply(reply: &[i64], batch: &[Pending]) -> Result<Vec<StoreAnswer>, StoreError> {
    let expected: usize = batch
        .iter()
        .map(|p| 1 + p.checks.iter().map(|c| 1 + 3 * c.windows.len()).sum::<usize>())
        .sum();
    if reply.len() != expected {
        return Err(StoreError::Reply(format!(
            "{} integers, expected {expected}",
            reply.len()
        )));
    }
    let mut values = reply.iter().copied();
    let mut next = || values.next().unwrap_or(0);
    let answers = batch
        .iter()
        .map(|p| {
            let admitted = next() == 1;
            let checks = p
                .checks
                .iter()
                .map(|check| {
                    let charged = next() == 1;
                    let windows = check
                        .windows
                        .iter()
                        .map(|_| {
                            let used = next().max(0) as u64;
                            let reset_ms = next().max(0) as u64;
                            let retry = next();
                            WindowCount {
                                used,
                                reset_ms,
                                retry_ms: (retry >= 0).then_some(retry as u64),
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
