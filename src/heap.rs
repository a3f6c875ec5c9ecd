//! Gives freed memory back to the operating system when the process goes
//! quiet.
//!
//! mimalloc backs its arena with transparent huge pages where the system
//! allows them (Debian's default: on `madvise`), and a 2 MB page stays
//! resident while any of it is in use: after a burst of 8,000 connections
//! closed, RSS stayed ~2x what it was before. So the process opts out of
//! them at start ([`no_transparent_huge_pages`]); req/s through the proxy
//! did not change measurably (BENCHMARKS.md).
//!
//! mimalloc (the binary's allocator) returns pages that have been free for
//! a while only from inside later allocator calls. After a burst of
//! connections closes, or parks idle, there may be none for hours, and the
//! resident size stays at the burst's peak. So each worker thread asks its
//! heap every few seconds to return what is free (forced: not only what
//! has been free for mimalloc's purge delay, which left ~0.3 KB more per
//! parked connection resident): a walk over its pages, microseconds when
//! there is nothing to return.

use std::time::Duration;

/// Opts the process out of transparent huge pages (Linux's
/// `PR_SET_THP_DISABLE`); the first thing `main` does, before the arena
/// fills. Elsewhere, or if the kernel refuses, nothing changes.
pub fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl with PR_SET_THP_DISABLE only sets a flag of the process.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

/// How often each thread's heap is asked.
const EVERY: Duration = Duration::from_secs(2);

/// Asks the calling thread's heap, every [`EVERY`], to return its free
/// pages. Runs until dropped.
pub async fn return_free_pages() {
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // SAFETY: mi_collect takes no pointers; it only frees what the
        // calling thread's heap no longer uses. When mimalloc
        // is not the global allocator (the library's tests) its heaps are
        // empty and this does nothing.
        unsafe { libmimalloc_sys::mi_collect(true) };
    }
}
