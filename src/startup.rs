//! `Application`: wires configuration, ledger, engine, jobs and the HTTP server together, and
//! shuts them down in order (stop taking requests, return leases, stop jobs and shards).

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
use actix_web::HttpServer;
use anyhow::Context;

use crate::api::{self, AppState};
use crate::clock::{LedgerClock, SharedClock};
use crate::config::{EngineSettings, LedgerKind, Settings};
use crate::engine::{EngineHandle, Shards};
use crate::jobs::{self, Jobs};
use crate::ledger;
use crate::shutdown::Tasks;
use crate::signals::{self, Publisher};

/// How long the Redis tasks may take to stop: the publisher sends the drain's restocks first.
const SIGNALS_STOP: Duration = Duration::from_secs(2);

pub struct Application {
    port: u16,
    server: Server,
    engine: EngineHandle,
    shards: Shards,
    jobs: Jobs,
    /// The Redis side's tasks: the publisher, the subscriber, the feed relay.
    signals: Tasks,
    /// How long a job may take to finish its run once asked to stop: a ledger call's deadline,
    /// and a second.
    stop_deadline: Duration,
    /// Where every database connection lives and is polled.
    ledger_rt: tokio::runtime::Runtime,
    /// The admin token in force (configured or generated).
    pub admin_token: String,
    /// The embedded ledger's process lock (see [`lock_embedded_ledger`]), held while this lives.
    _data_lock: Option<std::fs::File>,
}

/// The operator reads a generated admin token where the node was started (and `scripts/smoke.sh`
/// reads this line).
#[allow(
    clippy::print_stdout,
    reason = "the token is for the operator's terminal, not the log"
)]
fn print_generated_token(token: &str) {
    println!("admin token (generated, set VOUCHERS__ADMIN__TOKEN to choose one): {token}");
}

/// A random hex string from the OS generator.
#[allow(
    clippy::expect_used,
    reason = "start-up only: without an OS random source the process cannot make a safe token"
)]
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    getrandom::getrandom(&mut buf).expect("OS random source");
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// `engine.max_batch` as the ledger takes it: on PostgreSQL a batch's customers each hold an
/// advisory lock until the batch's call commits, and a call holds at most
/// `MAX_CUSTOMERS_PER_CALL` of them (the server's lock table is shared; DESIGN §4).
fn batch_bound(kind: LedgerKind, max_batch: usize) -> usize {
    let bound = ledger::postgres::commit::MAX_CUSTOMERS_PER_CALL;
    if kind == LedgerKind::Postgres && max_batch > bound {
        tracing::debug!(
            max_batch,
            bound,
            "engine.max_batch held to the PostgreSQL ledger's bound on customers per call"
        );
        return bound;
    }
    max_batch
}

/// The embedded ledger's file belongs to one process. A second process on the same data
/// directory refuses to start before it touches anything (it would take the running node's
/// leases back as an earlier run's). The lock is a POSIX record lock on `<ledger file>.lock`,
/// held for the life of the process; the OS drops it when the process exits, crash included.
/// Record locks belong to the process, so an embedding that opens the ledger twice in one
/// process (the tests' two apps on one file) is not refused.
#[cfg(unix)]
fn lock_embedded_ledger(kind: LedgerKind, url: &str) -> anyhow::Result<Option<std::fs::File>> {
    use std::os::fd::AsRawFd;
    use std::str::FromStr;
    if kind != LedgerKind::Sqlite {
        return Ok(None);
    }
    let options = sqlx::sqlite::SqliteConnectOptions::from_str(url).context("ledger url")?;
    let path = options.get_filename();
    if path.as_os_str().is_empty() || path.to_string_lossy().contains(":memory:") {
        return Ok(None);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let lock_path = path.with_extension("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("open {}", lock_path.display()))?;
    let lock = libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    };
    // SAFETY: a valid open descriptor and a fully initialised lock description.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLK, &lock) } == -1 {
        anyhow::bail!(
            "another process runs on this ledger ({}): it holds {}; stop it first (two embedded \
             nodes on one data directory would take each other's leases)",
            path.display(),
            lock_path.display()
        );
    }
    Ok(Some(file))
}

#[cfg(not(unix))]
fn lock_embedded_ledger(_kind: LedgerKind, _url: &str) -> anyhow::Result<Option<std::fs::File>> {
    Ok(None)
}

/// Units a previous run left in leases (it crashed, so it could not return them) come back at
/// once instead of after the lease TTL. The embedded ledger has one process (the data lock sees
/// to it), so every ACTIVE lease is an earlier run's. In a cluster, earlier incarnations of this
/// node are reaped by the heartbeat once they stop beating (a live one is a rolling restart's old
/// process, and keeps its leases); only leases held under the bare name, by a build from before
/// incarnations, are returned here. Either way the fence keeps this safe: a lease closed under a
/// live process only makes its next batch fail with 503.
async fn reclaim_leases_of_earlier_runs(
    ledger: &ledger::SharedLedger,
    kind: LedgerKind,
    settings: &Settings,
    now: i64,
) -> anyhow::Result<()> {
    let restocks = if kind == LedgerKind::Sqlite {
        ledger.reap_expired(i64::MAX).await
    } else if !settings.node.id.is_empty() {
        ledger.return_node_leases(&settings.node.id, now).await
    } else {
        return Ok(());
    };
    let units: i64 = restocks
        .context("reclaim leases of earlier runs")?
        .iter()
        .map(|r| r.units)
        .sum();
    if units > 0 {
        tracing::info!(units, "reclaimed units left in leases by an earlier run");
    }
    Ok(())
}

/// Numbers this process in the ledger (its incarnation) and returns the holder name its leases
/// carry. Another live process under the same `node.id` is said in the log: a rolling restart
/// is expected to overlap like this, two processes configured alike for good are not.
async fn register_incarnation(
    ledger: &ledger::SharedLedger,
    settings: &Settings,
    clock: &SharedClock,
) -> anyhow::Result<String> {
    let node = &settings.node;
    let name = if node.id.is_empty() {
        format!("node-{}", random_hex(4))
    } else {
        node.id.clone()
    };
    let me = ledger
        .register_node(&name, clock.now_ms(), node.dead_after_ms)
        .await
        .context("register this process with the ledger")?;
    follow_the_ledgers_clock(ledger, &me.holder, node.dead_after_ms, clock).await;
    if !me.live_siblings.is_empty() {
        tracing::warn!(
            node = %name,
            incarnation = me.number,
            live = ?me.live_siblings,
            "other processes run as this node.id; each keeps its own leases"
        );
    }
    Ok(me.holder)
}

/// Before any lease or expiry decision: this node's clock follows the ledger's, read by a beat
/// (one statement) whose round trip was short enough to tell. A few tries; if none is fast
/// enough, the heartbeat job corrects the clock at its first fast beat.
async fn follow_the_ledgers_clock(
    ledger: &ledger::SharedLedger,
    holder: &str,
    dead_after_ms: i64,
    clock: &SharedClock,
) {
    for _ in 0..10 {
        let sent = clock.now_ms();
        let Ok(beat) = ledger.heartbeat(holder, sent, dead_after_ms).await else {
            continue;
        };
        let received = clock.now_ms();
        if received - sent <= crate::clock::MAX_RTT_MS {
            if let Some(ahead) = crate::clock::ledger_ahead(beat.ledger_ms, sent, received) {
                clock.follow_ledger(ahead);
            }
            return;
        }
    }
    tracing::warn!("could not read the ledger's clock quickly; the heartbeat will correct it");
}

/// Settings that would make live nodes look dead.
fn check_liveness_settings(node: &crate::config::NodeSettings) -> anyhow::Result<()> {
    if node.heartbeat_ms < 10 || node.dead_after_ms < 3 * node.heartbeat_ms as i64 {
        anyhow::bail!(
            "node.heartbeat_ms ({}) must be at least 10 and node.dead_after_ms ({}) at least \
             three of them: a live node that misses one beat would be taken for dead",
            node.heartbeat_ms,
            node.dead_after_ms
        );
    }
    Ok(())
}

impl Application {
    /// Builds everything and binds the listener; must run inside an actix `System`.
    pub async fn build(settings: Settings, clock: SharedClock) -> anyhow::Result<Self> {
        let ledger_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(settings.ledger.runtime_threads.max(1))
            .thread_name("ledger")
            // Each worker hands its unused pages back once idle after a give-back.
            .on_thread_park(crate::memory::collect_when_asked)
            .enable_all()
            .build()
            .context("start the ledger runtime")?;
        let handle = ledger_rt.handle().clone();
        let mut ledger_rt = Some(ledger_rt);
        let built = Self::build_on(settings, clock, handle, &mut ledger_rt).await;
        if built.is_err() {
            // A runtime may not be dropped inside an async context: let it wind down by itself.
            if let Some(rt) = ledger_rt.take() {
                rt.shutdown_background();
            }
        }
        built
    }

    async fn build_on(
        settings: Settings,
        clock: SharedClock,
        ledger_handle: tokio::runtime::Handle,
        ledger_rt: &mut Option<tokio::runtime::Runtime>,
    ) -> anyhow::Result<Self> {
        check_liveness_settings(&settings.node)?;
        // Before anything is written: a stream name the relay could not use on a Redis Cluster.
        if !settings.redis.url.is_empty() && !settings.redis.events_stream.is_empty() {
            crate::feed::relay_keys(&settings.redis.events_stream, settings.redis.cluster)
                .context("redis.events_stream")?;
        }
        let kind = settings
            .ledger
            .kind()
            .context("ledger.url or ledger.shards")?;
        // Before anything touches the ledger: one process per embedded ledger.
        let data_lock = lock_embedded_ledger(kind, &settings.ledger.url)?;
        // First: metrics recorded from here on (jobs, relay, actors) must reach the exporter.
        let metrics = crate::metrics::install();
        let ledger =
            ledger::connect_on(ledger_handle, &settings.ledger).context("connect ledger")?;
        if ledger.server().is_none() {
            crate::metrics::ledger_server(&["embedded"], 0);
        }
        if settings.admin.token.is_empty() && kind.is_shared() {
            anyhow::bail!(
                "a shared ledger needs one admin token for every node: set VOUCHERS__ADMIN__TOKEN"
            );
        }
        if settings
            .http
            .checkout_tokens
            .iter()
            .any(|t| t.trim().is_empty())
        {
            anyhow::bail!("http.checkout_tokens holds an empty token, which would open the routes");
        }
        let admin_token = if settings.admin.token.is_empty() {
            let token = random_hex(16);
            print_generated_token(&token);
            token
        } else {
            settings.admin.token.clone()
        };
        // On a shared ledger this node's clock follows the ledger's (corrected at every beat).
        let shared_ledger = kind.is_shared();
        let clock: SharedClock = if shared_ledger {
            Arc::new(LedgerClock::new(clock, settings.node.clock_skew_ms))
        } else {
            clock
        };
        reclaim_leases_of_earlier_runs(&ledger, kind, &settings, clock.now_ms()).await?;
        let node_id = register_incarnation(&ledger, &settings, &clock).await?;
        let mut signal_tasks = Tasks::new();
        let keepalive = Duration::from_millis(settings.redis.keepalive_ms.max(30));
        let redis = if settings.redis.url.is_empty() {
            None
        } else {
            Some(
                signals::Target::open(&settings.redis.url, settings.redis.cluster)
                    .context("redis url")?,
            )
        };

        let publisher = match &redis {
            None => Publisher::disabled(),
            Some(target) => {
                let (p, task) =
                    signals::publisher(target, &node_id, keepalive, signal_tasks.shutdown());
                signal_tasks.add("signal publisher", task);
                p
            }
        };
        let follows = publisher.follows();
        let engine_settings = EngineSettings {
            // Alone only where the data lock was taken: it keeps a second process off the file.
            sole_node: data_lock.is_some(),
            max_batch: batch_bound(kind, settings.engine.max_batch),
            ..settings.engine.clone()
        };
        let (engine, shards) = EngineHandle::start(
            ledger,
            clock,
            engine_settings,
            node_id.clone(),
            Duration::from_millis(settings.http.request_timeout_ms),
            publisher,
            &settings,
        );
        if let Some(target) = &redis {
            let e = engine.clone();
            let handler: signals::Handler = Arc::new(move |code, signal| e.on_signal(code, signal));
            let e = engine.clone();
            let on_link: signals::LinkHandler = Arc::new(move |up| e.signals_link(up));
            let shutdown = signal_tasks.shutdown();
            signal_tasks.add(
                "signal subscriber",
                signals::subscribe(
                    target, follows, &node_id, keepalive, handler, on_link, shutdown,
                )
                .context("redis signals")?,
            );
        }
        if let Some(target) = redis.filter(|_| !settings.redis.events_stream.is_empty()) {
            let shutdown = signal_tasks.shutdown();
            signal_tasks.add(
                "feed relay",
                crate::feed::start(
                    engine.clone(),
                    crate::feed::RelaySettings {
                        target,
                        stream: settings.redis.events_stream.clone(),
                        maxlen: settings.redis.events_stream_maxlen.max(1),
                        interval: Duration::from_millis(settings.redis.events_relay_ms.max(10)),
                        node_id: node_id.clone(),
                    },
                    shutdown,
                )
                .context("redis.events_stream")?,
            );
        }
        let signals = signal_tasks;
        // After subscribing: a code created meanwhile comes by signal or in this read.
        engine.load_known_codes().await;
        if let Err(e) = engine.refresh_switches().await {
            tracing::warn!(error = %e, "could not read the switches yet");
        }
        let jobs = jobs::start(
            &engine,
            &settings.jobs,
            // The embedded ledger has one process (the data lock): nobody to judge, and a write
            // every beat would only queue in front of commits.
            shared_ledger.then_some(&settings.node),
        );
        let listener = TcpListener::bind((settings.http.host.as_str(), settings.http.port))
            .with_context(|| format!("bind {}:{}", settings.http.host, settings.http.port))?;
        let port = listener.local_addr().context("local address")?.port();
        let state = AppState {
            engine: engine.clone(),
            admin_token: admin_token.clone(),
            metrics,
            body_limit: settings.http.body_limit_bytes,
            client_address: api::ClientAddress::from_settings(&settings.limits)?,
            checkout_tokens: settings.http.checkout_tokens.clone(),
        };
        let mut server = HttpServer::new(move || {
            state.engine.host_actors_here();
            api::app(state.clone())
        })
        .listen(listener)
        .context("listen")?
        .backlog(4096)
        .max_connection_rate(4096)
        .shutdown_timeout(10);
        if settings.http.workers > 0 {
            server = server.workers(settings.http.workers);
        }
        tracing::info!(port, node = engine.node_id(), "listening");
        Ok(Self {
            port,
            server: server.run(),
            engine,
            shards,
            jobs,
            signals,
            ledger_rt: ledger_rt.take().context("ledger runtime")?,
            admin_token,
            stop_deadline: Duration::from_millis(settings.ledger.timeout_ms)
                + Duration::from_secs(1),
            _data_lock: data_lock,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn engine(&self) -> EngineHandle {
        self.engine.clone()
    }

    /// Serves until the server stops (SIGINT/SIGTERM), then returns leases and stops the rest.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let Self {
            server,
            engine,
            shards,
            jobs,
            signals,
            ledger_rt,
            stop_deadline,
            _data_lock: held,
            ..
        } = self;
        let result = server.await;
        // Every job is asked to stop and the heartbeat is waited for before the drain: no beat
        // of this process is under way when it retires (and the ledger refuses one that is
        // late all the same). The others end their run meanwhile and are waited for after.
        let jobs = jobs.stop_heartbeat(stop_deadline).await;
        engine.drain().await;
        let _ = jobs.stop(stop_deadline).await;
        // After the drain, so that its restocks are published before the publisher stops;
        // it sends what it queued, each within Redis's own command timeout.
        let _ = signals.stop(SIGNALS_STOP).await;
        shards.stop();
        ledger_rt.shutdown_background();
        // Released only now: the leases went back first.
        drop(held);
        result.context("http server")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_on_postgresql_hold_no_more_customers_than_a_call_may_lock() {
        let bound = ledger::postgres::commit::MAX_CUSTOMERS_PER_CALL;
        assert_eq!(batch_bound(LedgerKind::Postgres, 1024), bound);
        assert_eq!(batch_bound(LedgerKind::Postgres, 100), 100);
        assert_eq!(batch_bound(LedgerKind::Sqlite, 1024), 1024);
    }
}
