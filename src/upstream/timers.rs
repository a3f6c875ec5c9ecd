//! The timers the proxy waits on for an upstream's answer, kept from one
//! exchange for the next.
//!
//! A timer made for each request is registered in tokio's timer wheel on
//! its first wait and taken out again when the answer comes, two trips
//! through the wheel's lock per request (~680 instructions, BENCHMARKS.md).
//! A kept timer is only moved later: tokio extends a registered timer's
//! deadline with one atomic write when the new one is later, as it always
//! is here (the same timeout from a later moment), and the wheel finds
//! the new deadline when the old one comes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep};

/// Most timers kept: a proxy thread's exchanges waiting at once, beyond
/// which a finished one's timer is dropped.
const MOST_KEPT: usize = 1024;

/// Timers of finished exchanges, for one proxy thread (one runtime: a
/// timer belongs to the runtime it was made on).
#[derive(Default)]
pub struct SpareTimers {
    kept: Mutex<Vec<Pin<Box<Sleep>>>>,
}

impl SpareTimers {
    /// A timer that completes at `deadline`, kept again when dropped.
    pub fn until(&self, deadline: Instant) -> Timer<'_> {
        let kept = self.kept.lock().ok().and_then(|mut kept| kept.pop());
        let sleep = match kept {
            Some(mut sleep) => {
                sleep.as_mut().reset(deadline);
                sleep
            }
            None => Box::pin(tokio::time::sleep_until(deadline)),
        };
        Timer {
            sleep: Some(sleep),
            home: self,
        }
    }
}

/// A timer lent by [`SpareTimers`].
pub struct Timer<'a> {
    sleep: Option<Pin<Box<Sleep>>>,
    home: &'a SpareTimers,
}

impl Future for Timer<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.sleep.as_mut() {
            Some(sleep) => sleep.as_mut().poll(cx),
            None => Poll::Ready(()),
        }
    }
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        let Some(sleep) = self.sleep.take() else { return };
        // One that has rung would be put in the wheel again when next
        // lent, as a new one is: not worth keeping.
        if sleep.is_elapsed() {
            return;
        }
        if let Ok(mut kept) = self.home.kept.lock()
            && kept.len() < MOST_KEPT
        {
            kept.push(sleep);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_kept_timer_rings_at_its_new_deadline_not_its_old_one() {
        let timers = SpareTimers::default();
        let start = Instant::now();
        // Lent and given back unrung, as when an answer comes in time.
        let first = timers.until(start + Duration::from_secs(1));
        let _ = tokio::time::timeout(Duration::from_millis(10), first).await;
        assert_eq!(timers.kept.lock().unwrap().len(), 1);
        // Lent again for later: its old deadline passes without a ring.
        let again = timers.until(start + Duration::from_secs(3));
        assert_eq!(timers.kept.lock().unwrap().len(), 0, "the kept one was lent");
        let mut again = std::pin::pin!(again);
        assert!(
            tokio::time::timeout_at(start + Duration::from_secs(2), again.as_mut())
                .await
                .is_err(),
            "not rung at the old deadline"
        );
        again.await;
        assert_eq!(Instant::now(), start + Duration::from_secs(3));
        // A timer that rang is not kept.
        assert_eq!(timers.kept.lock().unwrap().len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn timers_lent_at_once_are_each_their_own() {
        let timers = SpareTimers::default();
        let start = Instant::now();
        let short = timers.until(start + Duration::from_secs(1));
        let long = timers.until(start + Duration::from_secs(5));
        short.await;
        assert_eq!(Instant::now(), start + Duration::from_secs(1));
        long.await;
        assert_eq!(Instant::now(), start + Duration::from_secs(5));
    }
}
