//! Cluster signals over Redis pub/sub: `SOLD_OUT`, `RESTOCK`, `RECALL`, `UPDATED`, `WARM`, and
//! `SWITCHES` (on `vouchers:{~switches}:signal`).
//!
//! Signals are hints that make the cluster converge faster; no unit and no stored order depends
//! on them. The one answer that leans on them is the sold-out flag's: a node trusts its flag
//! only while its subscription is up (see [`LinkHandler`]) and within two probe intervals of the
//! ledger last confirming it, so a lost `RESTOCK` costs at most that long.
//! Publishing never blocks the caller: a bounded queue feeds one background publisher, and a full
//! queue or a Redis outage drops the signal (counted). The subscriber reconnects by itself. Nodes
//! learn the same facts later from the ledger (sold-out probes, dry-hold expiry, lease grants).
//!
//! Channel names carry the voucher code in a hash tag, `vouchers:{CODE}:signal`, so the same
//! scheme maps onto Redis Cluster slots. The payload is `KIND NODE_ID`; a node ignores its own.
//!
//! Keepalive: the publisher sends `PING NODE_ID` on its own channel (`vouchers:{~}:signal`, no
//! voucher code can contain `~`) every third of `redis.keepalive_ms`, and the subscriber, which
//! receives those pings like any signal, reconnects when nothing arrived for a whole keepalive.
//! A half-open connection (the socket stays, nothing flows) therefore ends within one keepalive,
//! and `vouchers_redis_up` (owned by the subscriber) says so.
//!
//! On a Redis Cluster (`redis.cluster = true`) a voucher's own signals go by sharded pub/sub
//! to the nodes that follow it (see [`cluster`]); [`link`] says where Redis is for the
//! publisher and the feed relay.

mod cluster;
mod link;

pub use cluster::Follows;
pub use link::{key_beside, Conn, Target};

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;

use crate::metrics as m;
use crate::shutdown::Shutdown;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    SoldOut,
    Restock,
    Recall,
    Updated,
    /// The emergency switches changed: read them from the ledger.
    Switches,
    /// An operator warmed the voucher: every node takes its first lease now.
    Warm,
}

impl Signal {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SoldOut => "SOLD_OUT",
            Self::Restock => "RESTOCK",
            Self::Recall => "RECALL",
            Self::Updated => "UPDATED",
            Self::Switches => "SWITCHES",
            Self::Warm => "WARM",
        }
    }

    /// Whether this signal concerns only the nodes selling the voucher (an actor there), and so
    /// goes by sharded pub/sub on a Redis Cluster; the others reach every node.
    pub fn sharded(self) -> bool {
        matches!(self, Self::SoldOut | Self::Restock | Self::Recall)
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "SOLD_OUT" => Some(Self::SoldOut),
            "RESTOCK" => Some(Self::Restock),
            "RECALL" => Some(Self::Recall),
            "UPDATED" => Some(Self::Updated),
            "SWITCHES" => Some(Self::Switches),
            "WARM" => Some(Self::Warm),
            _ => None,
        }
    }
}

const PATTERN: &str = "vouchers:{*}:signal";
/// The keepalive channel: matched by the pattern, never a voucher's.
const HEARTBEAT: &str = "vouchers:{~}:signal";
const QUEUE: usize = 4096;
const TIMEOUT: Duration = Duration::from_millis(500);
const BACKOFF: Duration = Duration::from_millis(500);

pub fn channel(code: &str) -> String {
    format!("vouchers:{{{code}}}:signal")
}

/// The code inside a channel name, if it is one of ours.
pub fn code_of(channel: &str) -> Option<&str> {
    channel.strip_prefix("vouchers:{")?.strip_suffix("}:signal")
}

/// Acts on a message of one of our channels (its payload `KIND NODE_ID`): a keepalive ping
/// keeps `vouchers_redis_up` fresh (it leaves /metrics when idle); another node's signal about
/// a voucher goes to `handler`; anything else, and this node's own, is ignored. Both
/// subscribers (one server, a cluster) hand every message here.
fn deliver(channel_name: &str, payload: &str, node_id: &str, handler: &Handler) {
    if channel_name == HEARTBEAT {
        m::redis_up(true);
        return;
    }
    let mut parts = payload.splitn(2, ' ');
    let (Some(kind), from) = (parts.next().and_then(Signal::parse), parts.next()) else {
        return;
    };
    if let Some(code) = code_of(channel_name).filter(|_| from != Some(node_id)) {
        m::signal("received", kind.as_str());
        handler(code, kind);
    }
}

/// The publishing side, held by the engine. Cheap to clone; a no-op without Redis.
#[derive(Clone, Default)]
pub struct Publisher {
    tx: Option<mpsc::Sender<(String, Signal)>>,
    /// On a Redis Cluster: the vouchers whose sharded channels this node subscribes to.
    follows: Option<Arc<Follows>>,
}

impl Publisher {
    pub fn disabled() -> Self {
        Self::default()
    }

    /// The vouchers to follow, on a Redis Cluster (for the subscriber).
    pub fn follows(&self) -> Option<Arc<Follows>> {
        self.follows.clone()
    }

    /// Whether [`Publisher::follow`] does anything (a Redis Cluster is configured).
    pub fn follows_signals(&self) -> bool {
        self.follows.is_some()
    }

    /// Follow `code`'s signals now (`true`: its actor here was asked for twice, or warmed) or no
    /// longer (`false`: that actor stopped): on a Redis Cluster its sharded channel is subscribed
    /// meanwhile. A no-op otherwise.
    pub fn follow(&self, code: &str, on: bool) {
        if let Some(f) = &self.follows {
            f.set(code, on);
        }
    }

    /// Whether signals go anywhere (Redis is configured).
    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    pub fn publish(&self, code: &str, signal: Signal) {
        if let Some(tx) = &self.tx {
            if tx.try_send((code.to_string(), signal)).is_err() {
                m::signal("dropped", signal.as_str());
            }
        }
    }
}

/// What a node does with a signal from another node.
pub type Handler = Arc<dyn Fn(&str, Signal) + Send + Sync>;
/// Told `true` each time the subscription is (re)established and `false` each time it ends:
/// signals published while it was down are lost, so what they would have said must be
/// re-learned from the ledger.
pub type LinkHandler = Arc<dyn Fn(bool) + Send + Sync>;

/// Starts the publisher; the subscriber starts with [`subscribe`] once the handler exists.
pub fn publisher(
    target: &Target,
    node_id: &str,
    keepalive: Duration,
    shutdown: Shutdown,
) -> (Publisher, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(QUEUE);
    let task = tokio::spawn(run_publisher(
        target.clone(),
        node_id.to_string(),
        rx,
        keepalive,
        shutdown,
    ));
    let follows = target.is_cluster().then(Arc::default);
    (
        Publisher {
            tx: Some(tx),
            follows,
        },
        task,
    )
}

async fn run_publisher(
    target: Target,
    node_id: String,
    mut rx: mpsc::Receiver<(String, Signal)>,
    keepalive: Duration,
    mut shutdown: Shutdown,
) {
    let mut conn: Option<Conn> = None;
    let mut retry_at = tokio::time::Instant::now();
    let mut ping = tokio::time::interval(keepalive / 3);
    // Shutdown was asked and the queue takes nothing new: what it holds is still sent.
    let mut closed = false;
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Either a signal to send or, when the ping is due, the keepalive (`None`). Once
        // shutdown is asked the queue takes nothing new, and what it holds (the drain's
        // restocks) is still sent.
        if !closed && shutdown.asked() {
            rx.close();
            closed = true;
        }
        let next = tokio::select! {
            item = rx.recv() => match item {
                Some(item) => Some(item),
                None => return,
            },
            _ = shutdown.recv(), if !closed => continue,
            _ = ping.tick(), if !closed => None,
        };
        if conn.is_none() && tokio::time::Instant::now() >= retry_at {
            match target.connect(TIMEOUT).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    m::redis_up(false);
                    tracing::warn!(error = %e, "redis unreachable; signals are dropped until it returns");
                    retry_at = tokio::time::Instant::now() + BACKOFF;
                }
            }
        }
        let kind = next.as_ref().map(|(_, s)| s.as_str());
        let Some(c) = conn.as_mut() else {
            if let Some(kind) = kind {
                m::signal("dropped", kind);
            }
            continue;
        };
        let (to, payload) = match &next {
            Some((code, signal)) => (channel(code), format!("{} {node_id}", signal.as_str())),
            None => (HEARTBEAT.to_string(), format!("PING {node_id}")),
        };
        let sharded = target.is_cluster() && next.as_ref().is_some_and(|(_, s)| s.sharded());
        let res: redis::RedisResult<i64> = redis::cmd(if sharded { "SPUBLISH" } else { "PUBLISH" })
            .arg(to)
            .arg(payload)
            .query_async(c)
            .await;
        match res {
            Ok(_) => {
                if let Some(kind) = kind {
                    m::signal("published", kind);
                }
            }
            Err(e) => {
                if let Some(kind) = kind {
                    m::signal("dropped", kind);
                }
                tracing::warn!(error = %e, "redis publish failed");
                // On a cluster a server's refusal (its slots down, a move under way) concerns
                // that signal's primary only: the others' signals keep the connection.
                let lost = !target.is_cluster()
                    || e.is_io_error()
                    || e.is_timeout()
                    || e.is_connection_dropped()
                    || e.is_unrecoverable_error();
                if lost {
                    conn = None;
                    retry_at = tokio::time::Instant::now() + BACKOFF;
                }
            }
        }
    }
}

/// Subscribes to every voucher's channel and hands other nodes' signals to `handler`,
/// reconnecting after any failure; `on_link` hears when the subscription is up and when it ends.
/// On a Redis Cluster the vouchers' own signals come by sharded pub/sub for the vouchers in
/// the publisher's [`Publisher::follows`] (see [`cluster`]).
pub fn subscribe(
    target: &Target,
    follows: Option<Arc<Follows>>,
    node_id: &str,
    keepalive: Duration,
    handler: Handler,
    on_link: LinkHandler,
    shutdown: Shutdown,
) -> Result<tokio::task::JoinHandle<()>, redis::RedisError> {
    let node_id = node_id.to_string();
    match (target, follows) {
        (Target::Cluster(seeds), Some(follows)) => Ok(cluster::subscribe(
            seeds.clone(),
            node_id,
            keepalive,
            handler,
            on_link,
            follows,
            shutdown,
        )),
        (Target::Cluster(_), None) => Err(redis::RedisError::from((
            redis::ErrorKind::InvalidClientConfig,
            "a Redis Cluster subscriber needs the publisher's follows (start the publisher first)",
        ))),
        (Target::Single(client), _) => Ok(subscribe_single(
            client.clone(),
            node_id,
            keepalive,
            handler,
            on_link,
            shutdown,
        )),
    }
}

/// The subscriber on one Redis server: one pattern subscription for every voucher.
fn subscribe_single(
    client: redis::Client,
    node_id: String,
    keepalive: Duration,
    handler: Handler,
    on_link: LinkHandler,
    mut shutdown: Shutdown,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !shutdown.asked() {
            match tokio::time::timeout(TIMEOUT, client.get_async_pubsub()).await {
                Ok(Ok(mut pubsub)) => match pubsub.psubscribe(PATTERN).await {
                    Ok(()) => {
                        m::redis_up(true);
                        tracing::info!("subscribed to cluster signals");
                        on_link(true);
                        let mut stream = pubsub.on_message();
                        loop {
                            let next = tokio::time::timeout(keepalive, stream.next());
                            let msg = match shutdown.unless(next).await {
                                None => break,
                                Some(Ok(Some(msg))) => msg,
                                Some(Ok(None)) => break,
                                Some(Err(_)) => {
                                    tracing::warn!("no traffic from redis within the keepalive");
                                    break;
                                }
                            };
                            let payload = msg.get_payload::<String>().unwrap_or_default();
                            deliver(msg.get_channel_name(), &payload, &node_id, &handler);
                        }
                        if !shutdown.asked() {
                            tracing::warn!("redis subscription ended; reconnecting");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "redis psubscribe failed"),
                },
                Ok(Err(e)) => tracing::warn!(error = %e, "redis unreachable for signals"),
                Err(_) => tracing::warn!("redis connect timed out"),
            }
            m::redis_up(false);
            on_link(false);
            shutdown.unless(tokio::time::sleep(BACKOFF)).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_carry_the_code_in_a_hash_tag() {
        assert_eq!(channel("SALE-1"), "vouchers:{SALE-1}:signal");
        assert_eq!(code_of("vouchers:{SALE-1}:signal"), Some("SALE-1"));
        assert_eq!(code_of("other:{x}:signal"), None);
        for s in [
            Signal::SoldOut,
            Signal::Restock,
            Signal::Recall,
            Signal::Updated,
            Signal::Switches,
            Signal::Warm,
        ] {
            assert_eq!(Signal::parse(s.as_str()), Some(s));
        }
    }

    /// Asked to stop with signals queued (the drain's restocks), the publisher sends or drops
    /// them and ends by itself, whichever way the shutdown meets its loop: it is never left
    /// waiting on the queue until its deadline aborts it. Redis is unreachable here, so each
    /// signal is dropped at once; time is paused and jumps ahead when the runtime idles.
    #[tokio::test(start_paused = true)]
    async fn the_publisher_stops_by_itself_with_signals_queued() {
        for _ in 0..20 {
            let mut tasks = crate::shutdown::Tasks::new();
            let target = Target::open("redis://127.0.0.1:1", false).unwrap();
            let (publisher, task) =
                publisher(&target, "n", Duration::from_millis(300), tasks.shutdown());
            tasks.add("publisher", task);
            for i in 0..5 {
                publisher.publish(&format!("V{i}"), Signal::Restock);
            }
            assert_eq!(tasks.stop(Duration::from_secs(60)).await, 0);
            drop(publisher);
        }
    }
}
