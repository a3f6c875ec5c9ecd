//! Counters in Redis streams, shared by every tollgate instance.
//!
//! One decision is one `EVALSHA` of `decide.lua` with every key of the request:
//! one round trip, atomic on the server, and its cost does not grow with the
//! number of entries in a window (see the script for the prefix-sum layout).
//! Time is Redis's own `TIME`, so instances with skewed clocks agree.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};

use super::{Check, CheckCount, Clock, CounterStore, StoreAnswer, StoreError, WindowCount};

/// The decision script, loaded once per server and then called by hash.
const DECIDE_LUA: &str = include_str!("decide.lua");

/// Counters kept in one Redis server.
pub struct RedisStore {
    conn: ConnectionManager,
    script: Script,
    pinned_clock: Option<Arc<dyn Clock>>,
    /// The server as it may be logged: no user name or password.
    display: String,
}

impl RedisStore {
    /// Prepares a connection to `url` (`redis://[user:password@]host:port/db`).
    /// Connecting happens on first use, so tollgate starts while Redis is down.
    ///
    /// `pinned_clock` replaces Redis `TIME` and is meant for tests that step
    /// time by hand; production passes `None`.
    pub fn connect(url: &str, pinned_clock: Option<Arc<dyn Clock>>) -> Result<Self, StoreError> {
        let client = Client::open(url)?;
        let info = client.get_connection_info();
        let display = format!("{}", info.addr());
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(200));
        let conn = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(RedisStore {
            conn,
            script: Script::new(DECIDE_LUA),
            pinned_clock,
            display,
        })
    }

    /// The server address, safe to log (never carries credentials).
    pub fn server(&self) -> &str {
        &self.display
    }
}

impl CounterStore for RedisStore {
    async fn decide(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        let mut call = self.script.prepare_invoke();
        call.arg(self.pinned_clock.as_ref().map_or(0, |c| c.now_ms()));
        for check in checks {
            call.key(check.key);
            call.arg(check.cost)
                .arg(u8::from(check.shadow))
                .arg(check.windows.len());
            for w in check.windows {
                call.arg(w.requests).arg(w.period_ms);
            }
        }
        let mut conn = self.conn.clone();
        let reply: Vec<i64> = call.invoke_async(&mut conn).await?;
        parse_reply(&reply, checks)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        redis::cmd("PING").query_async::<()>(&mut conn).await?;
        Ok(())
    }
}

fn parse_reply(reply: &[i64], checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
    let expected = 1 + checks.iter().map(|c| 1 + 3 * c.windows.len()).sum::<usize>();
    if reply.len() != expected {
        return Err(StoreError::Reply(format!(
            "{} integers, expected {expected}",
            reply.len()
        )));
    }
    let mut values = reply.iter().copied();
    let mut next = || values.next().unwrap_or(0);
    let admitted = next() == 1;
    let checks = checks
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
    Ok(StoreAnswer { admitted, checks })
}
