//! The merged group commit on PostgreSQL: the batches split into groups that may share one
//! call of `vouchers_commit_batches_v2`, each call one round trip and its own transaction, a
//! deadlock victim run again, and the function's verdicts turned into each batch's outcomes.

use std::collections::HashSet;
use std::sync::Arc;

use sqlx::Postgres;

use super::PostgresLedger;
use crate::domain::{Ineligible, Reservation, ReservationStatus};
use crate::ledger::{
    created_rows, resolve_plan, Batch, BatchResults, Ledger, LedgerError, Planned, RowOutcome,
};

impl PostgresLedger {
    /// [`Ledger::commit_batches`]: the merged commit, run again (twice at most) when
    /// PostgreSQL chose it as a deadlock's victim.
    pub(super) async fn commit_merged(
        &self,
        batches: &[Batch],
    ) -> Result<BatchResults, LedgerError> {
        // Lock order is fixed, but two calls racing for one order id (or the database's own
        // choices) can still end in a deadlock; the victim runs again.
        let mut attempt = 0;
        loop {
            match self.try_commit_batches(batches).await {
                Err(e) if is_deadlock(&e) && attempt < 2 => {
                    attempt += 1;
                    tracing::warn!(
                        attempt,
                        batches = batches.len(),
                        "merged commit deadlocked; retrying"
                    );
                }
                other => {
                    if let Err(e) = &other {
                        warn_if_out_of_locks(e);
                    }
                    return other;
                }
            }
        }
    }

    /// One merged transaction: one call of `vouchers_commit_batches_v2` (one round trip, its own
    /// transaction) for the batches of distinct vouchers and order ids; then, only when another
    /// transaction stored one of the order ids meanwhile, one read of those rows.
    ///
    /// Batches that share a voucher or an order id, or past [`MAX_CUSTOMERS_PER_CALL`]
    /// customers, go in later calls, one after the other, each its own transaction: a call
    /// holds the change feed's head (its last lock) until it commits, so a second call in the
    /// same transaction would take lease and customer locks after the head and could deadlock
    /// with every other writer. A later call that fails fails only its own batches; the outer
    /// error means the first call failed and nothing committed. The calls share the merged
    /// commit's one deadline: one that runs out after an earlier call committed answers that
    /// call's batches `503` too (not acknowledged; a retry replays them).
    async fn try_commit_batches(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        let groups = independent_groups(batches);
        let mut verdicts: Vec<Result<Vec<Verdict>, LedgerError>> = Vec::with_capacity(groups.len());
        for (k, group) in groups.iter().enumerate() {
            let sql = self.commit_sql();
            let mut res = call_merged(&self.pool(), sql, batches, group).await;
            if k > 0 && matches!(&res, Err(e) if is_deadlock(e)) {
                // A deadlock victim ran nothing: once more (the first call's is retried by
                // `commit_batches`).
                res = call_merged(&self.pool(), sql, batches, group).await;
            }
            match res {
                Err(e) if k == 0 => return Err(e),
                other => verdicts.push(other),
            }
        }
        let lost: Vec<String> = verdicts
            .iter()
            .flatten()
            .flatten()
            .filter(|v| v.verdict == "LOST")
            .map(|v| v.order_id.clone())
            .collect();
        // Committed already: a failed read of the rows another transaction stored fails only
        // the batches that needed it, never the transaction's answer to the others.
        let stored = if lost.is_empty() {
            Ok(Vec::new())
        } else {
            self.find_orders(&lost).await.map_err(Arc::new)
        };
        let mut results: Vec<Option<Result<Vec<RowOutcome>, LedgerError>>> =
            batches.iter().map(|_| None).collect();
        for (group, rows) in groups.iter().zip(verdicts) {
            let mut rows = match rows {
                Ok(rows) => rows.into_iter(),
                Err(e) => {
                    warn_if_out_of_locks(&e);
                    tracing::warn!(error = %e, "a later call of a merged commit failed");
                    let failed = Arc::new(e);
                    for &i in group {
                        results[i] = Some(Err(LedgerError::CommitFailed(failed.clone())));
                    }
                    continue;
                }
            };
            for &i in group {
                let batch = &batches[i];
                let mine: Vec<Verdict> = rows.by_ref().take(batch.rows.len()).collect();
                results[i] = Some(match &stored {
                    // The read failed (a timeout, a broken link): not bad data.
                    Err(e) if mine.iter().any(|v| v.verdict == "LOST") => {
                        Err(LedgerError::Unanswered(e.clone()))
                    }
                    Err(_) => resolve_verdicts(batch, mine, &[]),
                    Ok(stored) => resolve_verdicts(batch, mine, stored),
                });
            }
        }
        Ok(results
            .into_iter()
            .map(|r| {
                r.unwrap_or(Err(LedgerError::Inconsistent(
                    "batch left out of the merge",
                )))
            })
            .collect())
    }
}

/// A call refused for want of room in PostgreSQL's lock table (SQLSTATE 53200, "out of shared
/// memory"): said once per failed call with the remedy, since the error alone does not name it.
fn warn_if_out_of_locks(e: &LedgerError) {
    if matches!(e, LedgerError::Database { code: Some(c), .. } if c == "53200") {
        tracing::error!(
            error = %e,
            "merged commit refused: PostgreSQL's lock table is full (one advisory lock per \
             customer of each call); raise max_locks_per_transaction (docs/OPERATIONS.md)"
        );
    }
}

/// PostgreSQL chose this call as a deadlock's victim (it ran nothing).
fn is_deadlock(e: &LedgerError) -> bool {
    matches!(e, LedgerError::Database { code: Some(c), .. } if c == "40P01")
}

/// Most distinct (voucher, customer) pairs in one call: the call holds an advisory lock on each
/// until it commits (migration 15), and PostgreSQL's lock table, shared by every session of the
/// server, holds about `max_locks_per_transaction ×` the backends (7,808 by PostgreSQL 15's
/// defaults; the sizing is in docs/OPERATIONS.md). A larger merge goes in several calls, one
/// after the other; a call's fixed cost (about 0.7 ms of PostgreSQL CPU) is then spread over at
/// least this many rows. One batch is never split: on PostgreSQL `engine.max_batch` is held to
/// this bound at start (`startup`), and the function refuses a call over twice it (SQLSTATE
/// VC003).
pub(crate) const MAX_CUSTOMERS_PER_CALL: usize = 512;

/// Batch indexes split into groups in which no voucher and no order id appears in two batches
/// (the precondition of `vouchers_commit_batches_v2`) and that hold at most
/// [`MAX_CUSTOMERS_PER_CALL`] customers (unless one batch alone has more). The node's committer
/// sends each voucher once per transaction, so this is one group in slice order unless two
/// vouchers' batches share an order id or the merge is that large.
fn independent_groups(batches: &[Batch]) -> Vec<Vec<usize>> {
    independent_groups_of(batches, MAX_CUSTOMERS_PER_CALL)
}

fn independent_groups_of(batches: &[Batch], max_customers: usize) -> Vec<Vec<usize>> {
    struct Group<'a> {
        codes: HashSet<&'a str>,
        orders: HashSet<&'a str>,
        /// Distinct (voucher, customer) pairs: the call's advisory locks.
        customers: usize,
        members: Vec<usize>,
    }
    let mut groups: Vec<Group> = Vec::new();
    for (i, b) in batches.iter().enumerate() {
        let clashes = |g: &Group| {
            g.codes.contains(b.voucher_code.as_str())
                || b.rows
                    .iter()
                    .any(|r| g.orders.contains(r.order_id.as_str()))
        };
        let customers = b
            .rows
            .iter()
            .map(|r| r.customer_id)
            .collect::<HashSet<_>>()
            .len();
        // A batch goes after every group it clashes with, so the slice order holds; then into
        // the first of those with room for its customers.
        let after = groups.iter().rposition(clashes).map_or(0, |j| j + 1);
        let room = |g: &Group| g.members.is_empty() || g.customers + customers <= max_customers;
        let at = match groups.iter().skip(after).position(room) {
            Some(k) => after + k,
            None => {
                groups.push(Group {
                    codes: HashSet::new(),
                    orders: HashSet::new(),
                    customers: 0,
                    members: Vec::new(),
                });
                groups.len() - 1
            }
        };
        let g = &mut groups[at];
        g.codes.insert(&b.voucher_code);
        g.orders.extend(b.rows.iter().map(|r| r.order_id.as_str()));
        g.customers += customers;
        g.members.push(i);
    }
    groups.into_iter().map(|g| g.members).collect()
}

/// The function's answer for one row.
#[derive(Debug)]
struct Verdict {
    order_id: String,
    verdict: String,
    discount: Option<i64>,
    /// The stored reservation that answers a `REPLAYED` row.
    stored: Option<(String, i64, String, i64)>,
}

/// The merged commit's statement.
const COMMIT_SQL: &str =
    "SELECT out_idx, out_verdict, out_discount, out_voucher, out_customer, out_status, \
     out_expires FROM vouchers_commit_batches_v2($1, $2, $3, $4, $5, $6, $7)";
/// The same, for a shard of a node that claims its orders first: past the fence that refuses
/// every other commit once the database's claims began (migration 13).
const CLAIMED_COMMIT_SQL: &str =
    "SELECT out_idx, out_verdict, out_discount, out_voucher, out_customer, out_status, \
     out_expires FROM vouchers_commit_batches_claimed($1, $2, $3, $4, $5, $6, $7)";
/// The SQLSTATE the merged commit raises, past the fence, once claims began.
const CLAIMS_BEGUN: &str = "VC001";

impl PostgresLedger {
    /// This store commits for a sharded node that claims its orders first (see `claimed`).
    pub(crate) fn commit_claimed(&self) {
        self.claimed
            .store(true, std::sync::atomic::Ordering::Release);
    }

    fn commit_sql(&self) -> &'static str {
        match self.claimed.load(std::sync::atomic::Ordering::Acquire) {
            true => CLAIMED_COMMIT_SQL,
            false => COMMIT_SQL,
        }
    }
}

/// Whether a commit was refused because the shard's order claims began (nothing of it ran).
pub(crate) fn claims_began(e: &LedgerError) -> bool {
    matches!(e, LedgerError::Database { code: Some(c), .. } if c == CLAIMS_BEGUN)
}

/// Calls the merged commit (`sql`) for the batches `group` names, in one round trip.
async fn call_merged<'e, E>(
    ex: E,
    sql: &str,
    batches: &[Batch],
    group: &[usize],
) -> Result<Vec<Verdict>, LedgerError>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let n_rows: usize = group.iter().map(|&i| batches[i].rows.len()).sum();
    let (mut leases, mut codes, mut nows, mut expires) = (
        Vec::with_capacity(group.len()),
        Vec::with_capacity(group.len()),
        Vec::with_capacity(group.len()),
        Vec::with_capacity(group.len()),
    );
    let (mut row_batch, mut orders, mut customers) = (
        Vec::with_capacity(n_rows),
        Vec::with_capacity(n_rows),
        Vec::with_capacity(n_rows),
    );
    for (pos, &i) in group.iter().enumerate() {
        let b = &batches[i];
        leases.push(b.lease_id);
        codes.push(b.voucher_code.as_str());
        nows.push(b.now);
        expires.push(b.expires_at);
        for row in &b.rows {
            row_batch.push(pos as i32 + 1);
            orders.push(row.order_id.as_str());
            customers.push(row.customer_id);
        }
    }
    type Out = (
        i32,
        String,
        Option<i64>,
        Option<String>,
        Option<i64>,
        Option<String>,
        Option<i64>,
    );
    let out: Vec<Out> = sqlx::query_as(sql)
        .bind(&leases)
        .bind(&codes)
        .bind(&nows)
        .bind(&expires)
        .bind(&row_batch)
        .bind(&orders)
        .bind(&customers)
        .fetch_all(ex)
        .await?;
    if out.len() != n_rows {
        return Err(LedgerError::database(
            "merged commit returned the wrong number of rows",
        ));
    }
    Ok(out
        .into_iter()
        .map(
            |(idx, verdict, discount, voucher, customer, status, expires)| {
                let stored = match (voucher, customer, status, expires) {
                    (Some(v), Some(c), Some(s), Some(e)) => Some((v, c, s, e)),
                    _ => None,
                };
                Verdict {
                    order_id: orders
                        .get((idx as usize).wrapping_sub(1))
                        .map(|o| o.to_string())
                        .unwrap_or_default(),
                    verdict,
                    discount,
                    stored,
                }
            },
        )
        .collect())
}

/// Turns one batch's verdicts into its outcomes (or its refusal as a whole).
fn resolve_verdicts(
    batch: &Batch,
    verdicts: Vec<Verdict>,
    stored: &[Reservation],
) -> Result<Vec<RowOutcome>, LedgerError> {
    if verdicts.len() != batch.rows.len() {
        return Err(LedgerError::Inconsistent(
            "merged commit lost rows of a batch",
        ));
    }
    if verdicts.iter().any(|v| v.verdict == "FENCED") {
        return Err(LedgerError::Fenced);
    }
    if verdicts.iter().any(|v| v.verdict == "NOT_FOUND") {
        return Err(LedgerError::NotFound);
    }
    let code = batch.voucher_code.as_str();
    let mut plan = Vec::with_capacity(verdicts.len());
    let mut won = Vec::new();
    let mut discount = 0;
    for (i, v) in verdicts.into_iter().enumerate() {
        let row = &batch.rows[i];
        let planned = match v.verdict.as_str() {
            "INSERT" => {
                won.push(i);
                discount = v.discount.unwrap_or(discount);
                Planned::Insert
            }
            "REPLAYED" => match (v.stored, v.discount) {
                (Some((voucher_code, customer_id, status, expires_at)), Some(discount_amount)) => {
                    Planned::Replay(Reservation {
                        order_id: row.order_id.clone(),
                        voucher_code,
                        customer_id,
                        discount_amount,
                        status: ReservationStatus::parse(&status)
                            .ok_or(LedgerError::Inconsistent("stored reservation status"))?,
                        expires_at,
                    })
                }
                _ => return Err(LedgerError::Inconsistent("replay without its stored row")),
            },
            "SAME" => match batch.rows[..i]
                .iter()
                .position(|r| r.order_id == row.order_id)
            {
                Some(j) => Planned::SameAs(j),
                None => Planned::AlreadyUsed,
            },
            "LOST" => match stored.iter().find(|r| r.order_id == row.order_id) {
                Some(r) if r.is_retry_of(code, row.customer_id, batch.now) => {
                    Planned::Replay(r.clone())
                }
                _ => Planned::AlreadyUsed,
            },
            "PAUSED" => Planned::NotEligible(Ineligible::Paused),
            "NOT_STARTED" => Planned::NotEligible(Ineligible::NotStarted),
            "ENDED" => Planned::NotEligible(Ineligible::Ended),
            _ => Planned::AlreadyUsed,
        };
        plan.push(planned);
    }
    let created = created_rows(batch, won, discount);
    Ok(resolve_plan(plan, &created))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::BatchRow;

    fn batch(code: &str, rows: &[(&str, i64)]) -> Batch {
        Batch {
            voucher_code: code.to_string(),
            lease_id: 1,
            now: 0,
            expires_at: 1,
            rows: rows
                .iter()
                .map(|(o, c)| BatchRow {
                    order_id: o.to_string(),
                    customer_id: *c,
                })
                .collect(),
        }
    }

    #[test]
    fn batches_that_share_a_voucher_or_an_order_go_in_later_calls_in_order() {
        let batches = [
            batch("A", &[("o1", 1)]),
            batch("B", &[("o2", 1)]),
            batch("A", &[("o3", 2)]),
            batch("C", &[("o2", 3)]),
            batch("D", &[("o4", 4)]),
        ];
        assert_eq!(
            independent_groups_of(&batches, 1024),
            vec![vec![0, 1, 4], vec![2, 3]]
        );
    }

    #[test]
    fn a_call_holds_a_bounded_number_of_customers_and_never_splits_a_batch() {
        // Customers count once per batch (the same customer twice is one lock).
        let batches = [
            batch("A", &[("a1", 1), ("a2", 1), ("a3", 2)]),
            batch("B", &[("b1", 1), ("b2", 2)]),
            batch(
                "C",
                &[("c1", 1), ("c2", 2), ("c3", 3), ("c4", 4), ("c5", 5)],
            ),
            batch("D", &[("d1", 1)]),
            batch("A", &[("a4", 9)]),
        ];
        // A and B make four pairs; C alone has five and takes a call of its own; D fits
        // neither beside them, so it opens a third call; A's second batch must come after the
        // first call (it shares A) and joins D's.
        assert_eq!(
            independent_groups_of(&batches, 4),
            vec![vec![0, 1], vec![2], vec![3, 4]]
        );
        for g in independent_groups_of(&batches, 4) {
            let pairs: HashSet<(&str, i64)> = g
                .iter()
                .flat_map(|&i| {
                    let b = &batches[i];
                    b.rows
                        .iter()
                        .map(move |r| (b.voucher_code.as_str(), r.customer_id))
                })
                .collect();
            assert!(pairs.len() <= 4 || g.len() == 1, "{g:?}: {pairs:?}");
        }
    }
}
