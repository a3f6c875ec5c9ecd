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
//!
//! The process's allocator ([`Allocator`]) is mimalloc asked for plain
//! blocks wherever a plain block is aligned enough, which is nearly always.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;
use std::time::Duration;

use libmimalloc_sys as mi;

/// Alignment every mimalloc block has, whatever its size: blocks are whole
/// machine words within word-aligned pages.
const PLAIN_ALIGN: usize = std::mem::size_of::<usize>();

/// mimalloc as the global allocator (`main` installs it).
///
/// The `mimalloc` crate's allocator asks for an aligned block every time,
/// and mimalloc answers an aligned request for more than 1 KB (of a size
/// not a power of two) by allocating `size + align - 1` and aligning inside
/// it: ~300 instructions instead of ~30, and a block the exact size of a
/// class (1,280 bytes, 3,072) taken from the next class up.
/// Five such allocations a proxied request cost ~3 % of its instructions
/// (BENCHMARKS.md §65). Rust asks for at most word alignment almost
/// always, which every block has, so those go to the plain calls.
pub struct Allocator;

// SAFETY: every block comes from mimalloc, aligned as asked (plain blocks
// are word-aligned, larger alignments go to the aligned calls), and goes
// back to it; mimalloc is thread-safe.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: mimalloc takes any size; the alignment is a power of two.
        unsafe {
            match layout.align() <= PLAIN_ALIGN {
                true => mi::mi_malloc(layout.size()),
                false => mi::mi_malloc_aligned(layout.size(), layout.align()),
            }
            .cast()
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        unsafe {
            match layout.align() <= PLAIN_ALIGN {
                true => mi::mi_zalloc(layout.size()),
                false => mi::mi_zalloc_aligned(layout.size(), layout.align()),
            }
            .cast()
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator, so from mimalloc.
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout`'s alignment,
        // which the new block keeps.
        unsafe {
            match layout.align() <= PLAIN_ALIGN {
                true => mi::mi_realloc(ptr.cast::<c_void>(), new_size),
                false => mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()),
            }
            .cast()
        }
    }
}

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
    fn blocks_are_aligned_as_asked_and_keep_their_bytes() {
        let heap = Allocator;
        for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
            for size in [1, 7, 8, 9, 24, 100, 1000, 1025, 4096, 5000, 70_000] {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: a non-zero size; each block is freed once, with
                // its layout.
                unsafe {
                    let p = heap.alloc(layout);
                    assert!(!p.is_null() && (p as usize).is_multiple_of(align), "{size} at {align}");
                    std::ptr::write_bytes(p, 0xab, size);
                    let grown = heap.realloc(p, layout, size * 3);
                    assert!(
                        !grown.is_null() && (grown as usize).is_multiple_of(align),
                        "{size} grown at {align}"
                    );
                    assert!(std::slice::from_raw_parts(grown, size).iter().all(|&b| b == 0xab));
                    heap.dealloc(grown, Layout::from_size_align(size * 3, align).unwrap());
                    let z = heap.alloc_zeroed(layout);
                    assert!(
                        !z.is_null() && (z as usize).is_multiple_of(align),
                        "{size} zeroed at {align}"
                    );
                    assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                    heap.dealloc(z, layout);
                }
            }
        }
    }

    #[test]
    fn a_block_takes_the_size_class_it_fits() {
        // Asked for aligned, a 1,280-byte block took 1,287 bytes from the
        // 1,536-byte class: a fifth more memory for each one held.
        for size in [1280, 1536, 2560, 3072, 5120, 6144, 10_240] {
            let layout = Layout::from_size_align(size, 8).unwrap();
            // SAFETY: allocated and freed once, with its layout.
            unsafe {
                let p = Allocator.alloc(layout);
                assert!(!p.is_null());
                assert_eq!(mi::mi_usable_size(p.cast::<c_void>()), size);
                Allocator.dealloc(p, layout);
            }
        }
    }

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
