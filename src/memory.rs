//! Handing memory the node no longer uses back to the system; and, in a `heap-count` build
//! (for diagnosis, `Counting`), counting what the node's Rust allocations hold.
//!
//! Both allocators of the process keep freed memory for reuse: mimalloc (Rust's allocations,
//! the global allocator of the `vouchers` binary) frees a page only when the thread that owns
//! it next allocates or collects, so a thread that went quiet keeps the pages its stopped
//! actors left; glibc's malloc (SQLite's page caches) keeps freed chunks in its arenas. After a
//! flood of first reserves on a long tail's vouchers that left the node 158 MB against 71 MB
//! untouched once every actor had stopped (docs/PERFORMANCE.md, "The long tail"). The engine
//! calls [`collect_thread`] on the threads its stopped actors ran on, asks the ledger runtime's
//! threads to collect once idle ([`ask_idle_threads`]) and calls [`give_back`] once; the
//! embedded ledger calls [`give_back`] from its expiry sweeper with the writer released. The
//! node's give-back (`Node::give_back_memory`) also runs `PRAGMA shrink_memory` on the writer
//! when it is free at that moment, so a commit that arrives then waits for that one statement;
//! it follows a flood's idle-out, only while the node is quiet, not each reserve.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

// Links mimalloc's library into every binary of the crate (tests too), for `mi_collect`.
use mimalloc as _;

extern "C" {
    /// mimalloc's `mi_collect`: frees what the calling thread's heap holds unused.
    fn mi_collect(force: bool);
}

/// Gives the calling thread's unused mimalloc pages back to the system: a walk of this
/// thread's heap, a few milliseconds at most after a flood.
pub(crate) fn collect_thread() {
    // SAFETY: `mi_collect` takes no pointer and only touches the calling thread's heap (and
    // the process's free segments, under mimalloc's own locks); the library is linked in
    // whichever global allocator the binary chose (with another, it has nothing to collect).
    unsafe { mi_collect(true) };
}

/// Asks every thread that runs [`collect_when_asked`] when it parks (the ledger runtime's
/// workers) to [`collect_thread`] the next time it goes idle.
pub(crate) fn ask_idle_threads() {
    ASKED.fetch_add(1, Ordering::Release);
}

/// A runtime's `on_thread_park` hook: collects once after each [`ask_idle_threads`]. Costs an
/// atomic load per park otherwise.
pub(crate) fn collect_when_asked() {
    let asked = ASKED.load(Ordering::Acquire);
    if SEEN.get() != asked {
        SEEN.set(asked);
        collect_thread();
    }
}

/// How many times idle threads were asked to collect.
static ASKED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The last ask this thread collected for.
    static SEEN: Cell<u64> = const { Cell::new(0) };
}

/// [`collect_thread`], then glibc's free arena memory (process-wide) back to the system.
pub(crate) fn give_back() {
    collect_thread();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes no pointer; glibc locks each arena it trims.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Whether a table of `len` entries that has room for `capacity` is mostly empty: then it is
/// worth shrinking (a flood grew it, and most of what it held is gone). A small table stays as
/// it is.
pub(crate) fn mostly_empty(capacity: usize, len: usize) -> bool {
    capacity > 4 * len + ROOM_KEPT
}

/// Entries a table keeps room for however empty it is.
const ROOM_KEPT: usize = 1024;

/// The global allocator of a `heap-count` build: `A`, counting the bytes its callers hold.
#[cfg(feature = "heap-count")]
pub struct Counting<A>(pub A);

/// Bytes allocated through [`Counting`] and not yet freed.
#[cfg(feature = "heap-count")]
static LIVE: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

#[cfg(feature = "heap-count")]
// SAFETY: every call is passed to `A` unchanged; only the counter is added.
unsafe impl<A: std::alloc::GlobalAlloc> std::alloc::GlobalAlloc for Counting<A> {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { self.0.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
        let p = unsafe { self.0.realloc(ptr, layout, size) };
        if !p.is_null() {
            LIVE.fetch_add(size as i64 - layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
}

/// Sets `vouchers_heap_bytes`: what Rust's allocations hold (a `heap-count` build only), what
/// mimalloc has committed for them, and what glibc's malloc has handed out (SQLite's memory).
/// A no-op in other builds.
pub(crate) fn record_heap() {
    #[cfg(feature = "heap-count")]
    {
        extern "C" {
            fn mi_process_info(
                elapsed_msecs: *mut usize,
                user_msecs: *mut usize,
                system_msecs: *mut usize,
                current_rss: *mut usize,
                peak_rss: *mut usize,
                current_commit: *mut usize,
                peak_commit: *mut usize,
                page_faults: *mut usize,
            );
        }
        let mut v = [0usize; 8];
        let [a, b, c, d, e, f, g, h] = &mut v;
        // SAFETY: eight valid pointers to usize, each written once by mimalloc.
        unsafe { mi_process_info(a, b, c, d, e, f, g, h) };
        // SAFETY: mallinfo2 (glibc 2.33 and later) takes no argument; it locks each arena in
        // turn and walks its free lists (SQLite's allocations wait that long, once a second,
        // in a diagnosis build). In use: the arenas' blocks and the mmapped ones.
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        let glibc = {
            let info = unsafe { libc::mallinfo2() };
            info.uordblks + info.hblkhd
        };
        #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
        let glibc = 0;
        crate::metrics::heap_bytes(LIVE.load(Ordering::Relaxed), v[5], glibc);
    }
}
