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
//! voucher subscribed again, when: the slot map or the `CLIENT ID` of our connection to any
//! primary differs from what it was at link-up, or a primary does not answer (`Topology`, read
//! before the link is declared up and each third of the keepalive: a primary gone, a failover
//! or resharding, or the library replacing a connection by itself, which loses that
//! connection's subscriptions); nothing arrived for a whole keepalive; a subscribe fails; Redis
//! drops a followed channel by itself (a `SUNSUBSCRIBE` none of ours accounts for); or the
//! push queue overflows. Each such break is reported to the engine (`on_link(false)`) so that
//! what lost signals would have said is re-learned from the ledger, as on a single server.
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

use super::{channel, code_of, hear, link, Handler, Heard, LinkHandler, BACKOFF, PATTERN, TIMEOUT};
use crate::metrics as m;
use crate::shutdown::Shutdown;

/// Pushes (messages and the library's notices) waiting for the subscriber; more than this and
/// the link is rebuilt (signals are hints: a node that cannot keep up re-learns from the ledger).
const PUSH_QUEUE: usize = 8192;
/// Subscribe and unsubscribe commands in flight at once.
const IN_FLIGHT: usize = 64;

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
        while !shutdown.asked() {
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
            // The engine's changes still count while the link is down: only the set is kept.
            let backoff = tokio::time::sleep(BACKOFF);
            tokio::pin!(backoff);
            loop {
                tokio::select! {
                    _ = &mut backoff => break,
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
        apply(wanted, follows.take());
        let all: Vec<(String, bool)> = wanted.iter().map(|c| (c.clone(), true)).collect();
        send_changes(conn.clone(), all, unsubscribing.clone()).await?;
        // Up only once every primary answers: a cluster with one gone would drop its slots'
        // signals. What it answers now is what later rounds must find unchanged.
        let seen = Topology::read(&mut conn).await?;
        Ok::<_, String>((conn, seen))
    };
    let (mut conn, seen) = match shutdown.unless(up).await {
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
            _ = ping.tick() => {
                match Topology::read(&mut conn).await {
                    // Every primary's connection answered: as good as a heartbeat.
                    Ok(now) if now == seen => heard_at = tokio::time::Instant::now(),
                    Ok(_) => return Ended::Broken("the slot map or a primary's connection changed".into()),
                    Err(e) => return Ended::Broken(e),
                }
            }
            _ = quiet => return Ended::Broken("no traffic from redis within the keepalive".into()),
        }
    }
}

/// Which primary serves which slots, and the id Redis gave this client's connection to each.
/// Read at link-up and every third of the keepalive: any change (a primary gone, a failover or
/// resharding moved slots, the library replaced a connection by itself, which loses that
/// connection's subscriptions) rebuilds the link.
#[derive(Debug, PartialEq, Eq)]
struct Topology {
    /// `(first slot, last slot, host, port)`, in the order `CLUSTER SLOTS` gives them, sorted.
    ranges: Vec<(i64, i64, String, u16)>,
    /// `CLIENT ID` of our connection to each primary, by address.
    clients: Vec<((String, u16), i64)>,
}

impl Topology {
    async fn read(conn: &mut ClusterConnection) -> Result<Self, String> {
        let slots: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(conn)
            .await
            .map_err(|e| format!("cluster slots: {e}"))?;
        let ranges = ranges_of(&slots)?;
        let mut primaries: Vec<(String, u16)> =
            ranges.iter().map(|(_, _, h, p)| (h.clone(), *p)).collect();
        primaries.sort();
        primaries.dedup();
        let mut clients = Vec::with_capacity(primaries.len());
        for (host, port) in primaries {
            let to = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port,
            });
            let id = conn
                .route_command(redis::cmd("CLIENT").arg("ID"), to)
                .await
                .map_err(|e| format!("client id at {host}:{port}: {e}"))?;
            let Value::Int(id) = id else {
                return Err(format!("client id at {host}:{port}: {id:?}"));
            };
            clients.push(((host, port), id));
        }
        Ok(Self { ranges, clients })
    }
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
    match hear(&channel_name, &payload, node_id) {
        Heard::Heartbeat => m::redis_up(true),
        Heard::Signal(code, kind) => {
            m::signal("received", kind.as_str());
            handler(code, kind);
        }
        Heard::Nothing => {}
    }
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
