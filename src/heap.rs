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
//! mimalloc (the binary's allocator) returns a free page to the system a
//! second after it is freed, and only from inside a later allocator call.
//! Pages a burst of connections dirtied and freed were handed out again
//! still resident, to hold a few objects that live as long as a parked
//! connection: in about half the runs 10,000 parked connections cost
//! ~0.5 KB more each. So pages go back after 100 ms
//! ([`purge_free_pages_sooner`]). Not at once: with no delay, a page that
//! one request's allocations empty is given back and faulted in again by
//! the next, and a build that allocated 8 KB more per request lost 20 % of
//! its req/s under wrk (BENCHMARKS.md §35-36). After a burst closes or
//! parks there may be no allocator call for hours, so each worker thread
//! also asks its heap every few seconds to release what is free: a walk
//! over its pages, microseconds when there is nothing to return.

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

/// mimalloc's `mi_option_purge_delay` (its option enum is append-only;
/// the Rust bindings do not name this one).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// How long a page stays free before mimalloc gives it back (its default
/// is 1,000 ms).
const PURGE_DELAY_MS: std::ffi::c_long = 100;

/// Makes mimalloc give a free page back to the system after
/// [`PURGE_DELAY_MS`] (BENCHMARKS.md §35). An operator's
/// `MIMALLOC_PURGE_DELAY` still wins.
pub fn purge_free_pages_sooner() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: sets one of mimalloc's options, an integer it reads under its
    // own synchronisation; no pointers are involved.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        // SAFETY: reads an integer option; no pointers.
        let get = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        // mimalloc's purge delay defaults to 1,000 ms, and no option next
        // to it does: this pins the index the bindings do not name.
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(get(), 1000);
        }
        purge_free_pages_sooner();
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(get(), PURGE_DELAY_MS);
        }
    }
}
