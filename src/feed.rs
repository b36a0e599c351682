//! The change feed's relay to a Redis Stream, for consumers that prefer one to polling
//! `GET /admin/events`.
//!
//! The ledger is the feed (every reservation change carries a gap-free sequence number given in
//! the transaction that made it); the stream is a copy. Entry `N-0` of the stream is event `N`
//! of the feed, so the stream's last id says where the copy stands. One node at a time relays
//! (a short-lived Redis key names it; any node takes over when it lapses); a relay appends, in one
//! script, only events above the stream's last id, so two relayers at once, a relayer that
//! restarts, or a page read twice never add an event twice or out of order; the stream's
//! `last-generated-id` (which trimming and `XDEL` leave alone) says where it stands. When Redis
//! loses the stream (it keeps nothing on disk here), the next relay starts again from event 1:
//! consumers see every event at least once, in order.
//!
//! The stream is tied to the ledger it copies (`<stream>:origin`, the ledger's random feed
//! origin): a relay of another ledger (a second deployment on the same Redis, a test run)
//! refuses to touch it, and says so, rather than take that ledger's numbers for its own. On a
//! Redis Cluster the keys beside the stream take its name as their hash tag
//! (`{<stream>}:origin`, `{<stream>}:relayer`), so that one script can touch all three.
//!
//! Not handled: a ledger restored from a backup (or a failover that lost commits) hands out
//! numbers again that the stream already holds; the relay takes them as copied. Recreate the
//! stream (`DEL` it and its `:origin` key) after such a restore.

use std::time::Duration;

use crate::domain::FeedEvent;
use crate::engine::EngineHandle;
use crate::metrics as m;
use crate::shutdown::Shutdown;
use crate::signals::{key_beside, Conn, Target};

/// Events read from the ledger and appended per round trip.
const PAGE: i64 = 500;
/// Connect and command timeout.
const TIMEOUT: Duration = Duration::from_secs(2);

/// Takes or keeps the relayer key (KEYS[1]): `1` when this node is (still) the relayer, `0`
/// when another node is, `-1` when the stream (KEYS[3]) is not this ledger's copy (KEYS[2]
/// holds the origin of the ledger it copies; ARGV: node, claim ms, this ledger's origin).
const CLAIM: &str = r"
local origin = redis.call('GET', KEYS[2])
if origin and origin ~= ARGV[3] then return -1 end
if not origin then
  -- A stream without an origin was not made by a relay of this build: not ours to take.
  if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
  redis.call('SET', KEYS[2], ARGV[3])
end
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// The stream's last id ever added (`last-generated-id`, which trimming and deleting leave
/// alone), as the event number it stands for; 0 when there is no stream. Shared by [`TOP`] and
/// [`APPEND`].
const TOP_LUA: &str = r"
local function top(key)
  if redis.call('EXISTS', key) == 0 then return 0 end
  local info = redis.call('XINFO', 'STREAM', key)
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      return tonumber(string.match(info[i + 1], '^(%d+)'))
    end
  end
  return 0
end
";

/// Appends the events above the stream's last id, in order; returns how many it appended, or
/// -1 without appending when the page does not go on from the stream's last id (the stream
/// went away or moved since the relay read where it stood).
/// ARGV: maxlen, then six fields per event: seq, type, code, orderId, customerId, at.
const APPEND: &str = r"
local top = top(KEYS[1])
local n = 0
for i = 2, #ARGV, 6 do
  local seq = tonumber(ARGV[i])
  if seq > top + 1 then return -1 end
  if seq > top then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], ARGV[i] .. '-0',
      'type', ARGV[i + 1], 'code', ARGV[i + 2], 'orderId', ARGV[i + 3],
      'customerId', ARGV[i + 4], 'at', ARGV[i + 5])
    top = seq
    n = n + 1
  end
end
return n
";

/// Where the copy stands: see [`TOP_LUA`].
const TOP: &str = "return top(KEYS[1])";

/// Where and how the relay writes.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    pub target: Target,
    pub stream: String,
    /// Approximate cap on the stream's length (`XADD MAXLEN ~`).
    pub maxlen: u64,
    pub interval: Duration,
    pub node_id: String,
}

/// The relay's keys beside `stream` (`:relayer`, `:origin`), in the stream's slot on a Redis
/// Cluster; an error for a stream name no hash tag can name there. Checked at start-up before
/// anything is written, and by [`start`].
pub fn relay_keys(stream: &str, cluster: bool) -> Result<(String, String), redis::RedisError> {
    key_beside(stream, "relayer", cluster)
        .zip(key_beside(stream, "origin", cluster))
        .ok_or_else(|| {
            redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "on a Redis Cluster a stream name holding '}' needs a hash tag of its own, \
                 e.g. {vouchers}:events",
            ))
        })
}

/// Starts the relay loop; it runs until shutdown is asked, finishing the round under way.
pub fn start(
    engine: EngineHandle,
    s: RelaySettings,
    mut shutdown: Shutdown,
) -> Result<tokio::task::JoinHandle<()>, redis::RedisError> {
    let (relayer_key, origin_key) = relay_keys(&s.stream, s.target.is_cluster())?;
    Ok(tokio::spawn(async move {
        let mut conn: Option<Conn> = None;
        // The ledger's feed origin, read once (it never changes).
        let mut origin: Option<String> = None;
        // The stream is another ledger's (said once until that changes).
        let mut foreign = false;
        let mut tick = tokio::time::interval(s.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while shutdown.unless(tick.tick()).await.is_some() {
            if conn.is_none() {
                match s.target.connect(TIMEOUT).await {
                    Ok(c) => conn = Some(c),
                    Err(e) => {
                        tracing::debug!(error = %e, "feed relay: redis unreachable");
                        continue;
                    }
                }
            }
            let Some(c) = conn.as_mut() else { continue };
            let res = relay(c, &engine, &s, (&relayer_key, &origin_key), &mut origin).await;
            if res.is_ok() {
                foreign = false;
            }
            match res {
                Ok(n) if n > 0 => m::feed_relayed(n),
                Ok(_) => {}
                Err(RelayError::Redis(e)) => {
                    m::feed_relay_error();
                    tracing::warn!(error = %e, "feed relay: redis failed");
                    conn = None;
                }
                Err(RelayError::Ledger(e)) => {
                    m::feed_relay_error();
                    tracing::warn!(error = %e, "feed relay: could not read the feed");
                }
                Err(e @ RelayError::Foreign) => {
                    m::feed_relay_error();
                    // Said once, not every round.
                    if !foreign {
                        tracing::error!(stream = %s.stream, "feed relay: {e}");
                    }
                    foreign = true;
                    continue;
                }
            }
        }
    }))
}

#[derive(Debug, thiserror::Error)]
enum RelayError {
    #[error(
        "the stream holds another ledger's feed: delete it and its `:origin` key, or set \
         redis.events_stream"
    )]
    Foreign,
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    #[error(transparent)]
    Ledger(#[from] crate::engine::EngineError),
}

/// One round: claims the relayer key, then copies the feed from the stream's last id on, a page
/// at a time, until it is level. Returns how many events it appended.
async fn relay(
    c: &mut Conn,
    engine: &EngineHandle,
    s: &RelaySettings,
    (relayer_key, origin_key): (&str, &str),
    origin: &mut Option<String>,
) -> Result<u64, RelayError> {
    let claim_ms = (s.interval.as_millis() as u64).saturating_mul(5).max(1_000);
    let origin = match origin {
        Some(o) => o.clone(),
        None => origin.insert(engine.feed_origin().await?).clone(),
    };
    let mine: i64 = redis::cmd("EVAL")
        .arg(CLAIM)
        .arg(3)
        .arg(relayer_key)
        .arg(origin_key)
        .arg(&s.stream)
        .arg(&s.node_id)
        .arg(claim_ms)
        .arg(&origin)
        .query_async(c)
        .await?;
    if mine == -1 {
        return Err(RelayError::Foreign);
    }
    if mine != 1 {
        return Ok(0);
    }
    let mut after: i64 = redis::cmd("EVAL")
        .arg(format!("{TOP_LUA}{TOP}"))
        .arg(1)
        .arg(&s.stream)
        .query_async(c)
        .await?;
    let mut appended = 0u64;
    loop {
        let mut page = engine.events(after, PAGE).await?;
        let full = page.len() as i64 == PAGE;
        // The feed has no gaps; were one ever read, the copy stops before it rather than skip
        // an event for good (the next round reads again from there).
        let contiguous = page
            .iter()
            .zip(after + 1..)
            .take_while(|(e, want)| e.seq == *want)
            .count();
        let gap = contiguous < page.len();
        if gap {
            tracing::error!(
                after,
                "feed relay: the feed skipped a number; copy stops before it"
            );
            page.truncate(contiguous);
        }
        let Some(last) = page.last() else {
            break;
        };
        after = last.seq;
        let n: i64 = append_cmd(&s.stream, s.maxlen, &page)
            .query_async(c)
            .await?;
        if n < 0 {
            // The next round reads where the stream stands again.
            tracing::info!("feed relay: the stream moved under the relay; starting over");
            break;
        }
        appended += n as u64;
        if !full || gap {
            break;
        }
    }
    Ok(appended)
}

fn append_cmd(stream: &str, maxlen: u64, events: &[FeedEvent]) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(format!("{TOP_LUA}{APPEND}"))
        .arg(1)
        .arg(stream)
        .arg(maxlen);
    for e in events {
        cmd.arg(e.seq)
            .arg(e.kind.as_str())
            .arg(&e.voucher_code)
            .arg(&e.order_id)
            .arg(e.customer_id)
            .arg(crate::clock::rfc3339(e.at));
    }
    cmd
}
