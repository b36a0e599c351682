//! Leases and their holders on the embedded ledger: a grant on the raw writer, returns and
//! reaps (unused units back to `free`), and the holders' incarnations and beats (the embedded
//! node beats only at start and has nobody to judge, but the rows are the same as PostgreSQL's).

use sqlx::Connection;

use super::{json_list, raw, SqliteLedger};
use crate::clock::Millis;
use crate::ledger::{
    group_restocks, holder_name, is_incarnation, restock_of_each, split_holder, Beat, Closing,
    Grant, GrantAsk, Incarnation, Lease, LedgerError, Restock,
};

/// Moves `min(want, free)` units into a new ACTIVE lease, in one transaction.
pub(super) fn grant_on(
    db: &raw::Db,
    code: &str,
    node: &str,
    want: i64,
    now: Millis,
    ttl_ms: i64,
) -> Result<Grant, LedgerError> {
    let tx = db.begin()?;
    let grant = grant_in(db, code, node, want, now, ttl_ms)?;
    tx.commit()?;
    Ok(grant)
}

/// Grants in one transaction, each answered on its own ([`crate::ledger::Ledger::grant_many`]).
pub(super) fn grant_many_on(
    db: &raw::Db,
    asks: &[GrantAsk],
) -> Result<Vec<Result<Grant, LedgerError>>, LedgerError> {
    let tx = db.begin()?;
    let mut answers = Vec::with_capacity(asks.len());
    for a in asks {
        answers.push(
            match grant_in(db, &a.code, &a.node, a.want, a.now, a.ttl_ms) {
                Err(LedgerError::NotFound) => Err(LedgerError::NotFound),
                Err(e) => return Err(e),
                Ok(g) => Ok(g),
            },
        );
    }
    tx.commit()?;
    Ok(answers)
}

/// One grant inside the caller's transaction (a voucher not found, or a holder that is not
/// live, writes nothing).
fn grant_in(
    db: &raw::Db,
    code: &str,
    node: &str,
    want: i64,
    now: Millis,
    ttl_ms: i64,
) -> Result<Grant, LedgerError> {
    if is_incarnation(node) {
        let mut live = db.prepare("SELECT 1 FROM nodes WHERE holder = ?1 AND beat_at <> 0")?;
        live.bind_text(1, node)?;
        if !live.step()? {
            return Err(LedgerError::NotLive);
        }
    }
    let (free, leased_unused, ever_reserved) = {
        let mut q = db.prepare(
            "SELECT free, (SELECT COALESCE(SUM(granted - consumed), 0) FROM leases \
             WHERE voucher_code = ?1 AND state = 'ACTIVE'), reserved + confirmed + released \
             FROM vouchers WHERE code = ?1",
        )?;
        q.bind_text(1, code)?;
        if !q.step()? {
            return Err(LedgerError::NotFound);
        }
        (q.int(0), q.int(1), q.int(2))
    };
    let units = want.max(1).min(free);
    let lease = if units > 0 {
        let mut take = db.prepare("UPDATE vouchers SET free = free - ?2 WHERE code = ?1")?;
        take.bind_text(1, code)?;
        take.bind_int(2, units)?;
        db.run(take)?;
        let expires_at = now + ttl_ms;
        let mut insert = db.prepare(
            "INSERT INTO leases (voucher_code, node_id, granted, consumed, state, granted_at, \
             expires_at) VALUES (?1, ?2, ?3, 0, 'ACTIVE', ?4, ?5) RETURNING id",
        )?;
        insert.bind_text(1, code)?;
        insert.bind_text(2, node)?;
        insert.bind_int(3, units)?;
        insert.bind_int(4, now)?;
        insert.bind_int(5, expires_at)?;
        if !insert.step()? {
            return Err(LedgerError::Inconsistent("lease insert returned no id"));
        }
        let id = insert.int(0);
        drop(insert);
        Some(Lease {
            id,
            granted: units,
            expires_at,
        })
    } else {
        None
    };
    Ok(Grant {
        ever_reserved: lease.is_none().then_some(ever_reserved),
        lease,
        free_after: free - units,
        leased_unused,
    })
}

impl SqliteLedger {
    /// Returns or reaps leases; their unused units go back to `free`.
    pub(super) async fn close_leases(
        &self,
        which: Closing<'_>,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        let restocks = close_leases_in(&mut tx, which, now).await?;
        tx.commit().await?;
        Ok(restocks)
    }

    /// [`Ledger::return_leases`](crate::ledger::Ledger::return_leases): every return in one
    /// transaction of two statements (the leases, then their vouchers' `free`), however many.
    pub(super) async fn return_many(
        &self,
        leases: &[(i64, Millis)],
    ) -> Result<Vec<Option<Restock>>, LedgerError> {
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        let rows: Vec<(i64, String, i64)> = sqlx::query_as(
            "UPDATE leases SET state = 'RETURNED', closed_at = d.now FROM \
             (SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS now \
              FROM json_each(?)) AS d \
             WHERE leases.id = d.id AND leases.state = 'ACTIVE' \
             RETURNING leases.id, voucher_code, granted - consumed",
        )
        .bind(json_list(leases))
        .fetch_all(&mut *tx)
        .await?;
        let answers = restock_of_each(leases, &rows);
        give_back(&mut tx, rows.into_iter().map(|(_, c, u)| (c, u)).collect()).await?;
        tx.commit().await?;
        Ok(answers)
    }
}

impl SqliteLedger {
    /// [`Ledger::register_node`](crate::ledger::Ledger::register_node); forgets rows of earlier
    /// runs that hold nothing.
    pub(super) async fn register(
        &self,
        name: &str,
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Incarnation, LedgerError> {
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        let number: i64 = sqlx::query_scalar(
            "INSERT INTO node_names (name, last_incarnation) VALUES (?1, 1) \
             ON CONFLICT (name) DO UPDATE SET last_incarnation = last_incarnation + 1 \
             RETURNING last_incarnation",
        )
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
        let holder = holder_name(name, number);
        // Rows of earlier runs that hold nothing any more (the embedded ledger runs no
        // heartbeat, so nothing else forgets them).
        sqlx::query(
            "DELETE FROM nodes WHERE beat_at < ?1 - dead_after AND holder NOT IN \
             (SELECT node_id FROM leases WHERE state = 'ACTIVE')",
        )
        .bind(now)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO nodes (holder, name, incarnation, started_at, beat_at, streak_from, \
                                dead_after) \
             VALUES (?1, ?2, ?3, ?4, ?4, ?4, ?5) ON CONFLICT (holder) DO UPDATE SET \
                 beat_at = ?4, streak_from = ?4, dead_after = ?5",
        )
        .bind(&holder)
        .bind(name)
        .bind(number)
        .bind(now)
        .bind(dead_after_ms.max(1))
        .execute(&mut *tx)
        .await?;
        let live_siblings: Vec<i64> = sqlx::query_scalar(
            "SELECT incarnation FROM nodes WHERE name = ?1 AND incarnation <> ?2 \
             AND beat_at >= ?3 - dead_after ORDER BY incarnation",
        )
        .bind(name)
        .bind(number)
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Incarnation {
            holder,
            number,
            live_siblings,
        })
    }

    /// [`Ledger::heartbeat`](crate::ledger::Ledger::heartbeat), on this node's clock (one
    /// process on one machine: the ledger's clock is the node's).
    pub(super) async fn beat(
        &self,
        holder: &str,
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Beat, LedgerError> {
        let (name, number) = split_holder(holder);
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        let streak: i64 = sqlx::query_scalar(
            "INSERT INTO nodes (holder, name, incarnation, started_at, beat_at, streak_from, \
                                dead_after) \
             VALUES (?1, ?2, ?3, ?4, ?4, ?4, ?5) ON CONFLICT (holder) DO UPDATE SET \
                 beat_at = ?4, dead_after = ?5, \
                 streak_from = CASE WHEN ?4 - beat_at > ?5 / 2 THEN ?4 ELSE streak_from END \
             WHERE nodes.beat_at <> 0 \
             RETURNING beat_at - streak_from",
        )
        .bind(holder)
        .bind(name)
        .bind(number)
        .bind(now)
        .bind(dead_after_ms.max(1))
        .fetch_optional(&mut *tx)
        .await?
        // No row: this holder retired (a beat that landed after its own process's retire).
        .ok_or(LedgerError::NotFound)?;
        let dead: Vec<String> = sqlx::query_scalar(
            "SELECT holder FROM nodes WHERE holder <> ?1 AND beat_at < ?2 - dead_after \
             AND dead_after <= ?3 ORDER BY holder",
        )
        .bind(holder)
        .bind(now)
        .bind(streak)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        // One process on one machine: the ledger's clock is this node's.
        Ok(Beat {
            ledger_ms: now,
            dead,
        })
    }

    /// [`Ledger::reap_holder`](crate::ledger::Ledger::reap_holder): the holder's row goes and
    /// its leases close in one transaction, if it is still dead.
    pub(super) async fn reap_dead(
        &self,
        holder: &str,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        let gone: Option<String> = sqlx::query_scalar(
            "DELETE FROM nodes WHERE holder = ?1 AND beat_at < ?2 - dead_after RETURNING holder",
        )
        .bind(holder)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        if gone.is_none() {
            return Ok(Vec::new());
        }
        let restocks = close_leases_in(&mut tx, Closing::Dead(holder), now).await?;
        tx.commit().await?;
        Ok(restocks)
    }
}

/// [`SqliteLedger::close_leases`] inside a transaction.
async fn close_leases_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    which: Closing<'_>,
    now: Millis,
) -> Result<Vec<Restock>, LedgerError> {
    let (id, node, expired_by) = which.params();
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "UPDATE leases SET state = $4, closed_at = $5 WHERE {} \
         RETURNING voucher_code, granted - consumed",
        which.filter()
    ))
    .bind(id)
    .bind(node)
    .bind(expired_by)
    .bind(which.state())
    .bind(now)
    .fetch_all(&mut **tx)
    .await?;
    give_back(tx, rows).await
}

/// Puts the unused units of closed leases back to `free`.
async fn give_back(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    rows: Vec<(String, i64)>,
) -> Result<Vec<Restock>, LedgerError> {
    let restocks = group_restocks(rows);
    if !restocks.is_empty() {
        let list: Vec<(String, i64)> = restocks
            .iter()
            .map(|r| (r.voucher_code.clone(), r.units))
            .collect();
        sqlx::query(
            "UPDATE vouchers SET free = free + d.units FROM \
             (SELECT json_extract(value, '$[0]') AS code, json_extract(value, '$[1]') AS units \
              FROM json_each(?)) AS d WHERE vouchers.code = d.code",
        )
        .bind(json_list(&list))
        .execute(&mut **tx)
        .await?;
    }
    Ok(restocks)
}
