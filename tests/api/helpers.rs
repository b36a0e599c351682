//! Test harness: spawn an app on a fresh SQLite file with a manual clock, create vouchers, send
//! requests, read the admin view, poll with deadlines.

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vouchers::clock::ManualClock;
use vouchers::config::Settings;
use vouchers::engine::EngineHandle;
use vouchers::ledger::{self, SharedLedger};
use vouchers::startup::Application;

pub const TOKEN: &str = "test-admin-token";

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh directory under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("vouchers-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

pub fn test_settings(db_url: &str) -> Settings {
    let mut s = Settings::defaults();
    s.http.port = 0;
    s.http.workers = 1;
    s.admin.token = TOKEN.into();
    s.ledger.url = db_url.into();
    s.ledger.max_connections = 4;
    s.engine.shards = 2;
    // Background jobs stay quiet; tests run them by hand at the moment they choose.
    s.jobs.expiry_interval_ms = 3_600_000;
    s.jobs.reaper_interval_ms = 3_600_000;
    s.jobs.reconcile_interval_ms = 3_600_000;
    // The switches gauge is process-wide: other apps' periodic reads must not overwrite what a
    // test set (a test that needs the periodic read sets its own interval).
    s.jobs.switches_interval_ms = 3_600_000;
    s
}

pub struct TestApp {
    pub base: String,
    pub engine: EngineHandle,
    pub clock: ManualClock,
    /// A second connection to the same ledger, as another node or an operator would have.
    pub ledger: SharedLedger,
    /// The ledger's URL, for the independent auditor (`audit::books`).
    pub db_url: String,
    pub client: awc::Client,
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

pub async fn spawn_app_with(tweak: impl FnOnce(&mut Settings)) -> TestApp {
    let dir = temp_dir("app");
    let db_url = format!("sqlite://{}/ledger.db", dir.display());
    let mut settings = test_settings(&db_url);
    tweak(&mut settings);
    // The tweak may point the app at another ledger.
    let db_url = settings.ledger.url.clone();
    let clock = ManualClock::starting_now();
    let app = Application::build(settings, Arc::new(clock.clone()))
        .await
        .expect("build app");
    let base = format!("http://127.0.0.1:{}", app.port());
    let engine = app.engine();
    actix_rt::spawn(app.run_until_stopped());
    let ledger = ledger::connect(&db_url, 2)
        .await
        .expect("second ledger handle");
    TestApp {
        base,
        engine,
        clock,
        ledger,
        db_url,
        client: client(),
    }
}

pub fn client() -> awc::Client {
    awc::Client::builder()
        .timeout(Duration::from_secs(30))
        .connector(awc::Connector::new().limit(256))
        .finish()
}

/// A status and JSON body (Null when the body is not JSON).
pub type Answer = (u16, Value);

pub async fn send(
    client: &awc::Client,
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Answer {
    let mut req = client.request(method.parse().expect("method"), url);
    if let Some(t) = token {
        req = req.insert_header(("Authorization", format!("Bearer {t}")));
    }
    let mut res = match body {
        Some(b) => req.send_json(b).await,
        None => req.send().await,
    }
    .expect("request sent");
    let status = res.status().as_u16();
    let bytes = res.body().limit(1 << 20).await.expect("body");
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

impl TestApp {
    /// Lets at least one whole tick period of every actor pass, without a sleep: twice, a
    /// reserve on `control` (a started voucher with units) takes a lease, the clock moves
    /// `idle_ms` on, and the control's actor gives the idle lease back at one of its ticks.
    /// Every actor ticks at the same period, so two such rounds span one of each.
    pub async fn two_tick_periods(&self, control: &str, idle_ms: i64) {
        for round in 1..=2 {
            let order = format!("{control}-tick-{round}");
            assert_eq!(self.reserve(control, round, order).await.0, 201);
            let db = self.db_url.clone();
            assert!(crate::audit::books(&db, control).await.leased_unused > 0);
            self.clock.advance_ms(idle_ms);
            eventually(
                "the control's idle lease goes back",
                Duration::from_secs(10),
                || {
                    let db = db.clone();
                    async move { crate::audit::books(&db, control).await.leased_unused == 0 }
                },
            )
            .await;
        }
    }

    pub async fn create_voucher(&self, code: &str, total: i64, per_user: i64) -> Answer {
        let mut body = voucher_body(code, total, per_user);
        body["minOrderAmount"] = json!(1000);
        self.create_voucher_with(body).await
    }

    /// The operator's warm-up of `code` (`POST /admin/vouchers/{code}/warm`); its status.
    pub async fn warm(&self, code: &str) -> u16 {
        warm(&self.client, &self.base, code).await
    }

    pub async fn create_voucher_with(&self, body: Value) -> Answer {
        create_voucher(&self.client, &self.base, &body).await
    }

    pub async fn reserve(&self, code: &str, customer: i64, order: impl AsRef<str>) -> Answer {
        reserve(&self.client, &self.base, code, customer, order.as_ref()).await
    }

    pub async fn admin(&self, code: &str) -> Answer {
        let url = format!("{}/admin/vouchers/{code}", self.base);
        send(&self.client, "GET", &url, Some(TOKEN), None).await
    }

    /// The admin view, asserting it exists and balances, both by the engine's own verdict and
    /// by the independent auditor's reading of the rows, and that the two agree on every term.
    pub async fn balanced_counters(&self, code: &str) -> Value {
        let (status, body) = self.admin(code).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            body["balanced"],
            json!(true),
            "ledger does not balance: {body}"
        );
        let books = crate::audit::books(&self.db_url, code).await;
        books.assert_balanced(code);
        // Read at another moment than the view: a grant or return in between moves units
        // between `free` and leases, never their sum.
        let sum = |a: Option<i64>, b: Option<i64>| Some(a? + b?);
        assert_eq!(
            (
                sum(body["free"].as_i64(), body["leasedUnused"].as_i64()),
                body["reserved"].as_i64(),
                body["confirmed"].as_i64(),
                body["released"].as_i64()
            ),
            (
                Some(books.free + books.leased_unused),
                Some(books.reserved),
                Some(books.confirmed),
                Some(books.released)
            ),
            "the engine's counters differ from the rows: {body} vs {books:?}"
        );
        body
    }

    pub async fn call(&self, method: &str, path: &str) -> Answer {
        send(
            &self.client,
            method,
            &format!("{}{path}", self.base),
            None,
            None,
        )
        .await
    }
}

pub async fn reserve(
    client: &awc::Client,
    base: &str,
    code: &str,
    customer: i64,
    order: &str,
) -> Answer {
    let url = format!("{base}/vouchers/{code}/reservations");
    let body = json!({ "customerId": customer, "orderId": order, "orderAmount": 5000 });
    send(client, "POST", &url, None, Some(&body)).await
}

/// A voucher on sale from 2020 to 2099: discount 100, no minimum order.
pub fn voucher_body(code: &str, total: i64, per_user: i64) -> Value {
    json!({
        "code": code, "discountAmount": 100, "totalLimit": total, "perUserLimit": per_user,
        "startsAt": "2020-01-01T00:00:00Z", "endsAt": "2099-01-01T00:00:00Z"
    })
}

/// The operator's warm-up of `code` on the node at `base`; its status (204).
pub async fn warm(client: &awc::Client, base: &str, code: &str) -> u16 {
    let url = format!("{base}/admin/vouchers/{code}/warm");
    send(client, "POST", &url, Some(TOKEN), None).await.0
}

/// An answer's status, error code and reason.
pub fn error(a: &Answer) -> (u16, Option<&str>, Option<&str>) {
    (a.0, a.1["error"].as_str(), a.1["reason"].as_str())
}

/// How many batches the node at `base` had fenced (`vouchers_lease_events_total{event="fenced"}`).
pub async fn fenced(client: &awc::Client, base: &str) -> f64 {
    metric_sum(
        &metrics_text(client, base).await,
        "vouchers_lease_events_total",
        &["event=\"fenced\""],
    )
}

/// `POST /admin/vouchers` with the test token.
pub async fn create_voucher(client: &awc::Client, base: &str, body: &Value) -> Answer {
    send(
        client,
        "POST",
        &format!("{base}/admin/vouchers"),
        Some(TOKEN),
        Some(body),
    )
    .await
}

/// Creates voucher `code` on the first of `bases` (asserting `201`) and waits until every node
/// knows it: by the UPDATED signal, or by its next read of the codes
/// (`engine.known_codes_refresh_ms`); until then a node answers 404 from memory.
pub async fn create_on_every_node(
    client: &awc::Client,
    bases: &[String],
    code: &str,
    total: i64,
    per_user: i64,
) {
    let body = voucher_body(code, total, per_user);
    let (s, b) = create_voucher(client, &bases[0], &body).await;
    assert_eq!(s, 201, "{b}");
    for base in bases {
        let url = format!("{base}/vouchers/{code}");
        eventually(
            "every node knows the new code",
            Duration::from_secs(10),
            || {
                let url = url.clone();
                async move { send(client, "GET", &url, None, None).await.0 == 200 }
            },
        )
        .await;
    }
}

/// The Prometheus text a node exports.
pub async fn metrics_text(client: &awc::Client, base: &str) -> String {
    let mut res = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("scrape");
    let bytes = res.body().limit(1 << 22).await.expect("metrics body");
    String::from_utf8(bytes.to_vec()).expect("metrics are text")
}

/// The sum of the samples of metric `name` (Prometheus text) whose labels contain every one of
/// `labels`.
pub fn metric_sum(metrics: &str, name: &str, labels: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls `check` until it returns true, failing after `deadline`.
pub async fn eventually<F, Fut>(what: &str, deadline: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until exactly one PostgreSQL backend is blocked by the lock of backend `holder` (a
/// test's own transaction): the call under test is provably waiting on that lock.
pub async fn blocked_by(pool: &sqlx::PgPool, holder: i32, what: &str) {
    eventually(what, Duration::from_secs(10), || {
        let pool = pool.clone();
        async move {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(holder)
            .fetch_one(&pool)
            .await
            .unwrap();
            waiting == 1
        }
    })
    .await;
}

/// Runs one statement on the ledger at `db_url` (SQLite or PostgreSQL, on a pool of its own
/// kind) behind the engine's back; the rows it changed.
pub async fn execute(db_url: &str, sql: &str) -> u64 {
    try_execute(db_url, sql)
        .await
        .unwrap_or_else(|e| panic!("`{sql}`: {e}"))
}

/// [`execute`], with the database's refusal as an error.
pub async fn try_execute(db_url: &str, sql: &str) -> Result<u64, sqlx::Error> {
    macro_rules! on {
        ($pool:ty) => {{
            let pool = <$pool>::connect(db_url).await.expect("connect the ledger");
            let n = sqlx::query(sql).execute(&pool).await;
            pool.close().await;
            n.map(|done| done.rows_affected())
        }};
    }
    if matches!(
        vouchers::config::LedgerKind::of(db_url),
        Ok(vouchers::config::LedgerKind::Sqlite)
    ) {
        on!(sqlx::SqlitePool)
    } else {
        on!(sqlx::PgPool)
    }
}

/// The customer an order id of the form `…-o{customer}` was sent for.
pub fn customer_of(order: &str) -> i64 {
    order
        .rsplit("-o")
        .next()
        .and_then(|i| i.parse().ok())
        .unwrap_or_else(|| panic!("no customer in order id {order}"))
}

/// One number read from the ledger at `db_url` (SQLite or PostgreSQL) with `sql`.
pub async fn scalar(db_url: &str, sql: &str) -> i64 {
    macro_rules! on {
        ($pool:ty) => {{
            let pool = <$pool>::connect(db_url).await.expect("connect the ledger");
            let n: i64 = sqlx::query_scalar(sql)
                .fetch_one(&pool)
                .await
                .unwrap_or_else(|e| panic!("`{sql}`: {e}"));
            pool.close().await;
            n
        }};
    }
    if matches!(
        vouchers::config::LedgerKind::of(db_url),
        Ok(vouchers::config::LedgerKind::Sqlite)
    ) {
        on!(sqlx::SqlitePool)
    } else {
        on!(sqlx::PgPool)
    }
}

/// Counts answers by (status, error code).
pub fn tally(answers: &[Answer]) -> std::collections::BTreeMap<String, usize> {
    let mut t = std::collections::BTreeMap::new();
    for (status, body) in answers {
        let key = match body.get("error").and_then(Value::as_str) {
            Some(code) => format!("{status} {code}"),
            None => status.to_string(),
        };
        *t.entry(key).or_insert(0) += 1;
    }
    t
}

/// A real process of the built binary, for crash and multi-node tests.
pub struct Node {
    child: std::process::Child,
    pub base: String,
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    l.local_addr().expect("local addr").port()
}

impl Node {
    /// Starts the binary with the ledger at `db_url` and extra `VOUCHERS__…` settings, and waits
    /// until it is ready.
    pub async fn start(db_url: &str, env: &[(&str, &str)]) -> Node {
        Self::start_with_args(db_url, env, &[]).await
    }

    /// The command that runs the binary on `port` with the ledger at `db_url` and extra
    /// `VOUCHERS__…` settings (for a test that watches a start fail, as well as for `start`).
    pub fn command(db_url: &str, port: u16, env: &[(&str, &str)]) -> std::process::Command {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_vouchers"));
        cmd.env("VOUCHERS__HTTP__PORT", port.to_string())
            .env("VOUCHERS__HTTP__WORKERS", "1")
            .env("VOUCHERS__LEDGER__URL", db_url)
            .env("VOUCHERS__ADMIN__TOKEN", TOKEN)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd
    }

    pub async fn start_with_args(db_url: &str, env: &[(&str, &str)], args: &[&str]) -> Node {
        let port = free_port();
        let mut cmd = Self::command(db_url, port, env);
        cmd.args(args);
        let child = cmd.spawn().expect("start the vouchers binary");
        let node = Node {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let c = client();
        let url = format!("{}/health/ready", node.base);
        eventually("node ready", Duration::from_secs(30), || {
            let req = c.get(url.clone()).send();
            async move { matches!(req.await, Ok(r) if r.status().as_u16() == 200) }
        })
        .await;
        node
    }

    /// SIGKILL: no graceful shutdown, no lease returns.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit on its own.
    pub fn wait(&mut self) -> std::process::ExitStatus {
        self.child.wait().expect("wait for the node")
    }

    /// SIGTERM, then waits for the graceful stop; asserts a clean exit.
    pub fn stop(&mut self) {
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        let status = self.wait();
        assert!(status.success(), "clean exit: {status:?}");
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A reserve that may fail in transit (the node died): `None` then.
pub async fn try_reserve(
    client: &awc::Client,
    base: &str,
    code: &str,
    customer: i64,
    order: &str,
) -> Option<Answer> {
    let url = format!("{base}/vouchers/{code}/reservations");
    let body = json!({ "customerId": customer, "orderId": order, "orderAmount": 5000 });
    let mut res = client.post(url).send_json(&body).await.ok()?;
    let bytes = res.body().limit(1 << 20).await.ok()?;
    Some((
        res.status().as_u16(),
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    ))
}

/// The URL of a service a test needs, from the environment variable `var`. Inside CI (`CI` set)
/// a missing one fails the test: a service CI should have must never be silently skipped.
/// Elsewhere the test is compiled as ignored when the variable was missing at build time
/// (`build.rs`); if it goes missing only at run time, the test says so and returns.
pub fn service_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var_os("CI").is_some() => {
            panic!("{var} is not set, but CI is: this test needs the service it names")
        }
        _ => {
            eprintln!("skipped: {var} is not set (.ci/run sets it)");
            None
        }
    }
}

/// Deletes a change-feed stream a test made and the relay's keys beside it.
pub async fn delete_stream(conn: &mut redis::aio::MultiplexedConnection, stream: &str) {
    let _: () = redis::cmd("DEL")
        .arg(stream)
        .arg(format!("{stream}:origin"))
        .arg(format!("{stream}:relayer"))
        .query_async(conn)
        .await
        .expect("delete the test stream");
}

/// How many entries a stream holds (0 when it does not exist).
pub async fn stream_len(conn: &mut impl redis::aio::ConnectionLike, stream: &str) -> usize {
    redis::cmd("XLEN")
        .arg(stream)
        .query_async(conn)
        .await
        .expect("XLEN")
}
