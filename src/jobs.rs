//! Background jobs: expiry of unconfirmed reservations, the lease reaper, the reconciler, the
//! emergency switches' refresh, the live numbers, pre-heat, and the rate limiters' upkeep.
//! Each is a loop around one [`EngineHandle`] call whose ledger statement is safe to run on every
//! node at once (status-guarded updates), so no leader is needed.

use std::future::Future;
use std::time::Duration;

use crate::config::JobSettings;
use crate::engine::EngineHandle;

/// How often rate limiters drop the keys that refilled.
const LIMITS_UPKEEP_MS: u64 = 10_000;

/// The running jobs; dropping or stopping them ends the loops.
pub struct Jobs(Vec<tokio::task::JoinHandle<()>>);

impl Jobs {
    pub fn stop(self) {
        for j in self.0 {
            j.abort();
        }
    }
}

/// Starts every job on the current runtime.
pub fn start(engine: &EngineHandle, s: &JobSettings) -> Jobs {
    let batch = s.expiry_batch;
    let e = engine.clone();
    let expiry = every(s.expiry_interval_ms, move || {
        let e = e.clone();
        async move {
            if let Err(err) = e.expire_due(batch).await {
                crate::metrics::ledger_error("jobs");
                tracing::warn!(error = %err, "expiry sweep failed");
            }
        }
    });
    let e = engine.clone();
    let reaper = every(s.reaper_interval_ms, move || {
        let e = e.clone();
        async move {
            if let Err(err) = e.reap_expired().await {
                crate::metrics::ledger_error("jobs");
                tracing::warn!(error = %err, "lease reaper failed");
            }
        }
    });
    let e = engine.clone();
    let reconciler = every(s.reconcile_interval_ms, move || {
        let e = e.clone();
        async move {
            if let Err(err) = e.reconcile().await {
                crate::metrics::ledger_error("jobs");
                tracing::warn!(error = %err, "reconciliation failed");
            }
        }
    });
    let e = engine.clone();
    let switches = every(s.switches_interval_ms, move || {
        let e = e.clone();
        async move {
            if let Err(err) = e.refresh_switches().await {
                crate::metrics::ledger_error("jobs");
                tracing::warn!(error = %err, "reading the switches failed");
            }
        }
    });
    let e = engine.clone();
    let live = every(s.live_numbers_interval_ms, move || {
        let e = e.clone();
        async move {
            if let Err(err) = e.live_numbers().await {
                crate::metrics::ledger_error("jobs");
                tracing::warn!(error = %err, "live numbers failed");
            }
        }
    });
    let e = engine.clone();
    let preheat = every(s.preheat_interval_ms, move || {
        let e = e.clone();
        async move {
            if let Err(err) = e.preheat().await {
                crate::metrics::ledger_error("jobs");
                tracing::warn!(error = %err, "pre-heat failed");
            }
        }
    });
    let e = engine.clone();
    let limits = every(LIMITS_UPKEEP_MS, move || {
        e.limits_upkeep();
        async {}
    });
    Jobs(vec![
        expiry, reaper, reconciler, switches, live, preheat, limits,
    ])
}

fn every<F, Fut>(ms: u64, mut run: F) -> tokio::task::JoinHandle<()>
where
    F: FnMut() -> Fut + 'static,
    Fut: Future<Output = ()> + 'static,
{
    actix_rt::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(ms.max(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            run().await;
        }
    })
}
