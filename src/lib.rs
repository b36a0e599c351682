//! Flash-sale voucher engine: never oversells, answers fast under the flood, loses nothing it
//! acknowledged. See `docs/DESIGN.md` for the invariants and the HTTP contract, and
//! `docs/ARCHITECTURE.md` for the path of a reserve through these modules.
//!
//! The map of the crate, from the outside in:
//!
//! - [`startup`]: `Application` wires everything and shuts it down in order.
//! - [`config`]: layered settings (`config/default.toml` → `--config FILE` → `VOUCHERS__…`).
//! - [`api`]: the HTTP routes; they call [`engine::EngineHandle`] and nothing else.
//! - [`engine`]: the node's registry of vouchers and the per-voucher protocol (a sans-IO core
//!   driven by an actor) that serves reserves from leases and hands their batches to the
//!   ledger's node-wide committer; [`engine::sizing`] is the pure lease-sizing logic.
//! - [`ledger`]: the transactional source of truth (SQLite embedded, PostgreSQL in a cluster)
//!   behind one trait, with the batch planner both stores share, the node-wide group
//!   committer that merges every voucher's batches into shared transactions, the node's
//!   circuit breaker ([`ledger::breaker`]) and the heartbeats that make lease holders known
//!   as live or dead. [`ledger::model`] is the same semantics in memory, for simulation; it
//!   passes the conformance suite too.
//! - [`sim`]: the deterministic simulator: the quota protocol ([`engine::quota`], sans-IO) on
//!   simulated nodes against the model ledger, with faults, invariants checked every step.
//! - [`jobs`]: heartbeat (which reaps dead holders' leases), expiry sweeper, lease reaper,
//!   reconciler.
//! - [`signals`]: Redis pub/sub hints between nodes (sold out, restock, recall, updated), on one
//!   server or sharded per voucher on a Redis Cluster.
//! - [`feed`]: the relay that copies the ledger's change feed to a Redis Stream.
//! - [`shutdown`]: the background tasks' cooperative stop, waited for.
//! - [`metrics`]: every metric name and the helpers that record them.
//! - `memory`: hands what a flood left behind back to the system once it is over; in a
//!   `heap-count` build (diagnosis), counts what Rust's allocations hold.
//! - [`domain`]: vouchers, reservations, eligibility and input rules.
//! - [`clock`]: the injected clock that lease and expiry logic read.

pub mod api;
pub mod clock;
pub mod config;
pub mod domain;
pub mod engine;
pub mod feed;
pub mod jobs;
pub mod ledger;
mod memory;
pub mod metrics;
pub mod shutdown;
pub mod signals;
pub mod sim;
pub mod startup;

/// The counting global allocator of a `heap-count` build (diagnosis).
#[cfg(feature = "heap-count")]
pub use memory::Counting;
