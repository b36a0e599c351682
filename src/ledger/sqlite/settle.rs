//! Settling reservations on the embedded ledger: confirm, release and the expiry sweep, each
//! one writer transaction that moves the voucher's counters, numbers the change in the feed and,
//! once committed, the writer's usage counts.

use sqlx::Connection;

use super::usage::UsageCache;
use super::{json_list, SqliteLedger};
use crate::clock::Millis;
use crate::domain::Reservation;
use crate::ledger::rows::{reservation_from, RESERVATION_COLUMNS};
use crate::ledger::{confirm_unchanged, group_restocks, release_unchanged, LedgerError, Restock};

impl SqliteLedger {
    /// [`Ledger::confirm`](crate::ledger::Ledger::confirm): RESERVED → CONFIRMED, idempotent.
    pub(super) async fn confirm_reservation(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<Reservation, LedgerError> {
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        // The writer is alone: the head's next number is this change's.
        let row = sqlx::query(&format!(
            "UPDATE reservations SET status = 'CONFIRMED', updated_at = ?, \
               settled_seq = (SELECT last + 1 FROM feed_head WHERE id = 1) \
             WHERE order_id = ? AND voucher_code = ? AND status = 'RESERVED' AND expires_at > ? \
             RETURNING {RESERVATION_COLUMNS}"
        ))
        .bind(now)
        .bind(order_id)
        .bind(code)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = row {
            sqlx::query(
                "UPDATE vouchers SET reserved = reserved - 1, confirmed = confirmed + 1 WHERE code = ?",
            )
            .bind(code)
            .execute(&mut *tx)
            .await?;
            bump_feed_head(&mut tx).await?;
            tx.commit().await?;
            return Ok(reservation_from(&row)?);
        }
        let current = load_reservation(&mut tx, code, order_id).await?;
        confirm_unchanged(current)
    }

    /// [`Ledger::release`](crate::ledger::Ledger::release): RESERVED → RELEASED, the unit back
    /// to `free` once.
    pub(super) async fn release_reservation(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<(Reservation, Option<Restock>), LedgerError> {
        let mut w = self.writer().await?;
        let (conn, usage) = w.conn_and_usage()?;
        let mut tx = conn.begin().await?;
        let row = sqlx::query(&format!(
            "UPDATE reservations SET status = 'RELEASED', updated_at = ?, \
               settled_seq = (SELECT last + 1 FROM feed_head WHERE id = 1) \
             WHERE order_id = ? AND voucher_code = ? AND status = 'RESERVED' \
             RETURNING {RESERVATION_COLUMNS}"
        ))
        .bind(now)
        .bind(order_id)
        .bind(code)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = row {
            let r = reservation_from(&row)?;
            let restocks =
                release_units(&mut tx, &[(r.voucher_code.clone(), r.customer_id)]).await?;
            bump_feed_head(&mut tx).await?;
            commit_released(tx, usage, [(r.voucher_code.as_str(), r.customer_id)]).await?;
            return Ok((r, restocks.into_iter().next()));
        }
        let current = load_reservation(&mut tx, code, order_id).await?;
        release_unchanged(current)
    }

    /// [`Ledger::expire_due`](crate::ledger::Ledger::expire_due): up to `limit` due
    /// reservations released and numbered in the feed as expired.
    pub(super) async fn expire(
        &self,
        now: Millis,
        limit: i64,
    ) -> Result<Vec<Restock>, LedgerError> {
        let mut w = self.writer().await?;
        let (conn, usage) = w.conn_and_usage()?;
        let mut tx = conn.begin().await?;
        let released: Vec<(String, i64, String)> = sqlx::query_as(
            "UPDATE reservations SET status = 'RELEASED', updated_at = ? \
             WHERE order_id IN (SELECT order_id FROM reservations \
                                WHERE status = 'RESERVED' AND expires_at <= ? LIMIT ?) \
             AND status = 'RESERVED' RETURNING voucher_code, customer_id, order_id",
        )
        .bind(now)
        .bind(now)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        let (pairs, orders): (Vec<(String, i64)>, Vec<&str>) = released
            .iter()
            .map(|(code, customer, order)| ((code.clone(), *customer), order.as_str()))
            .unzip();
        let restocks = release_units(&mut tx, &pairs).await?;
        stamp_expired(&mut tx, &orders).await?;
        commit_released(
            tx,
            usage,
            pairs
                .iter()
                .map(|(code, customer)| (code.as_str(), *customer)),
        )
        .await?;
        // The sweeper runs every second whether or not anything sells: the counts of vouchers
        // nobody commits on any more are dropped even on a node that stopped selling, and what
        // a sweep (here or after a merged commit) dropped goes back to the system once the
        // writer is free for the next commit.
        usage.tidy();
        let freed = usage.take_freed();
        drop(w);
        if freed {
            crate::memory::give_back();
        }
        Ok(restocks)
    }
}

/// Commits `tx`, which released one reservation of each `(voucher, customer)` in `released`,
/// and then takes them off the writer's usage counts. A commit that failed may or may not have
/// happened: the counts are dropped, to be read from the rows again.
async fn commit_released<'a>(
    tx: sqlx::Transaction<'_, sqlx::Sqlite>,
    usage: &mut UsageCache,
    released: impl IntoIterator<Item = (&'a str, i64)>,
) -> Result<(), LedgerError> {
    // If this future is dropped while the commit is in flight, sqlx's worker may still commit:
    // the next use of the counts finds them unsettled and drops them.
    usage.settling();
    if let Err(e) = tx.commit().await {
        usage.clear();
        return Err(e.into());
    }
    for (code, customer) in released {
        usage.add(code, customer, -1);
    }
    usage.settled();
    Ok(())
}

/// Hands out the feed's next number, which the one change of `tx` already took.
async fn bump_feed_head(tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>) -> Result<(), LedgerError> {
    let bumped = sqlx::query("UPDATE feed_head SET last = last + 1 WHERE id = 1")
        .execute(&mut **tx)
        .await?
        .rows_affected();
    if bumped != 1 {
        return Err(LedgerError::Inconsistent("feed_head row missing"));
    }
    Ok(())
}

/// Gives the expired reservations `orders` (already released in `tx`) their feed numbers, in
/// the order given.
async fn stamp_expired(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    orders: &[&str],
) -> Result<(), LedgerError> {
    if orders.is_empty() {
        return Ok(());
    }
    let n = orders.len() as i64;
    let base: i64 = sqlx::query_scalar(
        "UPDATE feed_head SET last = last + ?1 WHERE id = 1 RETURNING last - ?1",
    )
    .bind(n)
    .fetch_one(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE reservations SET settled_seq = ?1 + j.key + 1, expired = 1 \
         FROM json_each(?2) AS j WHERE reservations.order_id = j.value",
    )
    .bind(base)
    .bind(json_list(orders))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn load_reservation(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    code: &str,
    order_id: &str,
) -> Result<Reservation, LedgerError> {
    let row = sqlx::query(&format!(
        "SELECT {RESERVATION_COLUMNS} FROM reservations WHERE order_id = ? AND voucher_code = ?"
    ))
    .bind(order_id)
    .bind(code)
    .fetch_optional(&mut **tx)
    .await?
    .ok_or(LedgerError::NotFound)?;
    Ok(reservation_from(&row)?)
}

/// Counter side of releasing reservations (already marked RELEASED): each unit back to `free`.
/// Each customer's usage is the count of their rows that are not RELEASED: the caller takes the
/// released ones off the writer's counts once it committed.
async fn release_units(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    released: &[(String, i64)],
) -> Result<Vec<Restock>, LedgerError> {
    if released.is_empty() {
        return Ok(Vec::new());
    }
    let restocks = group_restocks(released.iter().map(|(c, _)| (c.clone(), 1)).collect());
    let list: Vec<(String, i64)> = restocks
        .iter()
        .map(|r| (r.voucher_code.clone(), r.units))
        .collect();
    sqlx::query(
        "UPDATE vouchers SET free = free + d.n, reserved = reserved - d.n, released = released + d.n \
         FROM (SELECT json_extract(value, '$[0]') AS code, json_extract(value, '$[1]') AS n \
               FROM json_each(?)) AS d WHERE vouchers.code = d.code",
    )
    .bind(json_list(&list))
    .execute(&mut **tx)
    .await?;
    Ok(restocks)
}
