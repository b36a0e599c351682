//! The subscriber on a Redis Cluster (`redis.cluster = true`): sharded pub/sub per voucher.
//!
//! A voucher's own signals (`SOLD_OUT`, `RESTOCK`, `RECALL`: the ones sent during a sale, and
//! only of use to a node where the voucher has an actor) are published with `SPUBLISH` on the
//! voucher's channel, which Redis delivers within the primary that owns the channel's slot
//! only. Each node subscribes (`SSUBSCRIBE`) to the channel of every voucher its actor served
//! twice (or that was warmed up), and unsubscribes when that actor stops: the engine reports
//! both through [`Follows`], and this task keeps the subscriptions in step. So a signal costs one primary's work and reaches
//! the nodes selling that voucher, not every Redis node and every node of the cluster.
//!
//! The rare signals every node needs (`UPDATED`: the catalogue; `WARM`; `SWITCHES`) and the
//! keepalive ping stay on classic pub/sub, which a cluster broadcasts to every primary, through
//! one pattern subscription (`PSUBSCRIBE vouchers:{*}:signal`) on the same connection.
//!
//! The redis crate's cluster client (RESP3, one connection per Redis node) carries the
//! subscriptions. The link counts as down, and is rebuilt on a new client with every followed
//! voucher subscribed again, when a reading of the cluster ([`Topology`], before the link is
//! declared up and each third of the keepalive) differs from the link-up's: the slot map, our
//! connection to each primary, our pattern, or (no batch under way) the number of sharded
//! channels held against the vouchers followed; or when a subscribe fails, Redis drops a
//! followed channel by itself (a `SUNSUBSCRIBE` none of ours accounts for), the push queue
//! overflows, or nothing (reading, message, keepalive ping) arrived for a whole keepalive. Each
//! such break is reported to the engine (`on_link(false)`) so that what lost signals would have
//! said is re-learned from the ledger, as on a single server.
//!
//! A voucher just followed is subscribed once the batch of (un)subscribes under way reaches it; a signal published before that is lost to this node, which then learns the same
//! fact from the ledger (its sold-out probe, lease grants), as with any lost signal.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{PushInfo, PushKind, Value};
use tokio::sync::mpsc;

use super::{channel, code_of, deliver, link, Handler, LinkHandler, BACKOFF, PATTERN, TIMEOUT};
use crate::metrics as m;
use crate::shutdown::Shutdown;

/// Pushes (messages and the library's notices) waiting for the subscriber; more than this and
/// the link is rebuilt (signals are hints: a node that cannot keep up re-learns from the ledger).
const PUSH_QUEUE: usize = 8192;
/// Subscribe and unsubscribe commands in flight at once.
const IN_FLIGHT: usize = 64;
/// The longest wait between two links that failed fast.
const MAX_BACKOFF: Duration = Duration::from_secs(4);

/// The vouchers this node follows on a Redis Cluster: the engine says when to follow one (its
/// actor's second request, a warm-up) and when to stop (that actor stopped), and the subscriber
/// takes the changes.
#[derive(Default)]
pub struct Follows {
    /// Code → followed now or not, since the subscriber last took them (the last word wins).
    pending: Mutex<HashMap<String, bool>>,
    wake: tokio::sync::Notify,
}

impl Follows {
    pub(super) fn set(&self, code: &str, on: bool) {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(code.to_string(), on);
        self.wake.notify_one();
    }

    fn take(&self) -> HashMap<String, bool> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Why a link ended.
enum Ended {
    Shutdown,
    Broken(String),
}

/// Starts the subscriber: sharded subscriptions for the vouchers in `follows`, the pattern for
/// the rest; `handler` gets other nodes' signals and `on_link` hears the link come and go.
pub(super) fn subscribe(
    seeds: Vec<String>,
    node_id: String,
    keepalive: Duration,
    handler: Handler,
    on_link: LinkHandler,
    follows: Arc<Follows>,
    mut shutdown: Shutdown,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // Every voucher followed now: subscribed again on each new link.
        let mut wanted: HashSet<String> = HashSet::new();
        // Doubles while links fail fast (a resharding under way, a primary gone), so that the
        // nodes do not resubscribe everything twice a second meanwhile.
        let mut backoff = BACKOFF;
        while !shutdown.asked() {
            let began = tokio::time::Instant::now();
            let ended = run_link(
                &seeds,
                &node_id,
                keepalive,
                &handler,
                &on_link,
                &follows,
                &mut wanted,
                &mut shutdown,
            )
            .await;
            m::redis_up(false);
            on_link(false);
            match ended {
                Ended::Shutdown => break,
                Ended::Broken(why) => {
                    tracing::warn!(reason = %why, "redis cluster signals link down; reconnecting");
                }
            }
            backoff = if began.elapsed() > MAX_BACKOFF * 4 {
                BACKOFF
            } else {
                (backoff * 2).min(MAX_BACKOFF)
            };
            // The engine's changes still count while the link is down: only the set is kept.
            let wait = tokio::time::sleep(backoff);
            tokio::pin!(wait);
            loop {
                tokio::select! {
                    _ = &mut wait => break,
                    _ = follows.wake.notified() => {
                        apply(&mut wanted, follows.take());
                    }
                    _ = shutdown.recv() => return,
                }
            }
        }
    })
}

/// Folds the engine's changes into the set of followed vouchers; returns them.
fn apply(wanted: &mut HashSet<String>, changes: HashMap<String, bool>) -> Vec<(String, bool)> {
    let mut out = Vec::with_capacity(changes.len());
    for (code, on) in changes {
        let changed = if on {
            wanted.insert(code.clone())
        } else {
            wanted.remove(&code)
        };
        if changed {
            out.push((code, on));
        }
    }
    if crate::memory::mostly_empty(wanted.capacity(), wanted.len()) {
        wanted.shrink_to_fit();
    }
    out
}

/// Our own `SUNSUBSCRIBE`s not yet confirmed, by channel: a confirmation push that matches
/// none was made by Redis (the channel's slot moved), and breaks the link.
type Unsubscribing = Arc<Mutex<HashMap<String, u32>>>;

/// The push sender given to the cluster client: drops the confirmations of subscribe commands
/// and of our own unsubscribes (the library copies every such reply to the push sender, and a
/// flood of follows would otherwise fill the queue), queues the rest, and raises `overflow`
/// when the queue is full.
fn push_sender(
    tx: mpsc::Sender<PushInfo>,
    unsubscribing: Unsubscribing,
    overflow: Arc<AtomicBool>,
) -> impl Fn(PushInfo) -> Result<(), ()> + Send + Sync + 'static {
    move |info: PushInfo| {
        match info.kind {
            PushKind::Subscribe | PushKind::PSubscribe | PushKind::SSubscribe => return Ok(()),
            PushKind::SUnsubscribe => {
                let channel = info.data.first().and_then(text);
                let mut ours = unsubscribing.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(n) = channel.as_ref().and_then(|c| ours.get_mut(c)) {
                    *n -= 1;
                    if *n == 0 {
                        if let Some(c) = &channel {
                            ours.remove(c);
                        }
                    }
                    return Ok(());
                }
            }
            _ => {}
        }
        tx.try_send(info)
            .map_err(|_| overflow.store(true, Ordering::Release))
    }
}

/// One link, from connect to its end.
#[allow(clippy::too_many_arguments)]
async fn run_link(
    seeds: &[String],
    node_id: &str,
    keepalive: Duration,
    handler: &Handler,
    on_link: &LinkHandler,
    follows: &Follows,
    wanted: &mut HashSet<String>,
    shutdown: &mut Shutdown,
) -> Ended {
    let (tx, mut rx) = mpsc::channel::<PushInfo>(PUSH_QUEUE);
    let overflow = Arc::new(AtomicBool::new(false));
    let unsubscribing = Unsubscribing::default();
    let client = match link::cluster_builder(seeds, TIMEOUT)
        .use_protocol(redis::ProtocolVersion::RESP3)
        .push_sender(push_sender(tx, unsubscribing.clone(), overflow.clone()))
        .build()
    {
        Ok(c) => c,
        Err(e) => return Ended::Broken(format!("cluster client: {e}")),
    };
    let up = async {
        let mut conn = link::connect_cluster(&client, TIMEOUT)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        conn.psubscribe(PATTERN)
            .await
            .map_err(|e| format!("psubscribe: {e}"))?;
        // Up only once every primary answers (a cluster with one gone would drop its slots'
        // signals) and holds what was asked, unchanged by the subscribing: what it says now is
        // what later rounds must find.
        let before = Topology::read(&conn, None).await?;
        apply(wanted, follows.take());
        let all: Vec<(String, bool)> = wanted.iter().map(|c| (c.clone(), true)).collect();
        send_changes(conn.clone(), all, unsubscribing.clone()).await?;
        let seen = Topology::read(&conn, Some(&before)).await?;
        seen.judge(&before, Some(wanted.len()))?;
        Ok::<_, String>((conn, seen))
    };
    let (conn, seen) = match shutdown.unless(up).await {
        None => return Ended::Shutdown,
        Some(Err(e)) => return Ended::Broken(e),
        Some(Ok(up)) => up,
    };
    m::redis_up(true);
    tracing::info!(
        followed = wanted.len(),
        "subscribed to cluster signals (sharded)"
    );
    on_link(true);
    let mut ping =
        tokio::time::interval_at(tokio::time::Instant::now() + keepalive / 3, keepalive / 3);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut heard_at = tokio::time::Instant::now();
    // The batch of (un)subscribes under way, if any: pushes and shutdown are served meanwhile.
    let mut sending: Option<futures_util::future::BoxFuture<'static, Result<(), String>>> = None;
    loop {
        if overflow.load(Ordering::Acquire) {
            return Ended::Broken("the push queue overflowed".into());
        }
        let quiet = tokio::time::sleep_until(heard_at + keepalive);
        tokio::select! {
            biased;
            _ = shutdown.recv() => return Ended::Shutdown,
            _ = ping.tick() => {
                let settled = sending.is_none().then_some(wanted.len());
                let round = async { Topology::read(&conn, Some(&seen)).await?.judge(&seen, settled) };
                match shutdown.unless(round).await {
                    None => return Ended::Shutdown,
                    // Every primary's connection answered: as good as a heartbeat.
                    Some(Ok(())) => heard_at = tokio::time::Instant::now(),
                    Some(Err(e)) => return Ended::Broken(e),
                }
            }
            push = rx.recv() => {
                let Some(push) = push else {
                    return Ended::Broken("the push queue closed".into());
                };
                heard_at = tokio::time::Instant::now();
                if let Some(why) = on_push(push, node_id, handler, wanted) {
                    return Ended::Broken(why);
                }
            }
            done = async {
                match sending.as_mut() {
                    Some(batch) => batch.await,
                    None => std::future::pending().await,
                }
            }, if sending.is_some() => {
                sending = None;
                if let Err(e) = done {
                    return Ended::Broken(e);
                }
                // Changes that came meanwhile (their wake-up was taken while this ran).
                let changes = apply(wanted, follows.take());
                if !changes.is_empty() {
                    sending = Some(Box::pin(send_changes(conn.clone(), changes, unsubscribing.clone())));
                }
            }
            _ = follows.wake.notified(), if sending.is_none() => {
                let changes = apply(wanted, follows.take());
                if !changes.is_empty() {
                    sending = Some(Box::pin(send_changes(conn.clone(), changes, unsubscribing.clone())));
                }
            }
            _ = quiet => return Ended::Broken("no traffic from redis within the keepalive".into()),
        }
    }
}

/// Which primary serves which slots, and what our connection to each is and holds. Read at
/// link-up and every third of the keepalive, and judged against what it was at link-up
/// ([`Topology::judge`]): a primary gone, a failover or resharding that moved slots, the library
/// replacing a connection by itself (which loses that connection's subscriptions: its own
/// resubscribe sends every channel in one command, which a cluster refuses across slots), or a
/// subscription missing for any other reason rebuilds the link.
#[derive(Debug)]
struct Topology {
    /// `(first slot, last slot, host, port)`, sorted.
    ranges: Vec<(i64, i64, String, u16)>,
    /// Per primary, by address: our connection's id there (`CLIENT INFO`).
    clients: Vec<((String, u16), i64)>,
    /// Sharded channels our connections hold, summed over the primaries.
    ssub: i64,
    /// Patterns our connections hold, summed over the primaries (ours: one).
    psub: i64,
}

impl Topology {
    /// `CLUSTER SLOTS` from the first primary of `from` (one node's view each round, not a
    /// random node's), or from any node, then `CLIENT INFO` from every primary at once.
    async fn read(conn: &ClusterConnection, from: Option<&Topology>) -> Result<Self, String> {
        let mut c = conn.clone();
        let ask = from
            .and_then(|t| t.clients.first())
            .map(|((host, port), _)| {
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                })
            });
        let cmd = redis::cmd("CLUSTER").arg("SLOTS").clone();
        let slots = match ask {
            Some(to) => c.route_command(&cmd, to).await,
            None => cmd.query_async(&mut c).await,
        }
        .map_err(|e| format!("cluster slots: {e}"))?;
        let ranges = ranges_of(&slots)?;
        let mut primaries: Vec<(String, u16)> =
            ranges.iter().map(|(_, _, h, p)| (h.clone(), *p)).collect();
        primaries.sort();
        primaries.dedup();
        let infos = futures_util::future::join_all(primaries.into_iter().map(|(host, port)| {
            let mut c = conn.clone();
            async move {
                let to = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port,
                });
                let info = c
                    .route_command(redis::cmd("CLIENT").arg("INFO"), to)
                    .await
                    .map_err(|e| format!("client info at {host}:{port}: {e}"))?;
                let fields = text(&info)
                    .map(|t| client_fields(&t))
                    .ok_or_else(|| format!("client info at {host}:{port}: {info:?}"))?;
                Ok::<_, String>(((host, port), fields))
            }
        }))
        .await;
        let (mut clients, mut ssub, mut psub) = (Vec::new(), 0, 0);
        for info in infos {
            let (at, fields) = info?;
            clients.push((at, fields.id));
            ssub += fields.ssub;
            psub += fields.psub;
        }
        Ok(Self {
            ranges,
            clients,
            ssub,
            psub,
        })
    }

    /// Whether this reading still matches `seen` (the link-up's): the same slot map, the same
    /// connections, our one pattern, and with `followed` (no batch under way) exactly that many
    /// sharded channels.
    fn judge(&self, seen: &Topology, followed: Option<usize>) -> Result<(), String> {
        if self.ranges != seen.ranges {
            return Err("the cluster's slot map changed".into());
        }
        if self.clients != seen.clients {
            return Err("a primary's connection was replaced".into());
        }
        if self.psub != 1 {
            return Err(format!("{} pattern subscriptions held, 1 asked", self.psub));
        }
        match followed {
            Some(n) if self.ssub != n as i64 => Err(format!(
                "{} sharded subscriptions held, {n} vouchers followed",
                self.ssub
            )),
            _ => Ok(()),
        }
    }
}

/// What `CLIENT INFO` says of a connection that matters here.
#[derive(Debug, Default, PartialEq)]
struct ClientFields {
    id: i64,
    ssub: i64,
    psub: i64,
}

/// Reads `id=…`, `psub=…` and `ssub=…` from a `CLIENT INFO` line (Redis 7: `ssub`).
fn client_fields(line: &str) -> ClientFields {
    let mut f = ClientFields::default();
    for (key, value) in line.split_whitespace().filter_map(|kv| kv.split_once('=')) {
        let n = value.parse().unwrap_or(0);
        match key {
            "id" => f.id = n,
            "psub" => f.psub = n,
            "ssub" => f.ssub = n,
            _ => {}
        }
    }
    f
}

/// The slot ranges of a `CLUSTER SLOTS` answer with their primaries (each range: start, end,
/// then its primary as `[host, port, id, ...]`, then its replicas), sorted. A primary without a
/// usable address (an empty or `?` host, which the library would guess at) is an error: its
/// slots' signals could not be checked.
fn ranges_of(slots: &Value) -> Result<Vec<(i64, i64, String, u16)>, String> {
    let Value::Array(ranges) = slots else {
        return Err(format!("cluster slots: {slots:?}"));
    };
    let mut out = Vec::with_capacity(ranges.len());
    for range in ranges {
        let bad = || format!("cluster slots: a range without a primary's address: {range:?}");
        let Value::Array(fields) = range else {
            return Err(bad());
        };
        let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(primary))) =
            (fields.first(), fields.get(1), fields.get(2))
        else {
            return Err(bad());
        };
        let host = primary.first().and_then(text).unwrap_or_default();
        let port = match primary.get(1) {
            Some(Value::Int(p)) => u16::try_from(*p).ok(),
            _ => None,
        };
        match port {
            Some(port) if !host.is_empty() && host != "?" => {
                out.push((*first, *last, host, port));
            }
            _ => return Err(bad()),
        }
    }
    if out.is_empty() {
        return Err("the cluster names no primary".into());
    }
    out.sort();
    Ok(out)
}

/// A bulk or simple string's text.
fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok().map(str::to_string),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// Acts on one push; `Some(reason)` when the link must be rebuilt.
fn on_push(
    push: PushInfo,
    node_id: &str,
    handler: &Handler,
    wanted: &HashSet<String>,
) -> Option<String> {
    let (channel_name, payload) = match push.kind {
        PushKind::SMessage | PushKind::Message => (push.data.first(), push.data.get(1)),
        PushKind::PMessage => (push.data.get(1), push.data.get(2)),
        // Ours are dropped before they get here (`push_sender`): Redis dropped this one (its
        // slot moved to another primary), so every subscription is made again.
        PushKind::SUnsubscribe => {
            let channel = push.data.first().and_then(text);
            let followed = channel
                .as_deref()
                .and_then(code_of)
                .is_some_and(|code| wanted.contains(code));
            return followed.then(|| "redis dropped a sharded subscription".into());
        }
        // A closed connection (to a primary or a replica: the notice does not say which) is
        // judged by the next round of `Topology::read`, within a third of the keepalive.
        _ => return None,
    };
    let (Some(channel_name), Some(payload)) = (channel_name.and_then(text), payload.and_then(text))
    else {
        return None;
    };
    deliver(&channel_name, &payload, node_id, handler);
    None
}

/// Subscribes (`true`) and unsubscribes (`false`) the vouchers' channels, `IN_FLIGHT` at a time;
/// the first failure is the answer. Each unsubscribe is counted in `unsubscribing` before it
/// goes, so that its confirmation is known as ours.
async fn send_changes(
    conn: ClusterConnection,
    changes: Vec<(String, bool)>,
    unsubscribing: Unsubscribing,
) -> Result<(), String> {
    let mut results = futures_util::stream::iter(changes.into_iter().map(|(code, on)| {
        let (mut c, unsubscribing) = (conn.clone(), unsubscribing.clone());
        async move {
            let ch = channel(&code);
            let res = if on {
                c.ssubscribe(&ch).await
            } else {
                *unsubscribing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(ch.clone())
                    .or_default() += 1;
                c.sunsubscribe(&ch).await
            };
            res.map_err(|e| {
                let what = if on { "ssubscribe" } else { "sunsubscribe" };
                format!("{what} {ch}: {e}")
            })
        }
    }))
    .buffer_unordered(IN_FLIGHT);
    while let Some(res) = results.next().await {
        res?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_word_about_a_voucher_wins_and_only_changes_are_sent() {
        let f = Follows::default();
        f.set("A", true);
        f.set("B", true);
        f.set("A", false);
        let mut wanted = HashSet::new();
        let mut changes = apply(&mut wanted, f.take());
        changes.sort();
        // A was never subscribed: nothing to undo.
        assert_eq!(changes, vec![("B".to_string(), true)]);
        assert!(f.take().is_empty());
        f.set("B", true);
        assert!(apply(&mut wanted, f.take()).is_empty());
        f.set("B", false);
        assert_eq!(apply(&mut wanted, f.take()), vec![("B".to_string(), false)]);
        assert!(wanted.is_empty());
    }

    #[test]
    fn the_slot_map_is_read_with_its_primaries_and_refused_without_an_address() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let range = |a: i64, b: i64, host: &str, port: i64| {
            Value::Array(vec![
                Value::Int(a),
                Value::Int(b),
                node(host, port),
                node("127.0.0.1", port + 100),
            ])
        };
        let slots = Value::Array(vec![
            range(100, 199, "127.0.0.1", 7102),
            range(0, 99, "127.0.0.1", 7101),
        ]);
        assert_eq!(
            ranges_of(&slots),
            Ok(vec![
                (0, 99, "127.0.0.1".to_string(), 7101),
                (100, 199, "127.0.0.1".to_string(), 7102)
            ])
        );
        for host in ["", "?"] {
            let slots = Value::Array(vec![range(0, 99, host, 7101)]);
            assert!(ranges_of(&slots).is_err(), "{host:?}");
        }
        assert!(ranges_of(&Value::Array(vec![])).is_err());
        assert!(ranges_of(&Value::Nil).is_err());
    }

    #[test]
    fn a_reading_must_match_the_link_ups() {
        let top = |port: u16, id: i64, ssub: i64, psub: i64| Topology {
            ranges: vec![(0, 16383, "127.0.0.1".to_string(), port)],
            clients: vec![(("127.0.0.1".to_string(), port), id)],
            ssub,
            psub,
        };
        let seen = top(7101, 5, 3, 1);
        assert!(top(7101, 5, 3, 1).judge(&seen, Some(3)).is_ok());
        // A batch under way: the count is not judged.
        assert!(top(7101, 5, 1, 1).judge(&seen, None).is_ok());
        assert!(top(7101, 5, 1, 1).judge(&seen, Some(3)).is_err());
        assert!(
            top(7101, 6, 3, 1).judge(&seen, Some(3)).is_err(),
            "replaced"
        );
        assert!(top(7102, 5, 3, 1).judge(&seen, Some(3)).is_err(), "moved");
        assert!(
            top(7101, 5, 3, 0).judge(&seen, Some(3)).is_err(),
            "no pattern"
        );
        assert_eq!(
            client_fields("id=42 addr=127.0.0.1:5 name= db=0 sub=0 psub=1 ssub=7 multi=-1"),
            ClientFields {
                id: 42,
                ssub: 7,
                psub: 1
            }
        );
    }

    #[test]
    fn confirmations_and_our_own_unsubscribes_never_reach_the_queue() {
        let (tx, mut rx) = mpsc::channel(8);
        let (unsubscribing, overflow) =
            (Unsubscribing::default(), Arc::new(AtomicBool::new(false)));
        let send = push_sender(tx, unsubscribing.clone(), overflow.clone());
        let push = |kind: PushKind, code: &str| PushInfo {
            kind,
            data: vec![Value::BulkString(channel(code).into_bytes()), Value::Int(1)],
        };
        unsubscribing.lock().unwrap().insert(channel("MINE"), 1);
        assert!(send(push(PushKind::SSubscribe, "A")).is_ok());
        assert!(send(push(PushKind::SUnsubscribe, "MINE")).is_ok());
        assert!(unsubscribing.lock().unwrap().is_empty());
        assert!(rx.try_recv().is_err(), "nothing queued yet");
        // The same confirmation again, or one for another channel: Redis made it.
        assert!(send(push(PushKind::SUnsubscribe, "MINE")).is_ok());
        assert!(rx
            .try_recv()
            .is_ok_and(|p| p.kind == PushKind::SUnsubscribe));
        for _ in 0..8 {
            let _ = send(push(PushKind::SMessage, "A"));
        }
        assert!(send(push(PushKind::SMessage, "A")).is_err());
        assert!(overflow.load(Ordering::Acquire));
    }

    #[test]
    fn a_sharded_unsubscribe_breaks_the_link_when_its_voucher_is_followed() {
        let handler: Handler = Arc::new(|_, _| {});
        let push = |code: &str| PushInfo {
            kind: PushKind::SUnsubscribe,
            data: vec![Value::BulkString(channel(code).into_bytes()), Value::Int(0)],
        };
        let wanted: HashSet<String> = ["KEPT".to_string()].into();
        assert!(on_push(push("GONE"), "n", &handler, &wanted).is_none());
        assert!(on_push(push("KEPT"), "n", &handler, &wanted).is_some());
        // A closed connection is judged by the next topology round, not by the notice.
        let closed = PushInfo {
            kind: PushKind::Disconnection,
            data: vec![],
        };
        assert!(on_push(closed, "n", &handler, &wanted).is_none());
    }

    #[test]
    fn sharded_and_pattern_messages_reach_the_handler_but_not_ones_own() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        let handler: Handler = Arc::new(move |code, kind| {
            g.lock().unwrap().push((code.to_string(), kind));
        });
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let wanted = HashSet::new();
        let s = PushInfo {
            kind: PushKind::SMessage,
            data: vec![bulk(&channel("V1")), bulk("SOLD_OUT other")],
        };
        let p = PushInfo {
            kind: PushKind::PMessage,
            data: vec![bulk(PATTERN), bulk(&channel("V2")), bulk("WARM other")],
        };
        let own = PushInfo {
            kind: PushKind::SMessage,
            data: vec![bulk(&channel("V3")), bulk("RESTOCK me")],
        };
        for push in [s, p, own] {
            assert!(on_push(push, "me", &handler, &wanted).is_none());
        }
        assert_eq!(
            *got.lock().unwrap(),
            vec![
                ("V1".to_string(), super::super::Signal::SoldOut),
                ("V2".to_string(), super::super::Signal::Warm)
            ]
        );
    }
}
