//! The `vouchers` binary: load settings, set up logging, run the application until stopped.

use std::sync::Arc;

use anyhow::Context;
use vouchers::clock::SystemClock;
use vouchers::config::{config_file_from_args, Settings};
use vouchers::startup::Application;

/// mimalloc rather than glibc's malloc: the embedded ledger's commit allocates on the ledger's
/// thread what the HTTP workers free, and glibc's arenas spent a tenth of a never-sells-out
/// request's CPU on it (`_int_malloc`, `_int_free`, `malloc_consolidate` in a perf profile).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
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
