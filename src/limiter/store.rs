//! What a counter store is asked and answers: the [`CounterStore`] trait
//! both stores implement (memory and Redis), the checks of one request, the
//! counts per window, and backend-neutral [`StoreError`]s.

use std::future::Future;
use std::time::Duration;

use super::{MemoryStore, RedisStore};
use crate::config::Window;

/// One counter to check (and charge) for one request.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The counter's key in the store.
    pub key: &'a str,
    /// Every window of the counter's rule; all must have room.
    pub windows: &'a [Window],
    /// Units this request takes from each window (0: check only).
    pub cost: u64,
    /// A shadow counter never refuses the request.
    pub shadow: bool,
    /// A quota counter refuses only when every quota counter of the request
    /// lacks room (envoyproxy/ratelimit's `quota_mode`); a shadow one has room.
    pub quota: bool,
}

/// What the store saw in one window, before this request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowCount {
    /// Units inside the window before this request.
    pub used: u64,
    /// Milliseconds until the oldest counted unit leaves the window.
    pub reset_ms: u64,
    /// Milliseconds until this request's cost fits; `None` when it fits now
    /// or never will.
    pub retry_ms: Option<u64>,
    /// The request asks more of this window than its whole limit: it can
    /// never fit, however long it waits.
    pub never: bool,
}

impl WindowCount {
    /// Whether this window has no room for the request.
    pub fn over(&self) -> bool {
        self.never || self.retry_ms.is_some()
    }
}

/// What the store did with one counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckCount {
    /// Whether this request was added to the counter.
    pub charged: bool,
    /// One entry per window, in the order given.
    pub windows: Vec<WindowCount>,
}

/// The store's answer for a whole request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreAnswer {
    /// True when every enforcing counter had room in every window, and one
    /// quota counter did (if there were any).
    pub admitted: bool,
    /// One entry per check, in the order given.
    pub checks: Vec<CheckCount>,
}

/// Why the store could not answer. Backend-neutral: each store converts
/// its own errors (the Redis store: `limiter::redis`).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store did not answer within the decision deadline.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The store failed to answer: connection, I/O or a server error.
    #[error("{store}: {source}")]
    Failed {
        /// Which store (`redis`), also the failure's metric label.
        store: &'static str,
        /// Whether asking again soon may succeed (a lost connection, a
        /// failover) rather than not until an operator acts.
        transient: bool,
        /// What went wrong.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The store answered something it never should.
    #[error("unexpected reply from {store}: {reason}")]
    Reply {
        /// Which store.
        store: &'static str,
        /// What was wrong with it.
        reason: String,
    },
    /// The store cannot be set up as asked (at start-up).
    #[error("{0}")]
    Config(String),
}

impl StoreError {
    /// The `kind` label of `tollgate_store_errors_total`.
    pub fn label(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Failed { store, .. } => store,
            StoreError::Reply { .. } => "reply",
            StoreError::Config(_) => "config",
        }
    }

    /// Whether asking again soon may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Timeout(_) => true,
            StoreError::Failed { transient, .. } => *transient,
            StoreError::Reply { .. } | StoreError::Config(_) => false,
        }
    }
}

/// Where counters live. Implementations decide a whole request atomically:
/// they charge every check that fits when the request is admitted (every
/// check that is neither shadow nor quota fits, and some quota check fits
/// or is shadow, if there are quota checks), and charge nothing otherwise.
pub trait CounterStore: Send + Sync {
    /// Checks every window of every counter and charges them together.
    fn decide(&self, checks: &[Check<'_>]) -> impl Future<Output = Result<StoreAnswer, StoreError>> + Send;

    /// Checks every window of every counter with the real costs and charges
    /// nothing: what [`CounterStore::decide`] would answer now (an
    /// operator's dry run).
    fn peek(&self, checks: &[Check<'_>]) -> impl Future<Output = Result<StoreAnswer, StoreError>> + Send;

    /// Notes that these counters were asked about without a decision (a
    /// refusal from the denial cache), so the store keeps them as in use.
    /// A store that cannot see it cheaply does nothing.
    fn touch<'a>(&self, _keys: impl Iterator<Item = &'a str>) {}

    /// Whether the store answers in this process without waiting on I/O,
    /// so a decision needs no deadline timer.
    fn in_process(&self) -> bool {
        false
    }
}

/// The stores tollgate can run with, picked at start-up.
pub enum Store {
    /// In-process counters for a single instance (the embedded default).
    Memory(MemoryStore),
    /// Counters in Redis, shared by every instance.
    Redis(RedisStore),
}

impl Store {
    /// The store's name in logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
        }
    }
}

impl CounterStore for Store {
    async fn decide(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        match self {
            Store::Memory(s) => s.decide(checks).await,
            Store::Redis(s) => s.decide(checks).await,
        }
    }

    async fn peek(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        match self {
            Store::Memory(s) => s.peek(checks).await,
            Store::Redis(s) => s.peek(checks).await,
        }
    }

    fn touch<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        match self {
            Store::Memory(s) => s.touch(keys),
            Store::Redis(s) => s.touch(keys),
        }
    }

    fn in_process(&self) -> bool {
        match self {
            Store::Memory(s) => s.in_process(),
            Store::Redis(s) => s.in_process(),
        }
    }
}

