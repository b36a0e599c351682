//! Which listed server the node writes to, and finding the new primary after a failover.
//!
//! The node's pools (its pool and its heartbeat connection) connect to one server of
//! [`Targets`] at a time. When a call cannot reach the ledger (the node's ledger says so through
//! [`Locator::lost`]: every call the breaker counts as an outage, and failed beats), the
//! locator's task asks every listed server what it is and, if another one is now the one to use,
//! points both pools at it. New connections go there; connections opened before the switch are
//! dropped when next taken from the pool (`before_acquire`), and every new connection is checked
//! to be writable before use (`after_connect`), so no write reaches a standby. Nothing restarts
//! and no operator step is needed on the nodes: the breaker's probe after the switch closes it.
//!
//! Among the servers that may be written to, the one on the newest timeline wins, and the
//! locator never goes back to an older timeline than one it wrote on: an old primary that comes
//! back writable after its standby was promoted (a split brain the failover manager should have
//! fenced) is not written to, the node answers `503` instead.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::{ConnectOptions, Connection};
use tokio::sync::Notify;

use super::target::{Targets, Want};

/// How long a search waits before asking the servers again when none is the one to use (the
/// primary died and no standby is promoted yet).
const SEARCH_AGAIN: Duration = Duration::from_millis(200);

/// What one server said it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Answer {
    wanted: bool,
    /// Its timeline, when it is a primary (0 for a standby).
    timeline: u32,
}

pub struct Locator {
    targets: Targets,
    /// The server the pools connect to now (an index of `targets.servers`).
    current: AtomicUsize,
    /// Switches to another server since start-up.
    failovers: AtomicU64,
    /// The newest timeline written on: never go back to an older one (see the module doc).
    timeline: AtomicU32,
    /// When the pools last switched, on `origin`'s clock: pooled connections older than this
    /// belong to the server before and are dropped.
    switched_at_ms: AtomicU64,
    origin: Instant,
    /// The pools that follow the chosen server.
    pools: std::sync::Mutex<Vec<PgPool>>,
    /// Set by [`Locator::lost`], taken by the search task.
    wake: Arc<Notify>,
    /// A search is under way: losses reported meanwhile need no second one.
    searching: AtomicBool,
    /// How long one server may take to answer what it is.
    probe_timeout: Duration,
}

impl Locator {
    /// Finds the server to use at start-up: an error when none of the listed servers is (none
    /// answers, or all are standbys).
    pub async fn start_up(targets: Targets, probe_timeout: Duration) -> Result<Self, sqlx::Error> {
        let locator = Self {
            targets,
            current: AtomicUsize::new(0),
            failovers: AtomicU64::new(0),
            timeline: AtomicU32::new(0),
            switched_at_ms: AtomicU64::new(0),
            origin: Instant::now(),
            pools: std::sync::Mutex::new(Vec::new()),
            wake: Arc::new(Notify::new()),
            searching: AtomicBool::new(false),
            probe_timeout,
        };
        if locator.targets.needs_search() {
            let (found, seen) = locator.search().await;
            let Some((index, timeline)) = found else {
                return Err(sqlx::Error::Configuration(
                    format!(
                        "no listed ledger server is {}: {}",
                        match locator.targets.want {
                            Want::Any => "reachable",
                            Want::ReadWrite => "writable",
                            Want::Primary => "a primary",
                        },
                        seen.join(", ")
                    )
                    .into(),
                ));
            };
            locator.current.store(index, Ordering::Release);
            locator.timeline.store(timeline, Ordering::Release);
        }
        crate::metrics::ledger_server(&locator.labels(), locator.current());
        Ok(locator)
    }

    /// The options of the server to connect to now.
    pub fn options(&self) -> PgConnectOptions {
        self.targets.servers[self.current()].options.clone()
    }

    pub fn want(&self) -> Want {
        self.targets.want
    }

    /// May the pools move to another server? Only when several are listed.
    pub fn switches(&self) -> bool {
        self.targets.servers.len() > 1
    }

    fn current(&self) -> usize {
        self.current.load(Ordering::Acquire)
    }

    fn labels(&self) -> Vec<&str> {
        self.targets
            .servers
            .iter()
            .map(|s| s.label.as_str())
            .collect()
    }

    /// The server written to now (`host:port`) and the switches seen since start-up.
    pub fn server(&self) -> (String, u64) {
        (
            self.targets.servers[self.current()].label.clone(),
            self.failovers.load(Ordering::Acquire),
        )
    }

    /// Was a pooled connection of this age opened before the last switch?
    pub fn stale(&self, age: Duration) -> bool {
        let switched = self.switched_at_ms.load(Ordering::Acquire);
        switched > 0 && age.as_millis() as u64 > self.now_ms().saturating_sub(switched)
    }

    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64 + 1
    }

    /// Makes `pool` follow the chosen server.
    pub fn follow(&self, pool: PgPool) {
        if let Ok(mut pools) = self.pools.lock() {
            pools.push(pool);
        }
    }

    /// A call could not reach the ledger: look for the primary (at once, unless a search is
    /// already under way).
    pub fn lost(&self) {
        if self.targets.needs_search() && !self.searching.load(Ordering::Acquire) {
            self.wake.notify_one();
        }
    }

    /// Starts the search task on the current runtime (only when there is something to choose).
    pub fn spawn(self: &Arc<Self>) {
        if !self.targets.needs_search() {
            return;
        }
        let (me, wake) = (Arc::downgrade(self), self.wake.clone());
        tokio::spawn(search_task(me, wake));
    }

    /// Asks every listed server what it is; returns the one to use (its index and timeline),
    /// and what each said, for the log.
    async fn search(&self) -> (Option<(usize, u32)>, Vec<String>) {
        let mut best: Option<(usize, u32)> = None;
        let mut seen = Vec::new();
        let floor = self.timeline.load(Ordering::Acquire);
        for (i, server) in self.targets.servers.iter().enumerate() {
            let answer = probe(&server.options, self.targets.want, self.probe_timeout).await;
            seen.push(match &answer {
                Ok(a) if a.wanted => format!("{} (timeline {})", server.label, a.timeline),
                Ok(_) => format!("{} (not writable)", server.label),
                Err(e) => format!("{} ({e})", server.label),
            });
            let Ok(a) = answer else { continue };
            if !a.wanted || a.timeline < floor {
                continue;
            }
            if self.targets.want == Want::Any {
                return (Some((i, a.timeline)), seen);
            }
            if best.is_none_or(|(_, t)| a.timeline > t) {
                best = Some((i, a.timeline));
            }
        }
        (best, seen)
    }

    /// Points the pools at server `index` (if they are not already there).
    fn adopt(&self, index: usize, timeline: u32) {
        self.timeline.fetch_max(timeline, Ordering::AcqRel);
        let before = self.current();
        if index == before {
            return;
        }
        let options = self.targets.servers[index].options.clone();
        if let Ok(pools) = self.pools.lock() {
            for pool in pools.iter() {
                pool.set_connect_options(options.clone());
            }
        }
        self.switched_at_ms.store(self.now_ms(), Ordering::Release);
        self.current.store(index, Ordering::Release);
        self.failovers.fetch_add(1, Ordering::AcqRel);
        crate::metrics::ledger_server(&self.labels(), index);
        crate::metrics::ledger_failover();
        tracing::warn!(
            from = %self.targets.servers[before].label,
            to = %self.targets.servers[index].label,
            timeline,
            "the ledger's primary moved: connecting to the new one"
        );
    }
}

/// Waits for a reported loss, then searches until a server to use is found (the pools are
/// switched if it is another one). Ends when the ledger is dropped.
async fn search_task(me: Weak<Locator>, wake: Arc<Notify>) {
    loop {
        wake.notified().await;
        loop {
            let Some(locator) = me.upgrade() else { return };
            locator.searching.store(true, Ordering::Release);
            let (found, seen) = locator.search().await;
            if let Some((index, timeline)) = found {
                locator.adopt(index, timeline);
                locator.searching.store(false, Ordering::Release);
                break;
            }
            tracing::debug!(servers = %seen.join(", "), "no ledger server to write to yet");
            drop(locator);
            tokio::time::sleep(SEARCH_AGAIN).await;
        }
    }
}

/// What a server is: reachable, writable as `want` asks, and its timeline if it is a primary.
async fn probe(
    options: &PgConnectOptions,
    want: Want,
    timeout: Duration,
) -> Result<Answer, sqlx::Error> {
    let ask = async {
        let mut conn: PgConnection = options.connect().await?;
        let (in_recovery, read_only, wal): (bool, String, Option<String>) = sqlx::query_as(
            "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'), \
             CASE WHEN pg_is_in_recovery() THEN NULL \
                  ELSE pg_walfile_name(pg_current_wal_lsn()) END",
        )
        .fetch_one(&mut conn)
        .await?;
        let _ = conn.close().await;
        Ok::<_, sqlx::Error>(Answer {
            wanted: match want {
                Want::Any => true,
                Want::ReadWrite => read_only == "off",
                Want::Primary => !in_recovery,
            },
            timeline: wal.as_deref().map_or(0, timeline_of),
        })
    };
    tokio::time::timeout(timeout, ask)
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)?
}

/// The timeline of a WAL file name: its first eight hex digits.
fn timeline_of(wal_file: &str) -> u32 {
    wal_file
        .get(..8)
        .and_then(|t| u32::from_str_radix(t, 16).ok())
        .unwrap_or(0)
}

/// Is a fresh connection one the node may use? A connection to a server that is not (any
/// longer) the one wanted fails as unreachable, which sends the locator looking.
pub async fn check_connection(conn: &mut PgConnection, want: Want) -> Result<(), sqlx::Error> {
    let Some(sql) = want.check_sql() else {
        return Ok(());
    };
    let ok: bool = sqlx::query_scalar(sql).fetch_one(&mut *conn).await?;
    if ok {
        Ok(())
    } else {
        Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "the ledger server is not writable (a standby?)",
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeline_is_read_off_the_wal_file_name() {
        assert_eq!(timeline_of("000000020000000000000003"), 2);
        assert_eq!(timeline_of("0000000A0000000000000003"), 10);
        assert_eq!(timeline_of("bad"), 0);
    }
}
