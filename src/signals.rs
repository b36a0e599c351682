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

/// The publishing side, held by the engine. Cheap to clone; a no-op without Redis.
#[derive(Clone, Default)]
pub struct Publisher {
    tx: Option<mpsc::Sender<(String, Signal)>>,
}

impl Publisher {
    pub fn disabled() -> Self {
        Self { tx: None }
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
    url: &str,
    node_id: &str,
    keepalive: Duration,
    shutdown: Shutdown,
) -> Result<(Publisher, tokio::task::JoinHandle<()>), redis::RedisError> {
    let client = redis::Client::open(url)?;
    let (tx, rx) = mpsc::channel(QUEUE);
    let task = tokio::spawn(run_publisher(
        client,
        node_id.to_string(),
        rx,
        keepalive,
        shutdown,
    ));
    Ok((Publisher { tx: Some(tx) }, task))
}

async fn run_publisher(
    client: redis::Client,
    node_id: String,
    mut rx: mpsc::Receiver<(String, Signal)>,
    keepalive: Duration,
    mut shutdown: Shutdown,
) {
    let mut conn: Option<redis::aio::MultiplexedConnection> = None;
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
            match connect(&client, TIMEOUT).await {
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
        let (target, payload) = match &next {
            Some((code, signal)) => (channel(code), format!("{} {node_id}", signal.as_str())),
            None => (HEARTBEAT.to_string(), format!("PING {node_id}")),
        };
        let res: redis::RedisResult<i64> = redis::cmd("PUBLISH")
            .arg(target)
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
                conn = None;
                retry_at = tokio::time::Instant::now() + BACKOFF;
            }
        }
    }
}

/// A multiplexed connection whose connect and every command give up after `timeout`.
pub(crate) async fn connect(
    client: &redis::Client,
    timeout: Duration,
) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout);
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// Subscribes to every voucher's channel and hands other nodes' signals to `handler`,
/// reconnecting after any failure; `on_link` hears when the subscription is up and when it ends.
pub fn subscribe(
    url: &str,
    node_id: &str,
    keepalive: Duration,
    handler: Handler,
    on_link: LinkHandler,
    mut shutdown: Shutdown,
) -> Result<tokio::task::JoinHandle<()>, redis::RedisError> {
    let client = redis::Client::open(url)?;
    let node_id = node_id.to_string();
    Ok(tokio::spawn(async move {
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
                            if msg.get_channel_name() == HEARTBEAT {
                                // Keeps the gauge fresh (it leaves /metrics when idle).
                                m::redis_up(true);
                                continue;
                            }
                            let Ok(payload) = msg.get_payload::<String>() else {
                                continue;
                            };
                            let mut parts = payload.splitn(2, ' ');
                            let (Some(kind), from) =
                                (parts.next().and_then(Signal::parse), parts.next())
                            else {
                                continue;
                            };
                            if from == Some(node_id.as_str()) {
                                continue;
                            }
                            if let Some(code) = code_of(msg.get_channel_name()) {
                                m::signal("received", kind.as_str());
                                handler(code, kind);
                            }
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
    }))
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
            let (publisher, task) = publisher(
                "redis://127.0.0.1:1",
                "n",
                Duration::from_millis(300),
                tasks.shutdown(),
            )
            .unwrap();
            tasks.add("publisher", task);
            for i in 0..5 {
                publisher.publish(&format!("V{i}"), Signal::Restock);
            }
            assert_eq!(tasks.stop(Duration::from_secs(60)).await, 0);
            drop(publisher);
        }
    }
}
