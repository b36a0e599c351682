//! The subscriber on a Redis Cluster (`redis.cluster = true`): sharded pub/sub per voucher.
//!
//! A voucher's own signals (`SOLD_OUT`, `RESTOCK`, `RECALL`: the ones sent during a sale, and
//! only of use to a node where the voucher has an actor) are published with `SPUBLISH` on the
//! voucher's channel, which Redis delivers within the primary that owns the channel's slot
//! only. Each node subscribes (`SSUBSCRIBE`) to the channel of every voucher it has an actor
//! for, and unsubscribes when the actor stops: the engine reports both through [`Follows`], and
//! this task keeps the subscriptions in step. So a signal costs one primary's work and reaches
//! the nodes selling that voucher, not every Redis node and every node of the cluster.
//!
//! The rare signals every node needs (`UPDATED`: the catalogue; `WARM`; `SWITCHES`) and the
//! keepalive ping stay on classic pub/sub, which a cluster broadcasts to every primary, through
//! one pattern subscription (`PSUBSCRIBE vouchers:{*}:signal`) on the same connection.
//!
//! One connection (the redis crate's cluster connection, RESP3) carries the subscriptions and,
//! each third of the keepalive, a `PING` to every primary of the slot map. The link counts as
//! down, and is rebuilt from scratch with every followed voucher subscribed again, when: a
//! primary's connection closes (the library's `Disconnection` push), a ping fails (a primary
//! is gone or the cluster is down: its slots' signals would be lost), nothing arrived for a
//! whole keepalive (the node's own keepalive ping comes every third of it), a subscribe fails,
//! Redis drops a sharded subscription by itself (a slot moved: resharding or failover), or the
//! push queue overflows. Each such break is reported to the engine (`on_link(false)`) so that
//! what lost signals would have said is re-learned from the ledger, as on a single server.
//!
//! A voucher whose actor just started is subscribed within a round trip; a signal published
//! before that is lost to this node, which then learns the same fact from the ledger (its
//! sold-out probe, lease grants), as with any lost signal.

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

/// The vouchers this node follows on a Redis Cluster: the engine says when a voucher's actor
/// starts and stops, and the subscriber takes the changes.
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
    let full = overflow.clone();
    let push = move |info: PushInfo| {
        tx.try_send(info)
            .map_err(|_| full.store(true, Ordering::Release))
    };
    let client = match link::cluster_builder(seeds, TIMEOUT)
        .use_protocol(redis::ProtocolVersion::RESP3)
        .push_sender(push)
        .build()
    {
        Ok(c) => c,
        Err(e) => return Ended::Broken(format!("cluster client: {e}")),
    };
    let mut conn = match link::connect_cluster(&client, TIMEOUT).await {
        Ok(c) => c,
        Err(e) => return Ended::Broken(format!("connect: {e}")),
    };
    if let Err(e) = conn.psubscribe(PATTERN).await {
        return Ended::Broken(format!("psubscribe: {e}"));
    }
    apply(wanted, follows.take());
    let all: Vec<(String, bool)> = wanted.iter().map(|c| (c.clone(), true)).collect();
    if let Err(e) = send_changes(&conn, all).await {
        return Ended::Broken(e);
    }
    // Up only once every primary answers: a cluster with one gone would drop its slots' signals.
    if let Err(e) = ping_primaries(&mut conn).await {
        return Ended::Broken(e);
    }
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
    loop {
        if overflow.load(Ordering::Acquire) {
            return Ended::Broken("the push queue overflowed".into());
        }
        let quiet = tokio::time::sleep_until(heard_at + keepalive);
        tokio::select! {
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
            _ = follows.wake.notified() => {
                let changes = apply(wanted, follows.take());
                if let Err(e) = send_changes(&conn, changes).await {
                    return Ended::Broken(e);
                }
            }
            _ = ping.tick() => {
                if let Err(e) = ping_primaries(&mut conn).await {
                    return Ended::Broken(e);
                }
            }
            _ = quiet => return Ended::Broken("no traffic from redis within the keepalive".into()),
        }
    }
}

/// Pings every primary the cluster's slot map names, each at its own address: a primary that
/// is gone fails the check (a `PING` routed to "all primaries" skips the ones the client holds
/// no connection to, and a primary's connection is where its subscriptions sit).
async fn ping_primaries(conn: &mut ClusterConnection) -> Result<(), String> {
    let slots: Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(conn)
        .await
        .map_err(|e| format!("cluster slots: {e}"))?;
    let primaries = primaries_of(&slots);
    if primaries.is_empty() {
        return Err("the cluster names no primary".into());
    }
    for (host, port) in primaries {
        let to = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
            host: host.clone(),
            port,
        });
        conn.route_command(&redis::cmd("PING"), to)
            .await
            .map_err(|e| format!("ping {host}:{port}: {e}"))?;
    }
    Ok(())
}

/// The primaries' addresses in a `CLUSTER SLOTS` answer (each range: start, end, then its
/// primary as `[host, port, id, ...]`, then its replicas), each once.
fn primaries_of(slots: &Value) -> Vec<(String, u16)> {
    let mut out: Vec<(String, u16)> = Vec::new();
    let Value::Array(ranges) = slots else {
        return out;
    };
    for range in ranges {
        let Value::Array(fields) = range else {
            continue;
        };
        let Some(Value::Array(primary)) = fields.get(2) else {
            continue;
        };
        let host = match primary.first() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            _ => continue,
        };
        let Some(Value::Int(port)) = primary.get(1) else {
            continue;
        };
        let Ok(port) = u16::try_from(*port) else {
            continue;
        };
        if !out.contains(&(host.clone(), port)) {
            out.push((host, port));
        }
    }
    out
}

/// Acts on one push; `Some(reason)` when the link must be rebuilt.
fn on_push(
    push: PushInfo,
    node_id: &str,
    handler: &Handler,
    wanted: &HashSet<String>,
) -> Option<String> {
    let text = |v: &Value| match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok().map(str::to_string),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let (channel_name, payload) = match push.kind {
        PushKind::Disconnection => return Some("a primary's connection closed".into()),
        PushKind::SMessage | PushKind::Message => (push.data.first(), push.data.get(1)),
        PushKind::PMessage => (push.data.get(1), push.data.get(2)),
        PushKind::SUnsubscribe => {
            // Ours when the voucher is no longer followed; otherwise Redis dropped it (its slot
            // moved to another primary) and every subscription is made again.
            let dropped = push.data.first().and_then(text);
            let ours = dropped
                .as_deref()
                .and_then(code_of)
                .is_none_or(|code| !wanted.contains(code));
            return (!ours).then(|| "redis dropped a sharded subscription".into());
        }
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
/// the first failure is the answer.
async fn send_changes(
    conn: &ClusterConnection,
    changes: Vec<(String, bool)>,
) -> Result<(), String> {
    let mut results = futures_util::stream::iter(changes.into_iter().map(|(code, on)| {
        let mut c = conn.clone();
        async move {
            let ch = channel(&code);
            let res = if on {
                c.ssubscribe(&ch).await
            } else {
                c.sunsubscribe(&ch).await
            };
            res.map_err(|e| {
                format!(
                    "{} {ch}: {e}",
                    if on { "ssubscribe" } else { "sunsubscribe" }
                )
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
    fn the_primaries_are_read_from_cluster_slots_once_each() {
        let node = |port: i64| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let range = |a: i64, b: i64, primary: i64, replica: i64| {
            Value::Array(vec![
                Value::Int(a),
                Value::Int(b),
                node(primary),
                node(replica),
            ])
        };
        let slots = Value::Array(vec![
            range(0, 99, 7101, 7201),
            range(100, 199, 7102, 7202),
            range(200, 299, 7101, 7201),
        ]);
        assert_eq!(
            primaries_of(&slots),
            vec![
                ("127.0.0.1".to_string(), 7101),
                ("127.0.0.1".to_string(), 7102)
            ]
        );
        assert!(primaries_of(&Value::Nil).is_empty());
    }

    #[test]
    fn a_sharded_unsubscribe_breaks_the_link_only_when_redis_made_it() {
        let handler: Handler = Arc::new(|_, _| {});
        let push = |code: &str| PushInfo {
            kind: PushKind::SUnsubscribe,
            data: vec![Value::BulkString(channel(code).into_bytes()), Value::Int(0)],
        };
        let wanted: HashSet<String> = ["KEPT".to_string()].into();
        assert!(on_push(push("GONE"), "n", &handler, &wanted).is_none());
        assert!(on_push(push("KEPT"), "n", &handler, &wanted).is_some());
        let closed = PushInfo {
            kind: PushKind::Disconnection,
            data: vec![],
        };
        assert!(on_push(closed, "n", &handler, &wanted).is_some());
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
