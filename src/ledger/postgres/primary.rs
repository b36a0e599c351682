//! Which listed server the node writes to, the node's pools on it, and finding the new primary
//! after a failover.
//!
//! The locator owns the node's two pools (its pool and its heartbeat connection), both on one
//! server of [`Targets`]. When a call cannot reach the ledger (the node's ledger says so through
//! [`Locator::lost`]: every call the breaker counts as an outage, and failed beats), and every
//! [`RECHECK`] besides, the locator's task asks every listed server at once what it is. If
//! another one is now the one to use, it builds fresh pools on it and swaps them in; the old
//! pools are closed. Fresh pools, not the old ones re-pointed:
//! calls stuck on a server that vanished without resetting its connections (a dead machine)
//! keep their slots in the old pool until TCP gives up, and must not starve the new one, nor
//! the one heartbeat connection. Every new connection is checked before use to be writable and
//! on a timeline no older than the newest this node wrote on (`after_connect`), so no write
//! reaches a standby or a stale primary. Nothing restarts and no operator step is needed on the
//! nodes: the breaker's probe after the switch closes it.
//!
//! Among the servers that may be written to, the one on the newest timeline wins, and the
//! locator never goes back to an older timeline than one it wrote on: an old primary that comes
//! back writable after its standby was promoted (a split brain the failover manager should have
//! fenced) is not written to; the node answers `503` and says why in its log.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};
use tokio::sync::Notify;

use super::target::{Targets, Want};

/// The pause before a search that found no server to use (the primary died and no standby is
/// promoted yet) asks again: one connection per listed server per node, five times a second,
/// for as long as the outage lasts; a promotion is noticed within it.
const SEARCH_AGAIN: Duration = Duration::from_millis(200);
/// How often a search that keeps finding nothing says so at `warn`.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// How often the servers are asked even when every call succeeds: a standby promoted while the
/// old primary still answers (a split brain the failover manager did not fence) is found
/// within this, and the nodes move to its newer timeline.
const RECHECK: Duration = Duration::from_secs(5);

/// What one server said it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Answer {
    wanted: bool,
    /// Its timeline, when it is a primary (0 for a standby).
    timeline: u32,
    /// It names synchronous standbys (its commits wait for one).
    synchronous: bool,
}

/// The size of the node's pools, to build them again on another server.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub max_connections: u32,
    pub acquire_timeout: Duration,
}

struct Pools {
    main: PgPool,
    beats: PgPool,
}

pub struct Locator {
    targets: Targets,
    shape: Shape,
    /// The server the pools connect to now (an index of `targets.servers`).
    current: AtomicUsize,
    /// Switches to another server since start-up.
    failovers: AtomicU64,
    /// The newest timeline written on: never go back to an older one (see the module doc).
    timeline: AtomicU32,
    pools: RwLock<Pools>,
    /// This locator, for the pools' connection checks (which must not keep it alive).
    me: Weak<Locator>,
    /// Set by [`Locator::lost`], taken by the search task.
    wake: Arc<Notify>,
    /// A search is under way: losses reported meanwhile need no second one.
    searching: AtomicBool,
    /// How long one server may take to answer what it is.
    probe_timeout: Duration,
}

impl Locator {
    /// Finds the server to use at start-up and opens the pools on it (lazily: the first call
    /// connects). When no listed server is the one to use (none answers, or all are standbys):
    /// an error (an unreachable ledger's), or with `wait` the pools on the first server, which
    /// the search task replaces once it finds the one to use.
    pub async fn start_up(
        targets: Targets,
        shape: Shape,
        probe_timeout: Duration,
        wait: bool,
    ) -> Result<Arc<Self>, sqlx::Error> {
        let (mut index, mut timeline) = (0, 0);
        if targets.needs_search() {
            let answers = probe_all(&targets, probe_timeout).await;
            match newest(&answers, 0) {
                Some((i, a)) => {
                    warn_if_alone(&targets, i, a);
                    (index, timeline) = (i, a.timeline);
                }
                None if wait => {}
                None => {
                    return Err(sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::NotConnected,
                        format!(
                            "no listed ledger server is writable: {}",
                            describe(&targets, &answers)
                        ),
                    )))
                }
            }
        }
        let locator = Arc::new_cyclic(|me: &Weak<Locator>| Self {
            pools: RwLock::new(build(
                targets.servers[index].options.clone(),
                shape,
                targets.want,
                me.clone(),
            )),
            targets,
            shape,
            current: AtomicUsize::new(index),
            failovers: AtomicU64::new(0),
            timeline: AtomicU32::new(timeline),
            me: me.clone(),
            wake: Arc::new(Notify::new()),
            searching: AtomicBool::new(false),
            probe_timeout,
        });
        crate::metrics::ledger_server(&locator.labels(), index);
        Ok(locator)
    }

    /// The node's pool, on the server used now.
    pub fn pool(&self) -> PgPool {
        match self.pools.read() {
            Ok(p) => p.main.clone(),
            Err(poisoned) => poisoned.into_inner().main.clone(),
        }
    }

    /// The heartbeat's own connection, on the server used now.
    pub fn beats(&self) -> PgPool {
        match self.pools.read() {
            Ok(p) => p.beats.clone(),
            Err(poisoned) => poisoned.into_inner().beats.clone(),
        }
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

    /// The server in use as a TCP `host:port`, or `None` where it is reached by a Unix socket.
    pub fn tcp_server(&self) -> Option<(String, u16)> {
        let server = &self.targets.servers[self.current()];
        match server.options.get_socket() {
            Some(_) => None,
            None => Some((
                server.options.get_host().to_string(),
                server.options.get_port(),
            )),
        }
    }

    /// Switches to another server since start-up.
    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Acquire)
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

    /// The server to use now, if any: the qualifying one on the newest timeline (asked at once;
    /// the current one among equals). What each said, for the log. `routine`: nothing failed,
    /// this is the periodic check, so the current server is asked over a pooled connection (no
    /// new backend on it every RECHECK); after a failure, over a new one (a pooled acquire
    /// would retry a refusing server until its timeout).
    async fn search(&self, routine: bool) -> (Option<(usize, Answer)>, String) {
        let floor = self.timeline.load(Ordering::Acquire);
        let current = self.current();
        let answers = futures_util::future::join_all(self.targets.servers.iter().enumerate().map(
            |(i, s)| async move {
                if routine && i == current {
                    if let Ok(a) = self.ask_pooled().await {
                        return Ok(a);
                    }
                }
                probe(&s.options, self.targets.want, self.probe_timeout).await
            },
        ))
        .await;
        let mut found = newest(&answers, floor);
        if let (Some((_, best)), Some(Ok(now))) = (found, answers.get(current)) {
            if now.wanted && now.timeline == best.timeline {
                found = Some((current, *now));
            }
        }
        (found, describe(&self.targets, &answers))
    }

    async fn ask_pooled(&self) -> Result<Answer, sqlx::Error> {
        let pool = self.pool();
        let asked = async {
            let mut conn = pool.acquire().await?;
            ask(&mut conn, self.targets.want).await
        };
        tokio::time::timeout(self.probe_timeout, asked)
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
    }

    /// Moves the pools to server `index` (if they are not already there); whether they moved.
    fn adopt(&self, index: usize, answer: Answer) -> bool {
        self.timeline.fetch_max(answer.timeline, Ordering::AcqRel);
        let before = self.current();
        if index == before {
            return false;
        }
        warn_if_alone(&self.targets, index, answer);
        let fresh = build(
            self.targets.servers[index].options.clone(),
            self.shape,
            self.targets.want,
            self.me.clone(),
        );
        let old = match self.pools.write() {
            Ok(mut p) => std::mem::replace(&mut *p, fresh),
            Err(poisoned) => std::mem::replace(&mut *poisoned.into_inner(), fresh),
        };
        // Calls still on the old pools fail there; their connections close as they come back.
        // Both pools are marked closed at once (a beat stuck on a vanished server must not keep
        // the main pool open).
        tokio::spawn(async move {
            let (beats, main) = (old.beats.close(), old.main.close());
            futures_util::future::join(beats, main).await;
        });
        self.current.store(index, Ordering::Release);
        self.failovers.fetch_add(1, Ordering::AcqRel);
        crate::metrics::ledger_server(&self.labels(), index);
        crate::metrics::ledger_failover();
        tracing::warn!(
            from = %self.targets.servers[before].label,
            to = %self.targets.servers[index].label,
            timeline = answer.timeline,
            "the ledger's primary moved: connecting to the new one"
        );
        true
    }

    /// May a fresh connection be used? It must be to a server that qualifies, on a timeline no
    /// older than the newest written on.
    async fn check(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        let a = ask(conn, self.targets.want).await?;
        let floor = self.timeline.load(Ordering::Acquire);
        if a.wanted && a.timeline >= floor {
            return Ok(());
        }
        Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            format!(
                "the ledger server is not the one to write to (writable: {}, timeline {} < {floor}?)",
                a.wanted, a.timeline
            ),
        )))
    }
}

impl Drop for Locator {
    fn drop(&mut self) {
        // Ends the search task.
        self.wake.notify_one();
    }
}

/// The node's pools on one server. With a URL that asks for a writable server, each new
/// connection is checked first.
fn build(options: PgConnectOptions, shape: Shape, want: Want, me: Weak<Locator>) -> Pools {
    let make = |max: u32, acquire: Duration| {
        let options_of_pool = PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(acquire);
        let options_of_pool = if want == Want::Any {
            options_of_pool
        } else {
            let me = me.clone();
            options_of_pool.after_connect(move |conn, _| {
                let me = me.clone();
                Box::pin(async move {
                    match me.upgrade() {
                        Some(l) => l.check(conn).await,
                        None => Ok(()),
                    }
                })
            })
        };
        options_of_pool.connect_lazy_with(options.clone())
    };
    Pools {
        // Connections are checked before use (one short round trip per merged transaction):
        // after an outage the pool replaces broken ones instead of failing a request on each.
        // Waiting for a connection (and that check) fails fast, so the breaker sees a dead link
        // within the acquire timeout rather than at the end of each call's deadline.
        main: make(shape.max_connections.max(2), shape.acquire_timeout),
        beats: make(1, Duration::from_secs(1)),
    }
}

/// Waits for a reported loss (or [`RECHECK`]), then searches until a server to use is found
/// (fresh pools are swapped in if it is another one). Ends when the ledger is dropped.
async fn search_task(me: Weak<Locator>, wake: Arc<Notify>) {
    loop {
        let mut routine = tokio::time::timeout(RECHECK, wake.notified())
            .await
            .is_err();
        let mut warned_at: Option<Instant> = None;
        loop {
            let Some(locator) = me.upgrade() else { return };
            locator.searching.store(true, Ordering::Release);
            let (found, seen) = locator.search(routine).await;
            routine = false;
            if let Some((index, answer)) = found {
                let moved = locator.adopt(index, answer);
                locator.searching.store(false, Ordering::Release);
                drop(locator);
                if !moved {
                    // The server was fine (a slow call, a lost connection): a ledger that keeps
                    // timing out is asked at most every SEARCH_AGAIN, not after every call.
                    tokio::time::sleep(SEARCH_AGAIN).await;
                }
                break;
            }
            if warned_at.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                warned_at = Some(Instant::now());
                tracing::warn!(
                    servers = %seen,
                    timeline = locator.timeline.load(Ordering::Acquire),
                    "no ledger server to write to (writable, on this timeline or a newer one)"
                );
            }
            drop(locator);
            tokio::time::sleep(SEARCH_AGAIN).await;
        }
    }
}

/// What every listed server is, asked at once.
async fn probe_all(targets: &Targets, timeout: Duration) -> Vec<Result<Answer, sqlx::Error>> {
    futures_util::future::join_all(
        targets
            .servers
            .iter()
            .map(|s| probe(&s.options, targets.want, timeout)),
    )
    .await
}

/// The qualifying server on the newest timeline (not older than `floor`), the first listed of
/// equals.
fn newest(answers: &[Result<Answer, sqlx::Error>], floor: u32) -> Option<(usize, Answer)> {
    let mut best: Option<(usize, Answer)> = None;
    for (i, a) in answers.iter().enumerate() {
        let Ok(a) = a else { continue };
        if a.wanted && a.timeline >= floor && best.is_none_or(|(_, b)| a.timeline > b.timeline) {
            best = Some((i, *a));
        }
    }
    best
}

fn describe(targets: &Targets, answers: &[Result<Answer, sqlx::Error>]) -> String {
    targets
        .servers
        .iter()
        .zip(answers)
        .map(|(s, a)| match a {
            Ok(a) if a.wanted => format!("{} (timeline {})", s.label, a.timeline),
            Ok(_) => format!("{} (not writable)", s.label),
            Err(e) => format!("{} ({e})", s.label),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A primary that names no synchronous standby acknowledges commits that only it has.
fn warn_if_alone(targets: &Targets, index: usize, answer: Answer) {
    if targets.servers.len() > 1 && !answer.synchronous {
        tracing::warn!(
            server = %targets.servers[index].label,
            "the ledger's primary waits for no synchronous standby: what it acknowledges now is \
             on one server only until a standby is synchronous again"
        );
    }
}

/// What a server is: reachable, writable as `want` asks, its timeline if it is a primary.
async fn probe(
    options: &PgConnectOptions,
    want: Want,
    timeout: Duration,
) -> Result<Answer, sqlx::Error> {
    let asked = async {
        let mut conn: PgConnection = options.connect().await?;
        let a = ask(&mut conn, want).await;
        let _ = conn.close().await;
        a
    };
    tokio::time::timeout(timeout, asked)
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)?
}

async fn ask(conn: &mut PgConnection, want: Want) -> Result<Answer, sqlx::Error> {
    let (in_recovery, read_only, wal, standbys): (bool, String, Option<String>, String) =
        sqlx::query_as(
            "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'), \
             CASE WHEN pg_is_in_recovery() THEN NULL \
                  ELSE pg_walfile_name(pg_current_wal_lsn()) END, \
             current_setting('synchronous_standby_names')",
        )
        .fetch_one(&mut *conn)
        .await?;
    Ok(Answer {
        wanted: match want {
            Want::Any => true,
            Want::ReadWrite => read_only == "off",
            Want::Primary => !in_recovery,
        },
        timeline: wal.as_deref().map_or(0, timeline_of),
        synchronous: !standbys.trim().is_empty(),
    })
}

/// The timeline of a WAL file name: its first eight hex digits.
fn timeline_of(wal_file: &str) -> u32 {
    wal_file
        .get(..8)
        .and_then(|t| u32::from_str_radix(t, 16).ok())
        .unwrap_or(0)
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

    fn answer(wanted: bool, timeline: u32) -> Result<Answer, sqlx::Error> {
        Ok(Answer {
            wanted,
            timeline,
            synchronous: true,
        })
    }

    #[test]
    fn the_newest_writable_timeline_wins_and_never_one_below_the_floor() {
        let answers = vec![
            answer(true, 1),
            Err(sqlx::Error::PoolTimedOut),
            answer(false, 0),
            answer(true, 3),
            answer(true, 3),
        ];
        assert_eq!(newest(&answers, 0).map(|(i, _)| i), Some(3));
        assert_eq!(newest(&answers, 3).map(|(i, _)| i), Some(3));
        assert_eq!(newest(&answers, 4), None);
        // An old primary back on timeline 1 after this node wrote on 2: not written to.
        assert_eq!(newest(&answers[..3], 2), None);
    }
}
