//! Where Redis is, and one command connection to it: a single server (`redis.url`) or a Redis
//! Cluster found through its seed nodes (`redis.cluster = true`, `redis.url` the seeds separated
//! by spaces). The publisher and the feed relay send their commands through [`Conn`] either way;
//! on a cluster each command goes to the primary of its key's (or channel's) slot.

use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, Pipeline, RedisFuture, RedisResult, Value};

/// A Redis deployment the node talks to.
#[derive(Clone, Debug)]
pub enum Target {
    Single(redis::Client),
    /// The seed URLs: any one that answers tells the client the cluster's slots.
    Cluster(Vec<String>),
}

impl Target {
    /// Parses `redis.url`: one URL, or with `cluster` one or more seeds separated by spaces.
    pub fn open(url: &str, cluster: bool) -> RedisResult<Self> {
        if !cluster {
            return Ok(Self::Single(redis::Client::open(url)?));
        }
        let seeds: Vec<String> = url.split_whitespace().map(str::to_string).collect();
        if seeds.is_empty() {
            return Err((
                ErrorKind::InvalidClientConfig,
                "redis.url names no seed node",
            )
                .into());
        }
        for s in &seeds {
            redis::Client::open(s.as_str())?;
        }
        Ok(Self::Cluster(seeds))
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// A connection whose connect and every command give up after `timeout`.
    pub async fn connect(&self, timeout: Duration) -> RedisResult<Conn> {
        match self {
            Self::Single(client) => {
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(timeout)
                    .set_response_timeout(timeout);
                Ok(Conn::Single(
                    client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?,
                ))
            }
            Self::Cluster(seeds) => {
                let client = cluster_builder(seeds, timeout).build()?;
                Ok(Conn::Cluster(connect_cluster(&client, timeout).await?))
            }
        }
    }
}

/// A cluster client's settings: short timeouts and one quick retry, so that a command to a
/// primary that is gone, or that a cluster refuses for now (`CLUSTERDOWN`, `TRYAGAIN`), fails
/// within about one `timeout` with the server's own error, instead of queueing behind the
/// client's default sixteen retries at 1.28 s and more each (signals are hints; the caller drops
/// or retries them itself).
pub(super) fn cluster_builder(seeds: &[String], timeout: Duration) -> ClusterClientBuilder {
    ClusterClient::builder(seeds.to_vec())
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .retries(1)
        .min_retry_wait(20)
        .max_retry_wait(100)
}

/// Connects to a cluster within `timeout` (the client's own connect walks every seed).
pub(super) async fn connect_cluster(
    client: &ClusterClient,
    timeout: Duration,
) -> RedisResult<ClusterConnection> {
    match tokio::time::timeout(timeout * 2, client.get_async_connection()).await {
        Ok(conn) => conn,
        Err(_) => Err((ErrorKind::IoError, "redis cluster connect timed out").into()),
    }
}

/// One command connection, to a single server or to a cluster.
#[derive(Clone)]
pub enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// The name of a key that must live in the same cluster slot as `key` (a Lua script may only
/// touch keys of one slot): `key` with `suffix`, the whole `key` made its hash tag unless it
/// carries one already. On a single server the names stay as they always were. `None` on a
/// cluster for a name without a tag of its own that holds a `}` (Redis would hash it whole, and
/// no tag can name it): such a stream needs a tag, e.g. `{vouchers}:events`.
pub fn key_beside(key: &str, suffix: &str, cluster: bool) -> Option<String> {
    if !cluster || has_hash_tag(key) {
        Some(format!("{key}:{suffix}"))
    } else if !key.contains('}') {
        Some(format!("{{{key}}}:{suffix}"))
    } else {
        None
    }
}

/// Whether Redis Cluster hashes `key` by a tag: its first `{` followed later by a `}` with
/// something between them.
fn has_hash_tag(key: &str) -> bool {
    key.find('{')
        .is_some_and(|open| key[open + 1..].find('}').is_some_and(|len| len > 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_beside_share_the_slot_of_theirs() {
        let beside = |key: &str, cluster| key_beside(key, "origin", cluster);
        assert_eq!(
            beside("vouchers:events", false).as_deref(),
            Some("vouchers:events:origin")
        );
        assert_eq!(
            beside("vouchers:events", true).as_deref(),
            Some("{vouchers:events}:origin")
        );
        assert_eq!(beside("{feed}:x", true).as_deref(), Some("{feed}:x:origin"));
        assert_eq!(beside("a{b", true).as_deref(), Some("{a{b}:origin"));
        // Hashed whole by Redis, and no tag can name them.
        assert_eq!(beside("a{}b", true), None);
        assert_eq!(beside("a}b{c", true), None);
        assert_eq!(beside("a{}b", false).as_deref(), Some("a{}b:origin"));
    }

    #[test]
    fn a_cluster_needs_a_seed() {
        assert!(Target::open("  ", true).is_err());
        assert!(
            Target::open("redis://127.0.0.1:1 redis://127.0.0.1:2", true)
                .is_ok_and(|t| t.is_cluster())
        );
        assert!(Target::open("redis://127.0.0.1:1 nonsense", true).is_err());
    }
}
