//! The decision of a merged transaction (the node-wide group commit), as a pure function over
//! what the transaction read: which rows of which batches insert, which batches are fenced, and
//! what that writes. The SQLite ledger reads and writes it with SQL on its writer, the in-memory
//! [`super::model`] ledger with maps; PostgreSQL runs the same rules server-side
//! (`vouchers_commit_batches_v2`) and passes the same conformance suite.

use std::collections::HashMap;

use super::{plan_batch, resolve_plan, Batch, BatchResults, LedgerError, Planned};
use crate::clock::Millis;
use crate::domain::Reservation;

/// A voucher's rules as a batch needs them.
pub(crate) struct Rules {
    pub per_user_limit: i64,
    pub discount: i64,
    pub status: String,
    pub starts_at: Millis,
    pub ends_at: Millis,
}

/// A lease as the merged transaction found it.
pub(crate) struct LeaseRoom {
    pub voucher_code: String,
    pub active: bool,
    /// Units still unused: `granted - consumed`.
    pub room: i64,
}

/// What a merged transaction reads before it decides: every batch's voucher, lease, stored
/// orders and customers' usage.
#[derive(Default)]
pub(crate) struct MergedReads {
    pub rules: HashMap<String, Rules>,
    pub leases: HashMap<i64, LeaseRoom>,
    /// Reservations already stored under the batches' order ids.
    pub stored: HashMap<String, Reservation>,
    /// `voucher → customer → used`, for the batches' customers that have used the voucher.
    /// Nested, so a row's lookup borrows its voucher code instead of building a key.
    pub used: HashMap<String, HashMap<i64, i64>>,
}

/// A reservation the transaction inserts (its text borrowed from the batch it came in).
pub(crate) struct NewRow<'a> {
    pub order_id: &'a str,
    pub voucher_code: &'a str,
    pub customer_id: i64,
    pub lease_id: i64,
    pub discount_amount: i64,
    pub created_at: Millis,
    pub expires_at: Millis,
}

/// What a merged transaction writes once it decided.
#[derive(Default)]
pub(crate) struct MergedWrites<'a> {
    /// `(lease id, units)`: the fence, one entry per lease drawn on.
    pub consumed: Vec<(i64, i64)>,
    /// The new reservations, in the order the batches gave them (the feed numbers them so).
    pub rows: Vec<NewRow<'a>>,
    /// `(voucher, units)` per voucher whose `reserved` grows.
    pub reserved: Vec<(&'a str, i64)>,
}

/// Decides every batch of a merged transaction, one after the other, each seeing what the ones
/// before it took (order ids, usage, lease room). A batch for an unknown voucher gets
/// `NotFound`; one whose new rows do not fit its lease (gone, or too small) gets `Fenced` and
/// takes nothing.
pub(crate) fn plan_merged(
    batches: &[Batch],
    mut reads: MergedReads,
) -> (BatchResults, MergedWrites<'_>) {
    let mut results = Vec::with_capacity(batches.len());
    let mut consumed: HashMap<i64, i64> = HashMap::new();
    let mut reserved: HashMap<&str, i64> = HashMap::new();
    let mut rows = Vec::with_capacity(batches.iter().map(|b| b.rows.len()).sum());
    let no_usage = HashMap::new();
    for (n, batch) in batches.iter().enumerate() {
        let code = batch.voucher_code.as_str();
        let Some(v) = reads.rules.get(code) else {
            results.push(Err(LedgerError::NotFound));
            continue;
        };
        let existing: Vec<Reservation> = batch
            .rows
            .iter()
            .filter_map(|r| reads.stored.get(&r.order_id).cloned())
            .collect();
        let seen = reads.used.get(code).unwrap_or(&no_usage);
        let used: HashMap<i64, i64> = batch
            .rows
            .iter()
            .map(|r| {
                (
                    r.customer_id,
                    seen.get(&r.customer_id).copied().unwrap_or(0),
                )
            })
            .collect();
        let blocked = super::refuses_new(&v.status, v.starts_at, v.ends_at, batch.now);
        let plan = plan_batch(
            code,
            &batch.rows,
            &existing,
            &used,
            v.per_user_limit,
            blocked,
            batch.now,
        );
        let inserts: Vec<usize> = plan
            .iter()
            .enumerate()
            .filter(|(_, p)| matches!(p, Planned::Insert))
            .map(|(i, _)| i)
            .collect();
        let k = inserts.len() as i64;
        if k > 0 {
            // The fence: only an ACTIVE lease of this voucher with room may be drawn on.
            match reads.leases.get_mut(&batch.lease_id) {
                Some(l) if l.active && l.voucher_code == code && l.room >= k => l.room -= k,
                _ => {
                    results.push(Err(LedgerError::Fenced));
                    continue;
                }
            }
            *consumed.entry(batch.lease_id).or_insert(0) += k;
            *reserved.entry(code).or_insert(0) += k;
        }
        let created = super::created_rows(batch, inserts.iter().copied(), v.discount);
        // What later batches of this transaction must see: their order ids and usage. The
        // last batch has none after it.
        let more = n + 1 < batches.len();
        if more && k > 0 {
            let usage = reads.used.entry(code.to_string()).or_default();
            for r in created.values() {
                *usage.entry(r.customer_id).or_insert(0) += 1;
                reads.stored.insert(r.order_id.clone(), r.clone());
            }
        }
        // In row order, so the feed numbers a batch's reservations as the batch gave them.
        for &i in &inserts {
            let (row, r) = (&batch.rows[i], &created[&i]);
            rows.push(NewRow {
                order_id: &row.order_id,
                voucher_code: code,
                customer_id: r.customer_id,
                lease_id: batch.lease_id,
                discount_amount: r.discount_amount,
                created_at: batch.now,
                expires_at: r.expires_at,
            });
        }
        results.push(Ok(resolve_plan(plan, &created)));
    }
    let writes = MergedWrites {
        consumed: consumed.into_iter().collect(),
        rows,
        reserved: reserved.into_iter().collect(),
    };
    (results, writes)
}
