//! The merged group commit on the raw writer ([`super::raw`]): one transaction's reads (each
//! batch's voucher and lease, each row's stored order and its customer's usage), the decision
//! ([`crate::ledger::merged::plan_merged`], shared with the model ledger), and its writes, the
//! fence checked once more in SQL.

use std::collections::HashMap;

use super::raw;
use super::usage::UsageCache;
use crate::domain::{Reservation, ReservationStatus};
use crate::ledger::merged::{plan_merged, LeaseRoom, MergedReads, MergedWrites, Rules};
use crate::ledger::{refuses_new, Batch, BatchResults, LedgerError};

/// A merged transaction's statements. None of them builds a temporary B-tree at each run (see
/// `merged_commit_statements_build_no_temporary_btree`): no `IN (list)` in them or in a CHECK
/// they evaluate, no `RETURNING`.
pub(super) const READ_RULES: &str =
    "SELECT per_user_limit, discount_amount, status, starts_at, ends_at, \
     reserved + confirmed FROM vouchers WHERE code = ?1";
pub(super) const READ_LEASE: &str =
    "SELECT voucher_code, state, granted - consumed FROM leases WHERE id = ?1";
pub(super) const READ_STORED: &str =
    "SELECT voucher_code, customer_id, discount_amount, status, expires_at \
     FROM reservations WHERE order_id = ?1";
pub(super) const FENCE: &str = "UPDATE leases SET consumed = consumed + ?2 \
     WHERE id = ?1 AND state = 'ACTIVE' AND consumed + ?2 <= granted";
pub(super) const FEED_TAKE: &str = "UPDATE feed_head SET last = last + ?1 WHERE id = 1";
pub(super) const FEED_LAST: &str = "SELECT last FROM feed_head WHERE id = 1";
pub(super) const INSERT_RESERVATION: &str =
    "INSERT INTO reservations (order_id, voucher_code, customer_id, \
     lease_id, discount_amount, status, created_at, expires_at, updated_at, reserved_seq) \
     VALUES (?1, ?2, ?3, ?4, ?5, 'RESERVED', ?6, ?7, ?6, ?8)";
pub(super) const COUNT_RESERVED: &str =
    "UPDATE vouchers SET reserved = reserved + ?2 WHERE code = ?1";

/// The reads of a merged transaction: each batch's voucher rules and lease, each row's stored
/// order and (from the writer's counts) its customer's usage.
fn read_merged(
    db: &raw::Db,
    usage: &mut UsageCache,
    batches: &[Batch],
) -> Result<MergedReads, LedgerError> {
    let mut reads = MergedReads::default();
    // Every read is an indexed probe through a statement prepared once per connection. None
    // takes a list: `x IN (list)` builds a temporary B-tree of the list at each run (opening
    // and closing one cost more than the probe), and a set-based read over a JSON array of a
    // hundred ids parses the array into one before it seeks the same index anyway.
    // Each voucher's `reserved + confirmed`, for its usage counts' load.
    let mut books: HashMap<&str, i64> = HashMap::new();
    let mut rules = db.prepare(READ_RULES)?;
    let mut lease = db.prepare(READ_LEASE)?;
    for b in batches {
        if !reads.rules.contains_key(&b.voucher_code) {
            rules.bind_text(1, &b.voucher_code)?;
            if rules.step()? {
                let found = Rules {
                    per_user_limit: rules.int(0),
                    discount: rules.int(1),
                    status: rules.text(2),
                    starts_at: rules.int(3),
                    ends_at: rules.int(4),
                };
                usage.agrees(&b.voucher_code, rules.int(5));
                books.insert(b.voucher_code.as_str(), rules.int(5));
                reads.rules.insert(b.voucher_code.clone(), found);
            }
            rules.reset();
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = reads.leases.entry(b.lease_id) {
            lease.bind_int(1, b.lease_id)?;
            if lease.step()? {
                slot.insert(LeaseRoom {
                    voucher_code: lease.text(0),
                    active: lease.text(1) == "ACTIVE",
                    room: lease.int(2),
                });
            }
            lease.reset();
        }
    }
    let mut stored = db.prepare(READ_STORED)?;
    for b in batches {
        // A batch of an unknown voucher, or of one that takes no new reservations now, is
        // refused whole: no counts to load for it.
        let known = reads
            .rules
            .get(&b.voucher_code)
            .is_some_and(|r| refuses_new(&r.status, r.starts_at, r.ends_at, b.now).is_none());
        let counts = if known {
            let books = books.get(b.voucher_code.as_str()).copied();
            Some(usage.voucher(db, &b.voucher_code, books)?)
        } else {
            None
        };
        for row in &b.rows {
            stored.bind_text(1, &row.order_id)?;
            if stored.step()? {
                let status = stored.text(3);
                let r = Reservation {
                    order_id: row.order_id.clone(),
                    voucher_code: stored.text(0),
                    customer_id: stored.int(1),
                    discount_amount: stored.int(2),
                    status: ReservationStatus::parse(&status)
                        .ok_or(LedgerError::Inconsistent("stored reservation status"))?,
                    expires_at: stored.int(4),
                };
                reads.stored.insert(r.order_id.clone(), r);
            }
            stored.reset();
            let used = counts.map_or(0, |c| c.of(row.customer_id));
            if used > 0 {
                reads
                    .used
                    .entry(b.voucher_code.clone())
                    .or_default()
                    .insert(row.customer_id, used);
            }
        }
    }
    Ok(reads)
}

/// The four writes of a merged transaction. The fence is checked once more in SQL: a lease
/// that lost its room since the read (only another writer could do that) fails the whole
/// transaction rather than commit past it.
fn write_merged(db: &raw::Db, w: &MergedWrites) -> Result<(), LedgerError> {
    if w.rows.is_empty() {
        return Ok(());
    }
    // The fence once more, per lease: a lease that lost its room since the read (only another
    // writer could do that) fails the whole transaction.
    let mut fence = db.prepare(FENCE)?;
    for &(lease, units) in &w.consumed {
        fence.bind_int(1, lease)?;
        fence.bind_int(2, units)?;
        fence.execute()?;
        if db.changes() != 1 {
            return Err(LedgerError::database("lease changed under a merged commit"));
        }
    }
    drop(fence);
    // The feed's numbers for the new rows, in the rows' order (the writer is alone: nobody
    // takes numbers in between). An update and a read rather than `UPDATE … RETURNING`, which
    // SQLite runs through a temporary B-tree of the returned rows, opened at every commit.
    let n = w.rows.len() as i64;
    let mut take = db.prepare(FEED_TAKE)?;
    take.bind_int(1, n)?;
    if db.run(take)? != 1 {
        return Err(LedgerError::Inconsistent("feed_head row missing"));
    }
    let base = {
        let mut last = db.prepare(FEED_LAST)?;
        if !last.step()? {
            return Err(LedgerError::Inconsistent("feed_head row missing"));
        }
        last.int(0) - n
    };
    // One prepared insert, run once per row: cheaper than one statement over a JSON array,
    // where every column of every row is a `json_extract` of its element.
    let mut insert = db.prepare(INSERT_RESERVATION)?;
    for (seq, r) in (base + 1..).zip(&w.rows) {
        insert.bind_text(1, r.order_id)?;
        insert.bind_text(2, r.voucher_code)?;
        insert.bind_int(3, r.customer_id)?;
        insert.bind_int(4, r.lease_id)?;
        insert.bind_int(5, r.discount_amount)?;
        insert.bind_int(6, r.created_at)?;
        insert.bind_int(7, r.expires_at)?;
        insert.bind_int(8, seq)?;
        // A row that cannot go in (an order id stored meanwhile) fails here, and the whole
        // transaction with it: nothing of it is acknowledged.
        insert.execute()?;
    }
    drop(insert);
    let mut counted = db.prepare(COUNT_RESERVED)?;
    for (code, units) in &w.reserved {
        counted.bind_text(1, code)?;
        counted.bind_int(2, *units)?;
        counted.execute()?;
    }
    Ok(())
}

/// One merged transaction, start to commit, on the calling thread; the writer's usage counts
/// take its new rows once it committed.
pub(super) fn apply_merged(
    db: &raw::Db,
    usage: &mut UsageCache,
    batches: &[Batch],
) -> Result<BatchResults, LedgerError> {
    let tx = db.begin()?;
    usage.check_writers(db)?;
    let reads = read_merged(db, usage, batches)?;
    let (results, writes) = plan_merged(batches, reads);
    write_merged(db, &writes)?;
    tx.commit()?;
    // The rows come batch by batch: one lookup per run of one voucher's rows.
    for rows in writes
        .rows
        .chunk_by(|a, b| a.voucher_code == b.voucher_code)
    {
        usage.taken(rows[0].voucher_code, rows.iter().map(|r| r.customer_id));
    }
    usage.tidy();
    Ok(results)
}
