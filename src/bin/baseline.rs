//! `baseline`: the yardsticks `scripts/bench.sh` measures the engine against, on the same
//! machine and in the same run. Not part of the service.
//!
//! ```text
//! baseline ceiling PORT             actix-web alone: parse the reserve body, answer 201 JSON
//! baseline postgres PORT URL        the one-row-per-request SQL solution: per request, one
//!                                   transaction with a conditional UPDATE of the stock and an
//!                                   INSERT of the reservation
//! baseline redis PORT URL           the Redis Lua gateway: per request, one EVALSHA of a reserve
//!                                   script (order replay, per-customer limit, stock)
//! ```
//!
//! Every mode serves `POST /vouchers/{code}/reservations` with the engine's body and answers
//! `201`, `409` or `503`; stock per voucher code is created on first use with
//! `BASELINE_STOCK` units (default: effectively unlimited).

#![allow(
    clippy::print_stdout,
    reason = "a command-line tool: its output is its answer"
)]

use std::sync::Arc;

use actix_web::{web, App, HttpResponse, HttpServer};
use anyhow::Context;
use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use tokio::sync::OnceCell;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReserveBody {
    customer_id: i64,
    order_id: String,
    order_amount: i64,
}

/// The reserve script of the usual Redis gateway: replay, then limit, then stock.
const RESERVE_LUA: &str = r#"
local order = KEYS[1] .. ':order:' .. ARGV[1]
local prev = redis.call('GET', order)
if prev then
  if prev == ARGV[2] then return 1 else return -2 end
end
local stock_key = KEYS[1] .. ':stock'
if redis.call('EXISTS', stock_key) == 0 then redis.call('SET', stock_key, ARGV[3]) end
local used = KEYS[1] .. ':used:' .. ARGV[2]
if tonumber(redis.call('GET', used) or '0') >= 1 then return -2 end
if tonumber(redis.call('GET', stock_key)) <= 0 then return -1 end
redis.call('DECR', stock_key)
redis.call('INCR', used)
redis.call('SET', order, ARGV[2])
return 1
"#;

enum Mode {
    Ceiling,
    Postgres(Box<PgConnectOptions>),
    Redis(redis::Client),
}

/// Per-worker state: each actix worker has its own runtime, so each opens its own connections.
struct Worker {
    mode: Arc<Mode>,
    stock: i64,
    pg: OnceCell<PgPool>,
    redis: OnceCell<(redis::aio::MultiplexedConnection, String)>,
}

fn created(order_id: &str) -> HttpResponse {
    HttpResponse::Created().json(serde_json::json!({
        "orderId": order_id, "discountAmount": 100, "expiresAt": "2026-01-01T00:15:00Z"
    }))
}

fn refused(code: &'static str) -> HttpResponse {
    HttpResponse::Conflict().json(serde_json::json!({ "error": code }))
}

fn unavailable() -> HttpResponse {
    HttpResponse::ServiceUnavailable().json(serde_json::json!({ "error": "UNAVAILABLE" }))
}

async fn reserve(
    w: web::Data<Worker>,
    code: web::Path<String>,
    body: web::Json<ReserveBody>,
) -> HttpResponse {
    let body = body.into_inner();
    if body.customer_id <= 0 || body.order_amount < 0 || body.order_id.is_empty() {
        return HttpResponse::BadRequest().json(serde_json::json!({"error": "INVALID_REQUEST"}));
    }
    match &*w.mode {
        Mode::Ceiling => created(&body.order_id),
        Mode::Postgres(opts) => {
            let pool =
                w.pg.get_or_init(|| async {
                    PgPoolOptions::new()
                        .max_connections(8)
                        .connect_lazy_with((**opts).clone())
                })
                .await;
            match reserve_sql(pool, &code, &body, w.stock).await {
                Ok(true) => created(&body.order_id),
                Ok(false) => refused("OUT_OF_STOCK"),
                Err(_) => unavailable(),
            }
        }
        Mode::Redis(client) => {
            let conn = w
                .redis
                .get_or_try_init(|| async {
                    let mut conn = client.get_multiplexed_async_connection().await?;
                    let sha: String = redis::cmd("SCRIPT")
                        .arg("LOAD")
                        .arg(RESERVE_LUA)
                        .query_async(&mut conn)
                        .await?;
                    Ok::<_, redis::RedisError>((conn, sha))
                })
                .await;
            let Ok((conn, sha)) = conn else {
                return unavailable();
            };
            let res: Result<i64, _> = redis::cmd("EVALSHA")
                .arg(sha)
                .arg(1)
                .arg(format!("baseline:{{{code}}}"))
                .arg(&body.order_id)
                .arg(body.customer_id)
                .arg(w.stock)
                .query_async(&mut conn.clone())
                .await;
            match res {
                Ok(1) => created(&body.order_id),
                Ok(-2) => refused("ALREADY_USED"),
                Ok(_) => refused("OUT_OF_STOCK"),
                Err(_) => unavailable(),
            }
        }
    }
}

/// One transaction: take a unit if one is left, store the reservation (a retry of a stored
/// order takes nothing).
async fn reserve_sql(
    pool: &PgPool,
    code: &str,
    body: &ReserveBody,
    stock: i64,
) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let inserted = sqlx::query(
        "INSERT INTO baseline_reservations (order_id, code, customer_id) VALUES ($1, $2, $3) \
         ON CONFLICT (order_id) DO NOTHING",
    )
    .bind(&body.order_id)
    .bind(code)
    .bind(body.customer_id)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if inserted == 0 {
        return Ok(true);
    }
    sqlx::query(
        "INSERT INTO baseline_stock (code, remaining) VALUES ($1, $2) ON CONFLICT (code) DO NOTHING",
    )
    .bind(code)
    .bind(stock)
    .execute(&mut *tx)
    .await?;
    let took = sqlx::query(
        "UPDATE baseline_stock SET remaining = remaining - 1 WHERE code = $1 AND remaining > 0",
    )
    .bind(code)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if took == 0 {
        tx.rollback().await?;
        return Ok(false);
    }
    tx.commit().await?;
    Ok(true)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: baseline ceiling|postgres|redis PORT [URL]";
    let port: u16 = args.get(1).context(usage)?.parse().context("port")?;
    let mode = match (args.first().map(String::as_str), args.get(2)) {
        (Some("ceiling"), _) => Mode::Ceiling,
        (Some("postgres"), Some(url)) => {
            Mode::Postgres(Box::new(url.parse().context("postgres url")?))
        }
        (Some("redis"), Some(url)) => Mode::Redis(redis::Client::open(url.as_str())?),
        _ => anyhow::bail!(usage),
    };
    let stock: i64 = std::env::var("BASELINE_STOCK")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(i64::MAX / 2);
    actix_rt::System::new().block_on(async move {
        if let Mode::Postgres(opts) = &mode {
            let pool = PgPoolOptions::new().connect_with((**opts).clone()).await?;
            sqlx::raw_sql(
                "CREATE TABLE IF NOT EXISTS baseline_stock (code TEXT PRIMARY KEY, \
                   remaining BIGINT NOT NULL CHECK (remaining >= 0)); \
                 CREATE TABLE IF NOT EXISTS baseline_reservations (order_id TEXT PRIMARY KEY, \
                   code TEXT NOT NULL, customer_id BIGINT NOT NULL)",
            )
            .execute(&pool)
            .await?;
        }
        let mode = Arc::new(mode);
        HttpServer::new(move || {
            let worker = Worker {
                mode: mode.clone(),
                stock,
                pg: OnceCell::new(),
                redis: OnceCell::new(),
            };
            App::new()
                .app_data(web::Data::new(worker))
                .route("/vouchers/{code}/reservations", web::post().to(reserve))
        })
        .backlog(4096)
        .bind(("127.0.0.1", port))?
        .run()
        .await?;
        Ok(())
    })
}
