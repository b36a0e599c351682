//! Leases and their holders on PostgreSQL: a grant (one call of `vouchers_grant_v3`), returns
//! and reaps with their locks in a fixed order (vouchers by code, then leases by id), and the
//! holders' incarnations and beats, judged on the ledger's own clock.

use sqlx::{Postgres, Transaction};

use super::PostgresLedger;
use crate::clock::Millis;
use crate::ledger::{
    group_restocks, holder_name, restock_of_each, split_holder, Beat, Closing, Grant, GrantAsk,
    Incarnation, Lease, LedgerError, Restock,
};

type Tx = Transaction<'static, Postgres>;

/// Locks the voucher rows of `codes` in code order; returns the codes that exist.
async fn lock_vouchers(tx: &mut Tx, codes: &[String]) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT code FROM vouchers WHERE code = ANY($1) ORDER BY code FOR UPDATE")
        .bind(codes)
        .fetch_all(&mut **tx)
        .await
}

/// `vouchers_grant_v3`'s answer: units free before the grant, units granted, units unused in
/// the voucher's other active leases, the new lease (none when nothing was free), and how many
/// reservations the voucher ever had (when nothing was granted).
type GrantRow = (i64, i64, i64, Option<i64>, Option<i64>);

/// One row of a merged grant: its ordinal, then [`GrantRow`]'s columns, all null for a voucher
/// that does not exist.
type ManyGrantRow = (
    i64,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
);

/// A grant from `vouchers_grant_v3`'s row.
fn grant_of(row: GrantRow, expires_at: Millis) -> Result<Grant, LedgerError> {
    let (free, units, leased_unused, lease_id, ever_reserved) = row;
    let lease = lease_id.map(|id| Lease {
        id,
        granted: units,
        expires_at,
    });
    Ok(Grant {
        lease,
        free_after: free - units,
        leased_unused,
        ever_reserved,
    })
}

impl PostgresLedger {
    /// [`Ledger::grant`](crate::ledger::Ledger::grant), in one round trip.
    pub(super) async fn grant_lease(
        &self,
        code: &str,
        node: &str,
        want: i64,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Grant, LedgerError> {
        // One round trip: `vouchers_grant_v3` (migrations/postgres/grant.sql) checks that the
        // holder is live, locks the voucher, moves the units and inserts the lease; the deferred
        // check runs as the call commits.
        let expires_at = now + ttl_ms;
        let row: Option<GrantRow> = sqlx::query_as(
            "SELECT out_free, out_units, out_unused, out_lease, out_ever \
             FROM vouchers_grant_v3($1, $2, $3, $4, $5)",
        )
        .bind(code)
        .bind(node)
        .bind(want)
        .bind(now)
        .bind(expires_at)
        .fetch_optional(&self.pool())
        .await
        .inspect_err(|e| {
            if let sqlx::Error::Database(d) = e {
                if d.code().as_deref() == Some("23514") {
                    // DESIGN §3's last line held where the books had already gone wrong.
                    tracing::error!(code, want, error = %d, "a grant would pass total_limit: refused");
                    crate::metrics::ledger_error(crate::metrics::LedgerOp::GrantPastTotal);
                }
            }
        })
        .map_err(not_live)?;
        grant_of(row.ok_or(LedgerError::NotFound)?, expires_at)
    }

    /// [`Ledger::grant_many`](crate::ledger::Ledger::grant_many): one statement, so one round
    /// trip and one commit for every grant. The vouchers are locked in code order by the
    /// database's own collation (`ORDER BY a.code`), as every transaction that locks several
    /// does: an order taken in Rust (bytes) differs from it under a collation such as
    /// `en_US.utf8` (`A-C`, `AB`), and two transactions locking in the two orders deadlock.
    pub(super) async fn grant_leases(
        &self,
        asks: &[GrantAsk],
    ) -> Result<Vec<Result<Grant, LedgerError>>, LedgerError> {
        // One holder per call (a node merges its own actors' grants): `vouchers_grant_v3` locks
        // the holder's row at the first ask, before any voucher; holders mixed in one call
        // would lock their rows between vouchers, and could deadlock with a reaper.
        debug_assert!(asks.windows(2).all(|w| w[0].node == w[1].node));
        let pick = |f: fn(&GrantAsk) -> i64| -> Vec<i64> { asks.iter().map(f).collect() };
        let codes: Vec<&str> = asks.iter().map(|a| a.code.as_str()).collect();
        let nodes: Vec<&str> = asks.iter().map(|a| a.node.as_str()).collect();
        let rows: Vec<ManyGrantRow> = sqlx::query_as(
            "SELECT a.i, g.out_free, g.out_units, g.out_unused, g.out_lease, g.out_ever \
                 FROM (SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], \
                                            $5::bigint[]) \
                            WITH ORDINALITY AS u(code, node, want, now, expires, i) \
                       ORDER BY u.code) AS a \
                 LEFT JOIN LATERAL vouchers_grant_v3(a.code, a.node, a.want, a.now, a.expires) g \
                      ON true \
                 ORDER BY a.i",
        )
        .bind(&codes)
        .bind(&nodes)
        .bind(pick(|a| a.want))
        .bind(pick(|a| a.now))
        .bind(pick(|a| a.now + a.ttl_ms))
        .fetch_all(&self.pool())
        .await
        .map_err(not_live)?;
        let mut answers: Vec<Option<Result<Grant, LedgerError>>> =
            asks.iter().map(|_| None).collect();
        for (i, free, units, unused, lease, ever) in rows {
            // Each row names its ask (1-based): an answer never goes to another voucher's ask.
            let k = usize::try_from(i - 1)
                .ok()
                .filter(|&k| k < asks.len())
                .ok_or(LedgerError::Inconsistent("a grant answered past its asks"))?;
            if answers[k].is_some() {
                return Err(LedgerError::Inconsistent("a grant answered twice"));
            }
            answers[k] = Some(match (free, units, unused) {
                (Some(free), Some(units), Some(unused)) => grant_of(
                    (free, units, unused, lease, ever),
                    asks[k].now + asks[k].ttl_ms,
                ),
                _ => Err(LedgerError::NotFound),
            });
        }
        answers
            .into_iter()
            .map(|a| a.ok_or(LedgerError::Inconsistent("a grant left unanswered")))
            .collect()
    }

    /// [`Ledger::register_node`](crate::ledger::Ledger::register_node): the name's next
    /// number, its first beat on the ledger's clock, and its live siblings.
    pub(super) async fn register(
        &self,
        name: &str,
        _now: Millis,
        dead_after_ms: i64,
    ) -> Result<Incarnation, LedgerError> {
        let mut tx = self.pool().begin().await?;
        let number: i64 = sqlx::query_scalar(
            "INSERT INTO node_names (name, last_incarnation) VALUES ($1, 1) \
             ON CONFLICT (name) DO UPDATE SET last_incarnation = node_names.last_incarnation + 1 \
             RETURNING last_incarnation",
        )
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
        let holder = holder_name(name, number);
        sqlx::query(&format!(
            "INSERT INTO nodes (holder, name, incarnation, started_at, beat_at, streak_from, \
                                dead_after) \
             VALUES ($1, $2, $3, {LEDGER_NOW}, {LEDGER_NOW}, {LEDGER_NOW}, $4) \
             ON CONFLICT (holder) DO UPDATE SET beat_at = EXCLUDED.beat_at, \
                 streak_from = EXCLUDED.streak_from, dead_after = EXCLUDED.dead_after"
        ))
        .bind(&holder)
        .bind(name)
        .bind(number)
        .bind(dead_after_ms.max(1))
        .execute(&mut *tx)
        .await?;
        let live_siblings: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT incarnation FROM nodes WHERE name = $1 AND incarnation <> $2 \
             AND beat_at >= {LEDGER_NOW} - dead_after ORDER BY incarnation"
        ))
        .bind(name)
        .bind(number)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Incarnation {
            holder,
            number,
            live_siblings,
        })
    }

    /// [`Ledger::heartbeat`](crate::ledger::Ledger::heartbeat), on the heartbeat's own
    /// connection.
    pub(super) async fn beat(
        &self,
        holder: &str,
        _now: Millis,
        dead_after_ms: i64,
    ) -> Result<Beat, LedgerError> {
        let (name, number) = split_holder(holder);
        // One statement, one round trip: the clock reading it returns is as close to the middle
        // of the call as can be. The dead are listed in the snapshot from before this beat.
        let (ledger_ms, dead): (i64, Vec<String>) = sqlx::query_as(&format!(
            "WITH b AS ( \
                 INSERT INTO nodes (holder, name, incarnation, started_at, beat_at, streak_from, \
                                    dead_after) \
                 VALUES ($1, $2, $3, {LEDGER_NOW}, {LEDGER_NOW}, {LEDGER_NOW}, $4) \
                 ON CONFLICT (holder) DO UPDATE SET beat_at = EXCLUDED.beat_at, \
                     dead_after = EXCLUDED.dead_after, \
                     streak_from = CASE \
                         WHEN EXCLUDED.beat_at - nodes.beat_at > EXCLUDED.dead_after / 2 \
                         THEN EXCLUDED.beat_at ELSE nodes.streak_from END \
                 WHERE nodes.beat_at <> 0 \
                 RETURNING beat_at - streak_from AS streak, beat_at) \
             SELECT b.beat_at, ARRAY(SELECT n.holder FROM nodes n \
                                     WHERE n.holder <> $1 AND n.beat_at < b.beat_at - n.dead_after \
                                       AND n.dead_after <= b.streak ORDER BY n.holder) \
             FROM b"
        ))
        .bind(holder)
        .bind(name)
        .bind(number)
        .bind(dead_after_ms.max(1))
        .fetch_optional(&self.beats())
        .await?
        // No row: this holder retired (a beat that landed after its own process's retire).
        .ok_or(LedgerError::NotFound)?;
        Ok(Beat { ledger_ms, dead })
    }

    /// Returns or reaps leases, in a transaction of their own.
    pub(super) async fn close_leases(
        &self,
        which: Closing<'_>,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        let mut tx = self.pool().begin().await?;
        let restocks = close_leases_in(&mut tx, which, now).await?;
        tx.commit().await?;
        Ok(restocks)
    }

    /// [`Ledger::return_leases`](crate::ledger::Ledger::return_leases): every return in one
    /// transaction of five statements however many leases, locking as [`close_leases_in`]
    /// does (vouchers in code order, then leases in id order).
    pub(super) async fn return_many(
        &self,
        leases: &[(i64, Millis)],
    ) -> Result<Vec<Option<Restock>>, LedgerError> {
        let (ids, nows): (Vec<i64>, Vec<i64>) = leases.iter().copied().unzip();
        let mut tx = self.pool().begin().await?;
        let codes: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT voucher_code FROM leases \
             WHERE state = 'ACTIVE' AND id = ANY($1) ORDER BY voucher_code",
        )
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await?;
        if codes.is_empty() {
            tx.commit().await?;
            return Ok(vec![None; leases.len()]);
        }
        lock_vouchers(&mut tx, &codes).await?;
        sqlx::query(
            "SELECT id FROM leases WHERE state = 'ACTIVE' AND id = ANY($1) ORDER BY id FOR UPDATE",
        )
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
        // A lease asked twice is closed once (its first `now`).
        let rows: Vec<(i64, String, i64)> = sqlx::query_as(
            "UPDATE leases SET state = 'RETURNED', closed_at = d.now \
             FROM (SELECT DISTINCT ON (id) id, now \
                   FROM UNNEST($1::bigint[], $2::bigint[]) WITH ORDINALITY AS u (id, now, n) \
                   ORDER BY id, n) AS d \
             WHERE leases.id = d.id AND leases.state = 'ACTIVE' \
             RETURNING leases.id, leases.voucher_code, leases.granted - leases.consumed",
        )
        .bind(&ids)
        .bind(&nows)
        .fetch_all(&mut *tx)
        .await?;
        let answers = restock_of_each(leases, &rows);
        give_back(&mut tx, rows.into_iter().map(|(_, c, u)| (c, u)).collect()).await?;
        tx.commit().await?;
        Ok(answers)
    }

    /// Reaps the leases of `holder` if it is still dead by its own limit (it may have beaten
    /// since it was listed): its row goes, and its leases close, in one transaction. Another
    /// node reaping the same holder holds its row: this one skips it (no queue of reapers).
    /// Locks: the holder's row, then as [`close_leases_in`].
    pub(super) async fn reap_dead(
        &self,
        holder: &str,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        let mut tx = self.pool().begin().await?;
        let gone: Option<String> = sqlx::query_scalar(&format!(
            "DELETE FROM nodes WHERE holder = \
                 (SELECT holder FROM nodes \
                  WHERE holder = $1 AND beat_at < {LEDGER_NOW} - dead_after \
                  FOR UPDATE SKIP LOCKED) \
             RETURNING holder"
        ))
        .bind(holder)
        .fetch_optional(&mut *tx)
        .await?;
        if gone.is_none() {
            return Ok(Vec::new());
        }
        let restocks = close_leases_in(&mut tx, Closing::Dead(holder), now).await?;
        tx.commit().await?;
        let units: i64 = restocks.iter().map(|r| r.units).sum();
        tracing::warn!(
            holder,
            units,
            "reaped the leases of a holder that stopped beating"
        );
        Ok(restocks)
    }
}

/// `vouchers_grant_v3`'s refusal of a holder that is not live (SQLSTATE VH001) as
/// [`LedgerError::NotLive`]; any other error as it is.
fn not_live(e: sqlx::Error) -> LedgerError {
    match &e {
        sqlx::Error::Database(d) if d.code().as_deref() == Some("VH001") => LedgerError::NotLive,
        _ => e.into(),
    }
}

/// The ledger's clock, in milliseconds since the epoch: liveness is judged on it, so no node's
/// own clock can make a live holder look dead.
const LEDGER_NOW: &str = ledger_now!();

/// Returns or reaps leases: their vouchers are locked first (in code order), then the leases
/// close and their unused units go back to `free`.
async fn close_leases_in(
    tx: &mut Tx,
    which: Closing<'_>,
    now: Millis,
) -> Result<Vec<Restock>, LedgerError> {
    let (id, node, expired_by) = which.params();
    let filter = which.filter();
    let codes: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT DISTINCT voucher_code FROM leases WHERE {filter} ORDER BY voucher_code"
    ))
    .bind(id)
    .bind(&node)
    .bind(expired_by)
    .fetch_all(&mut **tx)
    .await?;
    if codes.is_empty() {
        return Ok(Vec::new());
    }
    lock_vouchers(tx, &codes).await?;
    // Then the leases, in id order, as a merged commit locks them (no deadlock).
    sqlx::query(&format!(
        "SELECT id FROM leases WHERE {filter} AND voucher_code = ANY($4) \
         ORDER BY id FOR UPDATE"
    ))
    .bind(id)
    .bind(&node)
    .bind(expired_by)
    .bind(&codes)
    .execute(&mut **tx)
    .await?;
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "UPDATE leases SET state = $4, closed_at = $5 \
         WHERE {filter} AND voucher_code = ANY($6) \
         RETURNING voucher_code, granted - consumed"
    ))
    .bind(id)
    .bind(&node)
    .bind(expired_by)
    .bind(which.state())
    .bind(now)
    .bind(&codes)
    .fetch_all(&mut **tx)
    .await?;
    give_back(tx, rows).await
}

/// Puts the unused units of closed leases back to `free`.
async fn give_back(tx: &mut Tx, rows: Vec<(String, i64)>) -> Result<Vec<Restock>, LedgerError> {
    let restocks = group_restocks(rows);
    if !restocks.is_empty() {
        let (codes, units): (Vec<String>, Vec<i64>) = restocks
            .iter()
            .map(|r| (r.voucher_code.clone(), r.units))
            .unzip();
        sqlx::query(
            "UPDATE vouchers SET free = free + d.units \
             FROM UNNEST($1::text[], $2::bigint[]) AS d (code, units) WHERE vouchers.code = d.code",
        )
        .bind(&codes)
        .bind(&units)
        .execute(&mut **tx)
        .await?;
    }
    Ok(restocks)
}
