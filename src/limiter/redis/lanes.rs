//! Per-thread lanes to one node: each thread that decides has its own
//! connection, queue and batching task, and decisions waiting together go
//! out as one script call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::script::{DecideScript, OwnedCheck};
use super::{NodeConn, manager_config};
use crate::limiter::{StoreAnswer, StoreError};

/// Most decisions sent in one call.
const MAX_BATCH: usize = 64;
/// Most counters in one batched call: Redis runs a script alone, so one
/// call must stay short next to the decision deadline (~10 us per counter).
const MAX_BATCH_KEYS: usize = 256;
/// Calls in flight at once on one lane's connection. Fewer in flight means
/// more decisions wait for the next call and share it: with a lane per
/// thread, 2 (4 before lanes) halved the calls per decision under load and
/// did not cost throughput (BENCHMARKS.md, change 8). Since a hot
/// counter's decisions go as one run, a call costs Redis about the same
/// however many of them it carries, and 1 took 40 % fewer calls and
/// 25-30 % of Redis's CPU per request, with no tail shown (change 58).
const MAX_IN_FLIGHT: usize = 1;
// `send_batches` makes a lane's calls one after another.
const _: () = assert!(MAX_IN_FLIGHT == 1, "send_batches calls in turn: give each call a task to have more in flight");
/// One thread's way to the node: its own connection, queue and batching
/// task, all on that thread's runtime.
pub(super) struct Lane {
    pub(super) link: Arc<LaneLink>,
    pub(super) queue: mpsc::UnboundedSender<Pending>,
    /// Decisions in the queue, so an idle lane can skip it.
    pub(super) queued: Arc<AtomicUsize>,
    /// Calls in flight on this lane's connection (batched or direct).
    pub(super) slots: Arc<Semaphore>,
}

/// How long a connection may go without a call before the next call is
/// preceded by a PING: Redis's `timeout` is whole seconds, so one quiet
/// for less was not closed for being idle.
const QUIET: Duration = Duration::from_secs(1);

/// A lane's connection, made again when the node's client changes.
pub(super) struct LaneLink {
    pub(super) node: Arc<NodeConn>,
    pub(super) conn: Mutex<Option<(u64, ConnectionManager)>>,
    /// When the connection was last handed out for a call.
    pub(super) last_call: Mutex<Option<Instant>>,
    /// How long a call is waited for (the script's call limit).
    pub(super) call_limit: Duration,
}

/// One decision waiting for a call.
pub(super) struct Pending {
    pub(super) checks: Vec<OwnedCheck>,
    /// When it began to wait: its deadline counts from here.
    pub(super) asked: Instant,
    pub(super) reply: oneshot::Sender<Result<StoreAnswer, StoreError>>,
}

impl LaneLink {
    /// The connection, ready for a call. One that has been quiet for
    /// [`QUIET`] or more is sent a PING first: a Redis that closed it in
    /// the meantime (its `timeout`, a restart, a proxy's idle timer) is
    /// found out by the PING, and the call then waits for the new
    /// connection the manager makes, rather than failing a decision with
    /// "broken pipe" (an uncounted admission, or a 503 for a rule that
    /// fails closed) on every thread after every quiet spell. Under load
    /// no PING is sent.
    pub(super) async fn connection(&self) -> Result<ConnectionManager, StoreError> {
        let mut conn = self.get()?;
        let quiet = {
            let mut last = self.last_call.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let quiet = last.is_some_and(|t| now.saturating_duration_since(t) >= QUIET);
            *last = Some(now);
            quiet
        };
        if quiet {
            // Its failure only starts the manager's reconnection; the call
            // that follows waits for it, and fails itself if it must.
            let _: Result<redis::Value, _> = redis::cmd("PING").query_async(&mut conn).await;
        }
        Ok(conn)
    }

    /// One script call of `decisions` on the connection, the PING a quiet
    /// one is sent first included, given up past the script's call limit:
    /// a Redis that stopped answering would otherwise hold the call's slot,
    /// and with it held, every later decision of the thread would wait.
    /// `asked`: when the first of them began to wait.
    pub(super) async fn call(
        &self,
        script: &DecideScript,
        decisions: &[(&[OwnedCheck], bool)],
        asked: Instant,
    ) -> Result<Vec<StoreAnswer>, StoreError> {
        super::bounded(script.call_limit(), async {
            let mut conn = self.connection().await?;
            script.call(&mut conn, decisions, asked).await
        })
        .await
    }

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
            .ok_or_else(|| super::failed("no master known yet (asking Sentinel)"))?;
        // Lazy: connects on first use, on this lane's runtime.
        let manager = ConnectionManager::new_lazy_with_config(client, manager_config(self.call_limit))?;
        *conn = Some((generation, manager.clone()));
        Ok(manager)
    }
}

impl Lane {
    pub(super) fn start(node: Arc<NodeConn>, script: DecideScript) -> Lane {
        let link = Arc::new(LaneLink {
            node,
            conn: Mutex::new(None),
            last_call: Mutex::new(None),
            call_limit: script.call_limit(),
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
        // Called here, not in a task of its own: with one call in flight
        // a lane's next batch waits for this one's slot anyway, and a task
        // per call cost ~1,000 instructions a batch, the future copied
        // into its box and scheduled (BENCHMARKS.md §67).
        let decisions: Vec<(&[OwnedCheck], bool)> = batch.iter().map(|p| (&p.checks[..], false)).collect();
        let asked = batch.iter().map(|p| p.asked).min().unwrap_or_else(Instant::now);
        let result = link.call(&script, &decisions, asked).await;
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
                    let _ = p.reply.send(Err(super::failed(message.clone())));
                }
            }
        }
        drop(slot);
    }
}

