//! Layered settings: `config/default.toml` (compiled in) → the file named by `--config` → the
//! environment (`VOUCHERS__SECTION__KEY`).

use std::path::Path;

use figment::providers::{Env, Format, Toml};
use figment::Figment;
use serde::Deserialize;

const DEFAULT_TOML: &str = include_str!("../config/default.toml");

#[derive(Debug, Clone, Deserialize)]
pub struct Settings {
    pub http: HttpSettings,
    pub admin: AdminSettings,
    pub node: NodeSettings,
    pub ledger: LedgerSettings,
    pub engine: EngineSettings,
    pub jobs: JobSettings,
    pub redis: RedisSettings,
    pub limits: LimitSettings,
    pub metrics: MetricsSettings,
}

/// What `/metrics` shows per voucher (see `engine::spotlight`).
#[derive(Debug, Clone, Deserialize)]
pub struct MetricsSettings {
    /// The most vouchers a node shows series of its own for because of their traffic.
    pub top_vouchers: usize,
    /// Vouchers always shown (besides those watched through the admin API).
    pub watch: Vec<String>,
}

/// Rate limits (DESIGN §6); a rate of 0 turns that limit off. Each node enforces them on what it
/// receives.
#[derive(Debug, Clone, Deserialize)]
pub struct LimitSettings {
    /// Reserves per second one customer may make on one voucher, after a burst of
    /// `per_customer_burst`.
    pub per_customer_per_sec: u32,
    pub per_customer_burst: u32,
    /// Reserves per second from one client address, after a burst of `per_address_burst`.
    pub per_address_per_sec: u32,
    pub per_address_burst: u32,
    /// A header set by a trusted proxy that names the client's address (its last entry is used:
    /// the one the trusted proxy appended to `X-Forwarded-For`); empty: the connection's peer
    /// address.
    pub address_header: String,
    /// Reserves per second one voucher admits on this node (0: no limit).
    pub admission_per_sec: u32,
    /// Most keys a keyed limiter holds (see `engine::limits`).
    pub max_keys: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RedisSettings {
    /// Empty: no cluster signals (the embedded default). With `cluster`, the seed nodes of a
    /// Redis Cluster separated by spaces.
    pub url: String,
    /// `url` names a Redis Cluster: the vouchers' own signals go by sharded pub/sub (see
    /// `signals`), and the feed relay's keys share the stream's slot.
    pub cluster: bool,
    /// A subscription that hears nothing (not even this node's own keepalive ping) for this
    /// long is taken as dead and reconnected.
    pub keepalive_ms: u64,
    /// The Redis Stream the change feed is copied to (see `feed`); empty: no copy.
    pub events_stream: String,
    /// Approximate cap on the stream's length.
    pub events_stream_maxlen: u64,
    /// How often the relay copies new events.
    pub events_relay_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct HttpSettings {
    pub host: String,
    pub port: u16,
    pub workers: usize,
    pub body_limit_bytes: usize,
    pub request_timeout_ms: u64,
    /// Bearer tokens the checkout routes accept; empty: they are open (see `AppState`).
    pub checkout_tokens: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct AdminSettings {
    pub token: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct NodeSettings {
    pub id: String,
    /// How often this process beats in the ledger (and reaps holders that stopped beating).
    pub heartbeat_ms: u64,
    /// A holder whose last beat is older than this (on the ledger's clock) is dead: its leases
    /// are reaped at once, and nobody waits for it to answer a recall.
    pub dead_after_ms: i64,
    /// Testing only: shifts this process's clock, to rehearse a node whose system clock is off
    /// (on a shared ledger the heartbeat corrects it to the ledger's).
    #[serde(default)]
    pub clock_skew_ms: i64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct LedgerSettings {
    pub url: String,
    /// The ledger in shards: PostgreSQL URLs, each voucher on one (docs/DESIGN.md, "Shards").
    /// Set, it replaces `url`. From the environment, one string of URLs separated by spaces
    /// (a multi-host URL holds commas).
    #[serde(default, deserialize_with = "url_list")]
    pub shards: Vec<String>,
    /// With shards: an order id used on a voucher of one shard is refused on every other
    /// voucher (DESIGN §4), at the cost of an order claim on the directory per new order. Off,
    /// only vouchers of the same shard refuse it: for checkouts that never send one order to
    /// two vouchers, or check that themselves.
    #[serde(default = "yes")]
    pub order_ids_across_shards: bool,
    pub max_connections: u32,
    /// Merged group-commit transactions in flight at once (0: 1 on SQLite, 2 on PostgreSQL).
    pub commit_pipeline: usize,
    /// Most reservation rows the committer merges into one transaction.
    pub max_merged_rows: usize,
    /// Worker threads of the ledger's own runtime (at least 1).
    pub runtime_threads: usize,
    /// Every ledger call (a merged transaction included) not answered by then fails with `503`;
    /// on PostgreSQL also each statement's and each lock wait's limit.
    pub timeout_ms: u64,
    /// PostgreSQL: how long a call waits for a pooled connection (its health check included)
    /// before it fails with `503`. Short, so an exhausted pool or a dead link is an outage the
    /// breaker counts at once, not a call that holds a commit slot until its deadline.
    pub acquire_timeout_ms: u64,
    /// Calls in a row that found the ledger unavailable before the node's circuit breaker opens
    /// (0: never).
    pub breaker_failures: u32,
    /// How long the breaker stays open before one call goes through as a probe.
    pub breaker_open_ms: u64,
}

/// Which store a ledger URL names: decided here, once, from the URL's scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerKind {
    /// `sqlite:…`: the embedded ledger of one node.
    Sqlite,
    /// `postgres:…` or `postgresql:…`: the ledger a cluster's nodes share.
    Postgres,
}

impl LedgerKind {
    /// The store `url` names, or an error for a scheme the service has no ledger for.
    pub fn of(url: &str) -> anyhow::Result<Self> {
        if url.starts_with("sqlite:") {
            Ok(Self::Sqlite)
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            Ok(Self::Postgres)
        } else {
            anyhow::bail!("ledger url must start with sqlite: or postgres:")
        }
    }

    /// Whether several nodes may share the ledger (the embedded one belongs to one process).
    pub fn is_shared(self) -> bool {
        self == Self::Postgres
    }
}

fn yes() -> bool {
    true
}

/// A list of URLs, given as a list or as one string of URLs separated by whitespace.
fn url_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Given {
        List(Vec<String>),
        Words(String),
    }
    Ok(match Given::deserialize(d)? {
        Given::List(urls) => urls,
        Given::Words(words) => words.split_whitespace().map(String::from).collect(),
    })
}

impl LedgerSettings {
    /// The store [`LedgerSettings::url`] names (PostgreSQL for a ledger in shards, each of
    /// which must be one).
    pub fn kind(&self) -> anyhow::Result<LedgerKind> {
        if self.shards.is_empty() {
            return LedgerKind::of(&self.url);
        }
        for url in &self.shards {
            if LedgerKind::of(url)? != LedgerKind::Postgres {
                anyhow::bail!("every URL of ledger.shards must start with postgres:");
            }
        }
        if self.shards.len() > crate::ledger::sharded::MAX_SHARDS {
            anyhow::bail!("ledger.shards lists more than 256 shards");
        }
        Ok(LedgerKind::Postgres)
    }

    /// Merged transactions in flight at once, `commit_pipeline`'s 0 resolved: 1 on SQLite,
    /// whose one writer would only queue a second behind the first; 2 otherwise.
    pub fn pipeline(&self) -> usize {
        match self.commit_pipeline {
            0 if matches!(self.kind(), Ok(LedgerKind::Sqlite)) => 1,
            0 => 2,
            n => n,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct EngineSettings {
    pub shards: usize,
    /// Start voucher actors on the HTTP workers' own arbiters (the shards only before the
    /// workers run): a reserve that arrives on its actor's worker never changes thread.
    pub actors_on_http_workers: bool,
    pub mailbox_capacity: usize,
    pub max_pending: usize,
    pub max_batch: usize,
    /// Batches an actor may have in the group committer at once (at least 1).
    pub batches_in_flight: usize,
    pub reservation_ttl_ms: i64,
    pub lease_ttl_ms: i64,
    pub lease_safety_ms: i64,
    pub lease_idle_timeout_ms: i64,
    pub actor_idle_stop_ms: i64,
    pub lease_target_interval_ms: i64,
    pub min_block: i64,
    pub max_block: i64,
    /// The end-game: a grant takes at most `free / endgame_divisor` (at least one unit), so the
    /// last units spread over the nodes that still have demand; before a sale starts, a node
    /// holds at most what was free at its first grant over it.
    pub endgame_divisor: i64,
    /// Set at start-up, never read from a file: this node is its ledger's only process (the
    /// embedded SQLite ledger, whose data lock this process took). Its end-game then takes
    /// whole blocks, as there is no other node to spread the last units over; the pre-start cap
    /// still holds. (Two applications embedded in one process share the lock: both count as
    /// alone, which only leaves the last units with one of them until its lease goes back.)
    #[serde(skip)]
    pub sole_node: bool,
    pub soldout_probe_ms: i64,
    pub recall_wait_ms: i64,
    pub won_set_exact_max: usize,
    /// A request for a code this node does not know re-reads the codes from the ledger at most
    /// this often; between re-reads unknown codes get `404` from memory.
    pub known_codes_refresh_ms: u64,
    /// While reserves wait on this node, unknown codes get their `404` after this long (0: at
    /// once); see `EngineHandle::known`.
    pub unknown_code_tarpit_ms: u64,
    /// Every node warms vouchers whose sale starts within this long (0: no pre-heat).
    pub preheat_ms: i64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct JobSettings {
    pub expiry_interval_ms: u64,
    pub expiry_batch: i64,
    pub reaper_interval_ms: u64,
    pub reconcile_interval_ms: u64,
    /// How often every node reads the emergency switches from the ledger.
    pub switches_interval_ms: u64,
    /// How often every node refreshes the live per-voucher numbers (`vouchers_units`).
    pub live_numbers_interval_ms: u64,
    /// How often every node looks for vouchers to pre-heat.
    pub preheat_interval_ms: u64,
    /// Vouchers of the catalogue each reconciler run audits besides the ones changed since the
    /// last run, in code order, going round.
    pub reconcile_audit_page: i64,
}

impl Settings {
    /// Loads the layers; `file` is the optional `--config` file.
    pub fn load(file: Option<&Path>) -> Result<Self, Box<figment::Error>> {
        let mut fig = Figment::from(Toml::string(DEFAULT_TOML));
        if let Some(file) = file {
            fig = fig.merge(Toml::file_exact(file));
        }
        fig.merge(Env::prefixed("VOUCHERS__").split("__"))
            .extract()
            .map_err(Box::new)
    }

    /// The embedded defaults alone, for tests.
    #[allow(
        clippy::expect_used,
        reason = "the embedded file is part of the binary and covered by tests: it always parses"
    )]
    pub fn defaults() -> Self {
        Figment::from(Toml::string(DEFAULT_TOML))
            .extract()
            .expect("embedded config/default.toml parses")
    }
}

/// `--config FILE` from the command line, if given.
pub fn config_file_from_args(args: impl Iterator<Item = String>) -> Option<std::path::PathBuf> {
    let mut args = args.skip(1);
    while let Some(a) = args.next() {
        if a == "--config" {
            return args.next().map(Into::into);
        }
        if let Some(v) = a.strip_prefix("--config=") {
            return Some(v.into());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_defaults_parse() {
        let s = Settings::defaults();
        assert_eq!(s.http.port, 8080);
        assert!(s.ledger.url.starts_with("sqlite://"));
        assert_eq!(s.ledger.kind().unwrap(), LedgerKind::Sqlite);
        assert_eq!(s.ledger.pipeline(), 1);
    }

    #[test]
    fn the_ledger_kind_is_read_from_the_url_scheme() {
        assert_eq!(
            LedgerKind::of("sqlite::memory:").unwrap(),
            LedgerKind::Sqlite
        );
        for url in ["postgres://h/db", "postgresql://h/db"] {
            assert_eq!(LedgerKind::of(url).unwrap(), LedgerKind::Postgres, "{url}");
        }
        assert!(LedgerKind::of("mysql://h/db").is_err());
        assert!(LedgerKind::Postgres.is_shared() && !LedgerKind::Sqlite.is_shared());
    }

    #[test]
    fn shards_are_a_list_or_one_string_of_urls_from_the_environment() {
        let toml = |extra: &str| {
            Figment::from(Toml::string(DEFAULT_TOML))
                .merge(Toml::string(extra))
                .extract::<Settings>()
                .unwrap()
        };
        assert!(Settings::defaults().ledger.shards.is_empty());
        let listed = toml("[ledger]\nshards = [\"postgres://a/x\", \"postgres://b/x\"]");
        assert_eq!(listed.ledger.shards, ["postgres://a/x", "postgres://b/x"]);
        assert_eq!(listed.ledger.kind().unwrap(), LedgerKind::Postgres);
        let words = toml(
            "[ledger]\nshards = \" postgres://a:1,b:2/x?target_session_attrs=read-write  postgres://c/x \"",
        );
        assert_eq!(
            words.ledger.shards,
            [
                "postgres://a:1,b:2/x?target_session_attrs=read-write",
                "postgres://c/x"
            ]
        );
        // As the environment gives it (a prefix of this test's own).
        let multi = "postgres://u@a:1,b:2/x?target_session_attrs=read-write postgres://c/x";
        std::env::set_var("VOUCHERS_SHARDS_TEST__LEDGER__SHARDS", multi);
        let env: Settings = Figment::from(Toml::string(DEFAULT_TOML))
            .merge(Env::prefixed("VOUCHERS_SHARDS_TEST__").split("__"))
            .extract()
            .unwrap();
        assert_eq!(
            env.ledger.shards,
            multi.split(' ').map(String::from).collect::<Vec<_>>()
        );
        let sqlite = toml("[ledger]\nshards = \"sqlite://a.db postgres://c/x\"");
        assert!(sqlite.ledger.kind().is_err(), "every shard is PostgreSQL");
    }

    #[test]
    fn config_flag_is_found() {
        let args = ["bin", "--config", "x.toml"].map(String::from);
        assert_eq!(
            config_file_from_args(args.into_iter()),
            Some("x.toml".into())
        );
        let args = ["bin"].map(String::from);
        assert_eq!(config_file_from_args(args.into_iter()), None);
    }
}
