//! The thread reloads run on: one at a time, below the request threads.
//!
//! Reading and checking a large limits file takes tens of milliseconds of
//! CPU (10,000 rules: ~60 ms). On a machine whose cores the request threads
//! keep busy, that work would take its share of a core away from requests
//! while it runs; at a lower priority it takes what they leave, and the
//! catalog in force keeps answering until the new one is swapped in.

use std::sync::OnceLock;
use std::sync::mpsc;

type Job = Box<dyn FnOnce() + Send>;

/// The nice value of the reload thread: low enough that request threads
/// win the core, high enough that a saturated machine still reloads within
/// about a second.
const NICENESS: i32 = 10;

/// Runs `job` on the reload thread and waits for it, without blocking the
/// caller's runtime.
pub(crate) async fn run(job: impl FnOnce() + Send + 'static) {
    let (done, finished) = tokio::sync::oneshot::channel::<()>();
    let job: Job = Box::new(move || {
        job();
        let _ = done.send(());
    });
    if let Err(mpsc::SendError(job)) = worker().send(job) {
        // The thread could not be started: run where blocking is allowed.
        let _ = tokio::task::spawn_blocking(job).await;
        return;
    }
    // A job that panicked drops `done`; the thread carries on.
    let _ = finished.await;
}

fn worker() -> &'static mpsc::Sender<Job> {
    static WORKER: OnceLock<mpsc::Sender<Job>> = OnceLock::new();
    WORKER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        let started = std::thread::Builder::new()
            .name("tollgate-reload".into())
            .spawn(move || {
                lower_priority();
                for job in rx {
                    // The panic is reported by the hook; the next reload still runs.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            });
        if let Err(e) = started {
            tracing::error!(error = %e, "cannot start the reload thread; reloading on the blocking pool");
        }
        tx
    })
}

#[cfg(target_os = "linux")]
fn lower_priority() {
    // SAFETY: gettid and setpriority take no pointers; on Linux, priority is
    // per thread, and this one changes only the calling thread's.
    let failed = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, NICENESS) } != 0;
    if failed {
        tracing::debug!(error = %std::io::Error::last_os_error(), "cannot lower the reload thread's priority");
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_priority() {}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn jobs_run_in_turn_and_a_panic_spares_the_next() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let s = seen.clone();
        super::run(move || s.lock().unwrap().push(1)).await;
        super::run(|| panic!("a job that fails")).await;
        let s = seen.clone();
        super::run(move || s.lock().unwrap().push(2)).await;
        assert_eq!(*seen.lock().unwrap(), vec![1, 2]);
    }
}
