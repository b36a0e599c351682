//! What a sharded ledger ([`crate::ledger::sharded`]) keeps in PostgreSQL beside each shard's
//! own ledger: every shard's name for itself, and on the first shard (the directory) which
//! shard holds each voucher and the change feed merged across shards (migration 12).

use std::future::Future;

use super::open::{xact_lock, Pending};
use super::PostgresLedger;
use crate::domain::FeedEvent;
use crate::ledger::rows::{event_from, EventRow};
use crate::ledger::LedgerError;

/// The lock commits without claims take shared and [`PostgresLedger::begin_claims`] takes
/// alone (the constant in `vouchers_commit_batches_v2`'s fence, migrations 2 and 13).
const UNCLAIMED_LOCK: i64 = 0x7670_68fe_5e91_2265;
/// An arbitrary constant that names the merge of the shards' feeds: one merge at a time.
const FEED_MERGE_LOCK: i64 = 0x766f_7563_6865_7266;

/// Why a list of shards is refused: a database at another place than it was first given.
pub(crate) const MISPLACED: &str = "ledger.shards lists a database at another place than it \
                                    was given first, or one of another cluster";
/// Why a later shard is refused: it brings vouchers no directory places.
pub(crate) const NOT_EMPTY: &str =
    "a shard after the first must start empty: this database holds vouchers";
/// Orders of a shard's reservations copied into the claims per statement.
const FILL_PAGE: i64 = 10_000;

/// How the directory keeps the order rule as a node opens it (migration 13).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClaimStart {
    /// No claims: each shard keeps the rule for its own vouchers.
    Off,
    /// Every stored order is claimed.
    On,
    /// Claims have begun: every shard is to be fenced against commits without claims and its
    /// orders copied into the claims before this node serves.
    Fill,
}

const PLACED_SQL: &str = "SELECT code, shard FROM voucher_shards WHERE code = ANY($1)";
/// A shard's recent placements (`migrations/postgres/placement.sql`) decayed to now on the
/// directory's own clock (so no node's clock skews them): halving every 10 minutes, stopped at
/// 60 halvings (10 hours), where PostgreSQL's `power` would underflow, which it refuses rather
/// than round to 0.
macro_rules! recent_now {
    () => {
        concat!(
            "recent * power(0.5::float8, least(greatest(",
            ledger_now!(),
            " - recent_at, 0), 36000000)::float8 / 600000.0)"
        )
    };
}
/// The shard with the fewest recent placements in steps of eight (rounded: eight placements a
/// few milliseconds apart have decayed to a hair under eight), then the fewest vouchers, that
/// no other create holds now (`SKIP LOCKED`: under concurrent creates the rows' order is not
/// checked again after a wait). Shards in `$2` (down now) are passed over.
const ROOM_SQL: &str = concat!(
    "SELECT shard FROM shard_room WHERE shard < $1 AND shard <> ALL($2) ORDER BY floor((",
    recent_now!(),
    " + 0.5) / 8), vouchers, shard LIMIT 1 FOR UPDATE SKIP LOCKED"
);
/// Every shard is held by another create: one at random, waiting for it. More creates at once
/// than shards are a burst, and waiting on the first row in order would queue all of them on
/// one shard (the order is not checked again after the wait).
const ANY_ROOM_SQL: &str = "SELECT shard FROM shard_room WHERE shard < $1 AND shard <> ALL($2) \
                            ORDER BY random() LIMIT 1 FOR UPDATE";
/// One more voucher on shard `$1`: its recent placements decayed to now, plus one.
const PLACED_ONE_SQL: &str = concat!(
    "UPDATE shard_room SET vouchers = vouchers + 1, recent = ",
    recent_now!(),
    " + 1, recent_at = ",
    ledger_now!(),
    " WHERE shard = $1"
);
const PLACE_SQL: &str = "INSERT INTO voucher_shards (code, shard, placed_at) \
                         VALUES ($1, $2, $3) ON CONFLICT (code) DO NOTHING";
const MERGED_SQL: &str = "SELECT seq, kind, voucher_code, order_id, customer_id, at \
                          FROM feed_merged WHERE seq > $1 ORDER BY seq LIMIT $2";
const COPY_SQL: &str = "INSERT INTO feed_merged \
                        (seq, shard, kind, voucher_code, order_id, customer_id, at) \
                        SELECT n + $1, $2, k, c, o, u, a \
                        FROM UNNEST($3::TEXT[], $4::TEXT[], $5::TEXT[], $6::BIGINT[], $7::BIGINT[]) \
                        WITH ORDINALITY AS e(k, c, o, u, a, n)";

impl PostgresLedger {
    /// What this database says of its place: the shard it is and of which directory, if it
    /// was given one; and whether it holds vouchers. Read before any database is written, so
    /// that a list in the wrong order marks none of them.
    pub(crate) async fn shard_place(&self) -> Result<(Option<(i32, String)>, bool), LedgerError> {
        let place: Option<(i32, String)> =
            sqlx::query_as("SELECT shard, directory FROM shard_self WHERE id = 1")
                .fetch_optional(&self.server_pool())
                .await?;
        let holds: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM vouchers)")
            .fetch_one(&self.server_pool())
            .await?;
        Ok((place, holds))
    }

    /// Records that this database is shard `shard` of the cluster whose directory is
    /// `directory` (the first shard's feed origin), or checks that it already was.
    pub(crate) async fn claim_shard(&self, shard: i32, directory: &str) -> Result<(), LedgerError> {
        let (was, of): (i32, String) = sqlx::query_as(
            "INSERT INTO shard_self (id, shard, directory) VALUES (1, $1, $2) \
             ON CONFLICT (id) DO UPDATE SET id = 1 RETURNING shard, directory",
        )
        .bind(shard)
        .bind(directory)
        .fetch_one(&self.server_pool())
        .await?;
        if (was, of.as_str()) != (shard, directory) {
            return Err(LedgerError::Invalid(MISPLACED));
        }
        Ok(())
    }

    /// Whether this database is a shard of a sharded ledger: a node must then not use it as a
    /// ledger of its own (its orders would not be claimed).
    pub(crate) async fn is_shard(&self) -> Result<bool, LedgerError> {
        Ok(
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM shard_self)")
                .fetch_one(&self.pool())
                .await?,
        )
    }

    /// Makes this database the directory of `shards` shards: every voucher already here (a
    /// single ledger that becomes the first shard) is placed on it, and no voucher is placed on
    /// a shard the list no longer has. Records how the order rule is kept: with claims where
    /// `claim_orders` asks for them and there are several shards, or the directory already
    /// claims (a node that would not claim is then refused).
    pub(crate) async fn open_directory(
        &self,
        shards: i32,
        claim_orders: bool,
        every_shard_up: bool,
    ) -> Result<ClaimStart, LedgerError> {
        let mut tx = self.pool().begin().await?;
        xact_lock(&mut tx, FEED_MERGE_LOCK).await?;
        let first: bool = sqlx::query_scalar("SELECT NOT EXISTS (SELECT 1 FROM shard_room)")
            .fetch_one(&mut *tx)
            .await?;
        let mut placed: i64 = 0;
        if first {
            // A single ledger that becomes the first shard: its vouchers stay on it.
            placed = sqlx::query_scalar(
                "WITH p AS (INSERT INTO voucher_shards (code, shard, placed_at) \
                 SELECT code, 0, created_at FROM vouchers ON CONFLICT (code) DO NOTHING \
                 RETURNING 1) SELECT count(*) FROM p",
            )
            .fetch_one(&mut *tx)
            .await?;
        }
        sqlx::query(
            "INSERT INTO shard_room (shard) SELECT generate_series(0, $1 - 1) \
             ON CONFLICT (shard) DO NOTHING",
        )
        .bind(shards)
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE shard_room SET vouchers = vouchers + $1 WHERE shard = 0")
            .bind(placed)
            .execute(&mut *tx)
            .await?;
        let highest: Option<i32> =
            sqlx::query_scalar("SELECT max(shard) FROM shard_room WHERE vouchers > 0")
                .fetch_one(&mut *tx)
                .await?;
        if highest.is_some_and(|h| h >= shards) {
            return Err(LedgerError::Invalid(
                "the directory places vouchers on a shard ledger.shards does not list",
            ));
        }
        let was: Option<String> = sqlx::query_scalar("SELECT mode FROM order_claim_mode")
            .fetch_optional(&mut *tx)
            .await?;
        let claiming = matches!(was.as_deref(), Some("filling" | "on"));
        let known: i64 = sqlx::query_scalar("SELECT count(*) FROM shard_room")
            .fetch_one(&mut *tx)
            .await?;
        if claiming && !claim_orders {
            return Err(LedgerError::Invalid(
                "the directory claims order ids across shards: \
                 ledger.order_ids_across_shards must stay true",
            ));
        }
        let start = if claim_orders && (shards > 1 || claiming) {
            if was.as_deref() == Some("on") {
                ClaimStart::On
            } else if known > i64::from(shards) {
                // Every shard must be fenced and copied: one not listed could be storing
                // orders without claims.
                return Err(LedgerError::Invalid(
                    "order claims begin only with every shard the directory knows listed",
                ));
            } else if !every_shard_up {
                // Nor can one that is down be: the mode stays as it was.
                return Err(LedgerError::Invalid(
                    "order claims begin only with every shard up: a shard is down",
                ));
            } else {
                ClaimStart::Fill
            }
        } else {
            ClaimStart::Off
        };
        let mode = match start {
            ClaimStart::Off => "off",
            ClaimStart::On => "on",
            ClaimStart::Fill => "filling",
        };
        sqlx::query(
            "INSERT INTO order_claim_mode (id, mode) VALUES (1, $1) \
             ON CONFLICT (id) DO UPDATE SET mode = EXCLUDED.mode",
        )
        .bind(mode)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(start)
    }

    /// The directory's claim mode (`off`, `filling`, `on`; none before a sharded node opened
    /// it).
    /// On the heartbeat's own connection, within a quarter second: it runs beside a beat.
    pub(crate) async fn claim_mode(&self) -> Result<Option<String>, LedgerError> {
        let beats = self.beats();
        let read = sqlx::query_scalar("SELECT mode FROM order_claim_mode").fetch_optional(&beats);
        match tokio::time::timeout(std::time::Duration::from_millis(250), read).await {
            Ok(mode) => Ok(mode?),
            Err(_) => Err(LedgerError::Deadline),
        }
    }

    /// Fences this shard against commits without claims (migration 13): waits for those in
    /// flight (the lock they hold shared), and refuses every later one.
    pub(crate) fn begin_claims(&self) -> Pending<'_, ()> {
        Box::pin(async move {
            let mut tx = self.server_pool().begin().await?;
            // Commits in flight may hold the lock shared past the ledger's deadline (a synchronous
            // standby's wait): at start, this waits for them.
            sqlx::query("SET LOCAL lock_timeout = '60s'")
                .execute(&mut *tx)
                .await?;
            sqlx::query("SET LOCAL statement_timeout = '60s'")
                .execute(&mut *tx)
                .await?;
            xact_lock(&mut tx, UNCLAIMED_LOCK).await?;
            sqlx::query("INSERT INTO claims_begun (id) VALUES (1) ON CONFLICT (id) DO NOTHING")
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(())
        })
    }

    /// Claims, for good, the order of every reservation `shard` stored (without a claim, or
    /// with one) for its voucher, a page at a time: a count that no call gives back, so a claim
    /// joined by a call in flight stays when that call is refused. Copying again only adds
    /// counts. Returns the orders another voucher had claimed already: stored twice while no
    /// claims were made (only with `order_ids_across_shards` off), which the copy cannot undo;
    /// that claim gets a count for good too.
    pub(crate) async fn fill_claims(
        &self,
        shard: &PostgresLedger,
    ) -> Result<Vec<String>, LedgerError> {
        let mut after = String::new();
        let mut clashes = Vec::new();
        loop {
            let page: Vec<(String, String)> = sqlx::query_as(
                "SELECT order_id, voucher_code FROM reservations WHERE order_id > $1 \
                 ORDER BY order_id LIMIT $2",
            )
            .bind(&after)
            .bind(FILL_PAGE)
            .fetch_all(&shard.pool())
            .await?;
            let Some((last, _)) = page.last() else {
                return Ok(clashes);
            };
            after = last.clone();
            let mut pairs: Vec<(&str, &str)> =
                page.iter().map(|(o, c)| (o.as_str(), c.as_str())).collect();
            // Locked in the claims' own order, as every claim takes them.
            pairs.sort_unstable();
            let (orders, codes): (Vec<&str>, Vec<&str>) = pairs.into_iter().unzip();
            // The main query reads the claims as they were before the insert: those of another
            // voucher are the clashes.
            let other: Vec<String> = sqlx::query_scalar(
                "WITH x AS (SELECT * FROM UNNEST($1::TEXT[], $2::TEXT[]) AS x(o, c)), \
                 ins AS (INSERT INTO order_claims (order_id, code, pending) \
                 SELECT o, c, 1 FROM x ON CONFLICT (order_id) DO UPDATE \
                 SET pending = order_claims.pending + 1) \
                 SELECT x.o FROM x JOIN order_claims k ON k.order_id = x.o \
                 WHERE k.code <> x.c",
            )
            .bind(&orders)
            .bind(&codes)
            .fetch_all(&self.pool())
            .await?;
            clashes.extend(other);
        }
    }

    /// Every shard's orders are claimed: the mode becomes `on` (unless another node did it).
    pub(crate) async fn claims_filled(&self) -> Result<(), LedgerError> {
        // Under the lock the mode is read with at open: a node opening now cannot set it back.
        let mut tx = self.pool().begin().await?;
        xact_lock(&mut tx, FEED_MERGE_LOCK).await?;
        sqlx::query("UPDATE order_claim_mode SET mode = 'on' WHERE mode = 'filling'")
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The shards of those of `codes` the directory places.
    pub(crate) async fn placed(&self, codes: &[String]) -> Result<Vec<(String, i32)>, LedgerError> {
        Ok(sqlx::query_as(PLACED_SQL)
            .bind(codes)
            .fetch_all(&self.pool())
            .await?)
    }

    /// The shard of `code`: where the directory placed it, or else the one of the first
    /// `shards` with the fewest recent placements, then the fewest vouchers (`ROOM_SQL`),
    /// recorded now, passing over those in `down` (unless every shard is).
    pub(crate) async fn place(
        &self,
        code: &str,
        shards: i32,
        now: i64,
        down: &[i32],
    ) -> Result<i32, LedgerError> {
        let down: &[i32] = if down.len() >= shards as usize {
            &[]
        } else {
            down
        };
        let codes = [code.to_string()];
        if let Some((_, s)) = self.placed(&codes).await?.pop() {
            return Ok(s);
        }
        let mut tx = self.pool().begin().await?;
        let free: Option<i32> = sqlx::query_scalar(ROOM_SQL)
            .bind(shards)
            .bind(down)
            .fetch_optional(&mut *tx)
            .await?;
        let shard: i32 = match free {
            Some(s) => s,
            None => {
                sqlx::query_scalar(ANY_ROOM_SQL)
                    .bind(shards)
                    .bind(down)
                    .fetch_one(&mut *tx)
                    .await?
            }
        };
        let done = sqlx::query(PLACE_SQL)
            .bind(code)
            .bind(shard)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 0 {
            // Placed at the same time by another create: its shard.
            drop(tx);
            return match self.placed(&codes).await?.pop() {
                Some((_, s)) => Ok(s),
                None => Err(LedgerError::Inconsistent("a placement vanished")),
            };
        }
        sqlx::query(PLACED_ONE_SQL)
            .bind(shard)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(shard)
    }

    /// Claims each of `orders` (distinct, in order-id order as every caller gives them) for
    /// the voucher beside it where no other voucher has it, and counts the commit calls beside
    /// it on the claim: returns those claimed or joined for their own voucher.
    pub(crate) async fn claim_orders(
        &self,
        orders: &[&str],
        codes: &[&str],
        calls: &[i64],
    ) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(
            "INSERT INTO order_claims (order_id, code, pending) \
             SELECT o, c, n FROM UNNEST($1::TEXT[], $2::TEXT[], $3::BIGINT[]) AS x(o, c, n) \
             ON CONFLICT (order_id) DO UPDATE SET pending = order_claims.pending + EXCLUDED.pending \
             WHERE order_claims.code = EXCLUDED.code \
             RETURNING order_id",
        )
        .bind(orders)
        .bind(codes)
        .bind(calls)
        .fetch_all(&self.pool())
        .await?)
    }

    /// The voucher that holds the claim of each of `orders` that has one.
    pub(crate) async fn claim_holders(
        &self,
        orders: &[&str],
    ) -> Result<Vec<(String, String)>, LedgerError> {
        Ok(
            sqlx::query_as("SELECT order_id, code FROM order_claims WHERE order_id = ANY($1)")
                .bind(orders)
                .fetch_all(&self.pool())
                .await?,
        )
    }

    /// The calling commit's rows of `orders` were all refused: it gives back its count of
    /// each, and a claim back at zero goes away.
    pub(crate) async fn release_claims(&self, orders: &[&str]) -> Result<(), LedgerError> {
        sqlx::query("SELECT vouchers_release_claims($1)")
            .bind(orders)
            .execute(&self.pool())
            .await?;
        Ok(())
    }

    /// A page of the codes placed, in code order after `after`, at most `limit`.
    pub(crate) async fn placed_codes(
        &self,
        after: &str,
        limit: i64,
    ) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT code FROM voucher_shards WHERE code > $1 ORDER BY code LIMIT $2",
        )
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool())
        .await?)
    }

    /// The codes placed at or after `since` (the placing node's clock).
    pub(crate) async fn placed_since(&self, since: i64) -> Result<Vec<String>, LedgerError> {
        Ok(
            sqlx::query_scalar("SELECT code FROM voucher_shards WHERE placed_at >= $1")
                .bind(since)
                .fetch_all(&self.pool())
                .await?,
        )
    }

    /// Copies what each of `shards` shards' feeds holds beyond what was copied before (at most
    /// `page` events of each, read by `pull(shard, after)`) into the merged feed, numbered on
    /// from its last number, in one transaction with the shards' new heads.
    pub(crate) async fn merge_feeds<F, Fut>(
        &self,
        shards: usize,
        page: i64,
        pull: F,
    ) -> Result<(), LedgerError>
    where
        F: Fn(usize, i64, i64) -> Fut,
        Fut: Future<Output = Result<Vec<FeedEvent>, LedgerError>>,
    {
        let mut tx = self.pool().begin().await?;
        xact_lock(&mut tx, FEED_MERGE_LOCK).await?;
        let heads: Vec<(i32, i64)> = sqlx::query_as("SELECT shard, last FROM feed_merge_heads")
            .fetch_all(&mut *tx)
            .await?;
        let mut last: i64 = sqlx::query_scalar("SELECT COALESCE(max(seq), 0) FROM feed_merged")
            .fetch_one(&mut *tx)
            .await?;
        for shard in 0..shards {
            let after = heads
                .iter()
                .find(|(s, _)| *s as usize == shard)
                .map_or(0, |(_, l)| *l);
            // A shard that does not answer is copied at a later merge: the others' events
            // still come through, each shard's in its own order.
            let events = match pull(shard, after, page).await {
                Ok(events) => events,
                Err(e) => {
                    tracing::warn!(shard, error = %e, "could not read a shard's feed");
                    continue;
                }
            };
            let Some(head) = events.last().map(|e| e.seq) else {
                continue;
            };
            if events
                .iter()
                .zip(after + 1..)
                .any(|(e, expected)| e.seq != expected)
            {
                return Err(LedgerError::Inconsistent("a shard's feed has a gap"));
            }
            let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
            let codes: Vec<&str> = events.iter().map(|e| e.voucher_code.as_str()).collect();
            let orders: Vec<&str> = events.iter().map(|e| e.order_id.as_str()).collect();
            let customers: Vec<i64> = events.iter().map(|e| e.customer_id).collect();
            let ats: Vec<i64> = events.iter().map(|e| e.at).collect();
            sqlx::query(COPY_SQL)
                .bind(last)
                .bind(shard as i32)
                .bind(&kinds)
                .bind(&codes)
                .bind(&orders)
                .bind(&customers)
                .bind(&ats)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "INSERT INTO feed_merge_heads (shard, last) VALUES ($1, $2) \
                 ON CONFLICT (shard) DO UPDATE SET last = EXCLUDED.last",
            )
            .bind(shard as i32)
            .bind(head)
            .execute(&mut *tx)
            .await?;
            last += events.len() as i64;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The merged feed after `after`, at most `limit` events.
    pub(crate) async fn merged_events(
        &self,
        after: i64,
        limit: i64,
    ) -> Result<Vec<FeedEvent>, LedgerError> {
        let rows: Vec<EventRow> = sqlx::query_as(MERGED_SQL)
            .bind(after)
            .bind(limit)
            .fetch_all(&self.pool())
            .await?;
        rows.into_iter().map(event_from).collect()
    }
}
