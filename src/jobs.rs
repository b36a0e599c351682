//! Background jobs: this process's heartbeat (which also reaps the leases of holders that stopped
//! beating), expiry of unconfirmed reservations, the lease reaper, the reconciler, the emergency
//! switches' refresh, the live numbers, pre-heat, and the rate limiters' upkeep.
//! Each is a loop around one [`EngineHandle`] call whose ledger statement is safe to run on every
//! node at once (status-guarded updates), so no leader is needed.

use std::future::Future;
use std::time::Duration;

use crate::config::{JobSettings, NodeSettings};
use crate::engine::{EngineError, EngineHandle};
use crate::shutdown::{Shutdown, Tasks};

/// How often rate limiters drop the keys that refilled.
const LIMITS_UPKEEP_MS: u64 = 10_000;

/// The running jobs: the heartbeat apart, since it must end before the node retires itself
/// and must not wait for the others' longer runs (a node silent past its limit is reaped).
pub struct Jobs {
    beat: Tasks,
    rest: Tasks,
}

impl Jobs {
    /// Asks every job to stop after the run it is in, and waits (at most `deadline`) for the
    /// heartbeat alone, so that no beat of this process is under way when it retires. The
    /// other jobs are returned, to be waited for after the drain.
    pub async fn stop_heartbeat(self, deadline: Duration) -> Tasks {
        self.rest.ask();
        let _ = self.beat.stop(deadline).await;
        self.rest
    }
}

/// Starts every job on the current runtime. `beat`: the heartbeat's settings, where the ledger
/// is shared with other processes.
pub fn start(engine: &EngineHandle, s: &JobSettings, beat: Option<&NodeSettings>) -> Jobs {
    let batch = s.expiry_batch;
    let mut beats = Tasks::new();
    if let Some(node) = beat {
        let dead_after = node.dead_after_ms;
        job(
            &mut beats,
            engine,
            node.heartbeat_ms,
            "heartbeat",
            move |e| async move { e.heartbeat(dead_after).await },
        );
    }
    let mut t = Tasks::new();
    job(
        &mut t,
        engine,
        s.expiry_interval_ms,
        "expiry sweep",
        move |e| async move { e.expire_due(batch).await },
    );
    job(
        &mut t,
        engine,
        s.reaper_interval_ms,
        "lease reaper",
        |e| async move { e.reap_expired().await },
    );
    paced_job(
        &mut t,
        engine,
        s.reconcile_interval_ms,
        crate::engine::RECOUNT_IDLE_FACTOR,
        "reconciliation",
        |e| async move { e.reconcile().await },
    );
    job(
        &mut t,
        engine,
        s.switches_interval_ms,
        "reading the switches",
        |e| async move { e.refresh_switches().await },
    );
    job(
        &mut t,
        engine,
        s.live_numbers_interval_ms,
        "live numbers",
        |e| async move { e.live_numbers().await },
    );
    job(
        &mut t,
        engine,
        s.preheat_interval_ms,
        "pre-heat",
        |e| async move { e.preheat().await },
    );
    let e = engine.clone();
    let upkeep = paced(t.shutdown(), LIMITS_UPKEEP_MS, 0, move || {
        e.limits_upkeep();
        async {}
    });
    t.add("rate limiters' upkeep", upkeep);
    Jobs {
        beat: beats,
        rest: t,
    }
}

/// Runs one engine call every `ms`; a failure is counted and logged, and the next tick tries
/// again.
fn job<F, Fut, T>(tasks: &mut Tasks, engine: &EngineHandle, ms: u64, what: &'static str, run: F)
where
    F: Fn(EngineHandle) -> Fut + 'static,
    Fut: Future<Output = Result<T, EngineError>> + 'static,
{
    paced_job(tasks, engine, ms, 0, what, run)
}

/// [`job`], waiting at least `idle_factor` times a run's duration before the next one (0: no
/// such wait).
fn paced_job<F, Fut, T>(
    tasks: &mut Tasks,
    engine: &EngineHandle,
    ms: u64,
    idle_factor: u32,
    what: &'static str,
    run: F,
) where
    F: Fn(EngineHandle) -> Fut + 'static,
    Fut: Future<Output = Result<T, EngineError>> + 'static,
{
    let e = engine.clone();
    let handle = paced(tasks.shutdown(), ms, idle_factor, move || {
        let fut = run(e.clone());
        async move {
            if let Err(err) = fut.await {
                crate::metrics::ledger_error(crate::metrics::LedgerOp::Jobs);
                tracing::warn!(error = %err, "{what} failed");
            }
        }
    });
    tasks.add(what, handle);
}

/// Runs `run` every `ms` until shutdown is asked; a run under way is finished first.
fn paced<F, Fut>(
    mut shutdown: Shutdown,
    ms: u64,
    idle_factor: u32,
    mut run: F,
) -> tokio::task::JoinHandle<()>
where
    F: FnMut() -> Fut + 'static,
    Fut: Future<Output = ()> + 'static,
{
    actix_rt::spawn(async move {
        let period = Duration::from_millis(ms.max(10));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if shutdown.unless(tick.tick()).await.is_none() {
                return;
            }
            let started = std::time::Instant::now();
            run().await;
            let rest = started.elapsed() * idle_factor;
            if rest > period {
                if shutdown
                    .unless(tokio::time::sleep(rest - period))
                    .await
                    .is_none()
                {
                    return;
                }
                tick.reset();
            }
        }
    })
}
