//! Integration tests that need PostgreSQL, Redis or the primary/standby pair are compiled as
//! ignored when the variable naming the service (`TEST_DATABASE_URL`, `TEST_REDIS_URL`,
//! `TEST_REDIS_CLUSTER_URL`, `TEST_LEDGER_PAIR_URL`) is not set at build time, so a run
//! without the services reports them as ignored instead of passed. Inside CI (`CI` set) a test
//! whose service is missing fails instead (see `tests/api/helpers.rs`, `service_url`).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(no_test_pg)");
    println!("cargo::rustc-check-cfg=cfg(no_test_redis)");
    println!("cargo::rustc-check-cfg=cfg(no_test_pair)");
    println!("cargo::rustc-check-cfg=cfg(no_test_redis_cluster)");
    println!("cargo::rerun-if-env-changed=TEST_REDIS_CLUSTER_URL");
    println!("cargo::rerun-if-env-changed=TEST_LEDGER_PAIR_URL");
    println!("cargo::rerun-if-env-changed=TEST_DATABASE_URL");
    println!("cargo::rerun-if-env-changed=TEST_REDIS_URL");
    println!("cargo::rerun-if-env-changed=CI");
    println!("cargo::rerun-if-changed=build.rs");
    // Inside CI nothing is compiled as ignored: a missing service fails its tests at run time.
    let ci = std::env::var_os("CI").is_some();
    if !ci && std::env::var_os("TEST_DATABASE_URL").is_none() {
        println!("cargo::rustc-cfg=no_test_pg");
    }
    if !ci && std::env::var_os("TEST_REDIS_URL").is_none() {
        println!("cargo::rustc-cfg=no_test_redis");
    }
    if !ci && std::env::var_os("TEST_REDIS_CLUSTER_URL").is_none() {
        println!("cargo::rustc-cfg=no_test_redis_cluster");
    }
    if !ci && std::env::var_os("TEST_LEDGER_PAIR_URL").is_none() {
        println!("cargo::rustc-cfg=no_test_pair");
    }
}
