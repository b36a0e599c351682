//! Integration tests: one binary, one module per capability. In-process apps run on a temporary
//! SQLite file and a manual clock; PostgreSQL and Redis tests read `TEST_DATABASE_URL` and
//! `TEST_REDIS_URL`, the failover test `TEST_LEDGER_PAIR_URL` (`scripts/ledger-pair.sh`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests: a panic is the failure"
)]

mod audit;
mod bad_input;
mod cluster;
mod concurrency;
mod durability;
mod engine;
mod failover;
mod feed;
mod helpers;
mod hostile;
mod ledger;
mod lifecycle;
mod live;
mod preheat;
mod proxy;
mod sharded;
mod switches;
