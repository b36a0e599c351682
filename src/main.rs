//! The `vouchers` binary: load settings, set up logging, run the application until stopped.

use std::sync::Arc;

use anyhow::Context;
use vouchers::clock::SystemClock;
use vouchers::config::{config_file_from_args, Settings};
use vouchers::startup::Application;

/// mimalloc rather than glibc's malloc: the embedded ledger's commit allocates on the ledger's
/// thread what the HTTP workers free, and glibc's arenas spent a tenth of a never-sells-out
/// request's CPU on it (`_int_malloc`, `_int_free`, `malloc_consolidate` in a perf profile).
#[cfg(not(any(feature = "heap-count", feature = "system-alloc")))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The same, counting what it holds (`--features heap-count`, for diagnosis).
#[cfg(all(feature = "heap-count", not(feature = "system-alloc")))]
#[global_allocator]
static ALLOCATOR: vouchers::Counting<mimalloc::MiMalloc> = vouchers::Counting(mimalloc::MiMalloc);

/// glibc's malloc, counted (`--features heap-count,system-alloc`: under heaptrack too).
#[cfg(all(feature = "heap-count", feature = "system-alloc"))]
#[global_allocator]
static ALLOCATOR: vouchers::Counting<std::alloc::System> = vouchers::Counting(std::alloc::System);

fn main() -> anyhow::Result<()> {
    no_huge_pages();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let file = config_file_from_args(std::env::args());
    let settings = Settings::load(file.as_deref()).context("load configuration")?;
    actix_rt::System::new().block_on(async move {
        let app = Application::build(settings, Arc::new(SystemClock)).await?;
        app.run_until_stopped().await
    })
}

/// Transparent huge pages off for this process. mimalloc (built with `no_thp`) no longer asks
/// for them, but on a host whose THP setting is `always` the kernel would still fill whole
/// 2 MiB pages around the few blocks an idle node keeps: its RSS crept from 222 to 268 MB in
/// 80 s with no traffic (docs/PERFORMANCE.md, "The long tail"). A refusal changes nothing else.
fn no_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments and applies to this process only.
    unsafe {
        let _ = libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}
