//! The invariants the simulator checks, from the ledger's rows and the answers the clients saw:
//! never the engine's own view of itself.

use std::collections::BTreeMap;

use super::ready;
use super::rng::Rng;
use crate::clock::Millis;
use crate::domain::{Ineligible, Reservation, ReservationStatus};
use crate::engine::quota::Reply;
use crate::engine::EngineError;
use crate::engine::Reserved;
use crate::ledger::model::ModelLedger;
use crate::ledger::{Counters, LedgerError, RowOutcome, SharedLedger};

/// What a check found broken: what, and the voucher involved if one is (the trace is trimmed to
/// it). The runner makes it a [`super::Violation`] with the round, step and time it was found.
pub(super) type Finding = (String, Option<String>);

/// What the clients were told, and when the ledger stored each order.
#[derive(Default)]
pub(super) struct Books {
    /// Every order answered `201`: the reservation as first answered, and when.
    acked: BTreeMap<String, (Reservation, Millis)>,
    /// Every order the ledger created, and when (whether or not its answer reached anyone).
    stored_at: BTreeMap<String, Millis>,
}

impl Books {
    /// An acknowledged order of `code` that was not released, to release.
    pub(super) fn pick_acked(&self, rng: &mut Rng, code: &str) -> Option<String> {
        let live: Vec<&String> = self
            .acked
            .iter()
            .filter(|(_, (r, _))| r.voucher_code == code && r.status != ReservationStatus::Released)
            .map(|(o, _)| o)
            .collect();
        (!live.is_empty()).then(|| live[(rng.next() % live.len() as u64) as usize].clone())
    }

    /// The customer released `order`: a later refusal of it is right.
    pub(super) fn released(&mut self, order: &str) {
        if let Some((r, _)) = self.acked.get_mut(order) {
            r.status = ReservationStatus::Released;
        }
    }

    /// When the ledger stored `order`, if it did.
    pub(super) fn stored_at(&self, order: &str) -> Option<Millis> {
        self.stored_at.get(order).copied()
    }

    /// Records the orders a commit created at `now`.
    pub(super) fn stored(&mut self, res: &Result<Vec<RowOutcome>, LedgerError>, now: Millis) {
        for o in res.iter().flatten() {
            if let RowOutcome::Created(r) = o {
                self.stored_at.entry(r.order_id.clone()).or_insert(now);
            }
        }
    }

    /// Every acknowledged order is in the ledger, as it was answered.
    /// `ledgers`: every shard's (an order is found on its voucher's).
    pub(super) fn all_durable(&self, ledgers: &[SharedLedger]) -> Result<(), Finding> {
        let orders: Vec<String> = self.acked.keys().cloned().collect();
        let mut found = Vec::new();
        for ledger in ledgers {
            found.extend(
                ready(ledger.find_orders(&orders))
                    .map_err(|e| (format!("find_orders: {e}"), None))?,
            );
        }
        let found: BTreeMap<&str, &Reservation> =
            found.iter().map(|r| (r.order_id.as_str(), r)).collect();
        for (order, (r, _)) in &self.acked {
            match found.get(order.as_str()) {
                Some(row) if same(row, r) => {}
                other => {
                    return Err((
                        format!(
                        "durability: {order} was answered 201 as {r:?}; the ledger holds {other:?}"
                    ),
                        Some(r.voucher_code.clone()),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// The same reservation (its status may have moved on).
fn same(a: &Reservation, b: &Reservation) -> bool {
    a.order_id == b.order_id
        && a.voucher_code == b.voucher_code
        && a.customer_id == b.customer_id
        && a.expires_at == b.expires_at
        && a.discount_amount == b.discount_amount
}

pub(super) fn counters(ledger: &SharedLedger, code: &str) -> Result<Counters, Finding> {
    match ready(ledger.counters(code)) {
        Ok(Some(c)) => Ok(c),
        other => Err((format!("counters of {code}: {other:?}"), Some(code.into()))),
    }
}

/// DESIGN §3's accounting equation, recomputed here from the model ledger's rows (not by the
/// production `ledger::reconcile`, whose verdict this must not take): `total = free + unused in
/// active leases + reserved + confirmed` with the statuses counted from the reservation rows,
/// never more sold than the total, every lease's consumption a reservation row, the voucher's
/// kept counters and each customer's kept usage equal to the rows; and the ACTIVE leases with
/// units left add up to the unused units.
pub(super) fn balanced(
    _ledger: &SharedLedger,
    code: &str,
    model: &ModelLedger,
) -> Result<(), Finding> {
    let Some(rows) = model.raw_rows(code) else {
        return Err((format!("accounting: {code} has no row"), Some(code.into())));
    };
    let off = |what: String| Err((format!("accounting: {code}: {what}"), Some(code.into())));
    let status =
        |s: ReservationStatus| rows.reservations.iter().filter(|(_, st)| *st == s).count() as i64;
    let (reserved, confirmed, released) = (
        status(ReservationStatus::Reserved),
        status(ReservationStatus::Confirmed),
        status(ReservationStatus::Released),
    );
    let leased_unused: i64 = rows
        .leases
        .iter()
        .filter(|(active, _, _)| *active)
        .map(|(_, g, c)| g - c)
        .sum();
    let consumed: i64 = rows.leases.iter().map(|(_, _, c)| c).sum();
    if rows.total_limit != rows.free + leased_unused + reserved + confirmed {
        return off(format!(
            "total {} != free {} + leased unused {leased_unused} + reserved {reserved} + \
             confirmed {confirmed}",
            rows.total_limit, rows.free
        ));
    }
    if reserved + confirmed > rows.total_limit || rows.free < 0 {
        return off(format!("oversold: {rows:?}"));
    }
    if consumed != reserved + confirmed + released {
        return off(format!(
            "leases consumed {consumed} != {} reservation rows",
            reserved + confirmed + released
        ));
    }
    if rows.kept != [reserved, confirmed, released] {
        return off(format!(
            "kept counters {:?} != rows {:?}",
            rows.kept,
            [reserved, confirmed, released]
        ));
    }
    let mut live: BTreeMap<i64, i64> = BTreeMap::new();
    for (customer, st) in &rows.reservations {
        if *st != ReservationStatus::Released {
            *live.entry(*customer).or_insert(0) += 1;
        }
    }
    let usage: BTreeMap<i64, i64> = rows
        .usage
        .iter()
        .copied()
        .filter(|(_, n)| *n != 0)
        .collect();
    if usage != live {
        return off(format!(
            "usage {usage:?} != live rows per customer {live:?}"
        ));
    }
    let leases = model.unused_leases(code);
    let unused: i64 = leases.iter().map(|(_, _, u, _)| u).sum();
    let odd = leases
        .iter()
        .any(|(id, h, u, _)| *id < 1 || h.is_empty() || *u < 1);
    if unused != leased_unused || odd {
        return off(format!(
            "leases {leases:?} do not add up to {leased_unused} unused"
        ));
    }
    Ok(())
}

/// Checks one answer a client saw, `sent` being when its attempt left and `now` when the answer
/// arrived: a `201` is durable, the same reservation as every other `201` of the order, and keeps
/// its customer within the limit (counted in live reservation rows); a refusal never answers a
/// retry of an order the ledger stored before the attempt was sent and still holds live, with
/// `skew` for how far the nodes' clocks may be off (a node ahead rightly takes a reservation
/// about to expire for expired).
#[allow(clippy::too_many_arguments)]
pub(super) fn answer(
    ledger: &SharedLedger,
    books: &mut Books,
    order: &str,
    customer: i64,
    code: &str,
    per_user: i64,
    reply: &Reply,
    sent: Millis,
    now: Millis,
    skew: Millis,
    excused: bool,
) -> Result<(), Finding> {
    let broken = |what: String| Err((what, Some(code.to_string())));
    let stored = |ledger: &SharedLedger| {
        ready(ledger.find_orders(&[order.to_string()]))
            .map_err(|e| (format!("find_orders: {e}"), None))
    };
    match reply {
        Ok(Reserved { reservation: r, .. }) => {
            if r.order_id != order || r.customer_id != customer || r.voucher_code != code {
                return broken(format!("{} got another order's reservation: {r:?}", order));
            }
            let rows = stored(ledger)?;
            if !rows.iter().any(|s| same(s, r)) {
                return broken(format!(
                    "durability: {} answered 201 but the ledger holds {rows:?}",
                    order
                ));
            }
            match books.acked.get(order) {
                Some((first, _)) if !same(first, r) => {
                    return broken(format!(
                        "idempotency: {} answered 201 as {r:?}, before as {first:?}",
                        order
                    ))
                }
                Some(_) => {}
                None => {
                    books.acked.insert(order.to_string(), (r.clone(), now));
                }
            }
            let won =
                ready(ledger.won_orders(code)).map_err(|e| (format!("won_orders: {e}"), None))?;
            let live = won.iter().filter(|(_, c)| *c == customer).count() as i64;
            if live > per_user {
                return broken(format!(
                    "limit: customer {} holds {live} live reservations of {code} (limit {per_user})",
                    customer
                ));
            }
        }
        // A node whose clock runs behind answers 422 NOT_STARTED until its clock gets to the
        // start (see `quota::VoucherCore::admit`): late, not wrong. 503 is checked by the world.
        Err(EngineError::Unavailable | EngineError::NotEligible(Ineligible::NotStarted)) => {}
        // A sold-out flag answered OUT_OF_STOCK while a RESTOCK published before the order was
        // stored was on its way to its node: signals are asynchronous, and until one arrives
        // (or the next probe) the flag cannot know the order that won the restocked unit.
        Err(EngineError::OutOfStock) if excused => {}
        Err(e) => {
            let Some(&stored_at) = books.stored_at.get(order) else {
                return Ok(());
            };
            if stored_at >= sent {
                return Ok(());
            }
            let released = books
                .acked
                .get(order)
                .is_some_and(|(r, _)| r.status == ReservationStatus::Released);
            let live = !released
                && stored(ledger)?.iter().any(|s| {
                    s.customer_id == customer
                        && s.voucher_code == code
                        && match s.status {
                            ReservationStatus::Confirmed => true,
                            ReservationStatus::Reserved => s.expires_at > now + skew,
                            ReservationStatus::Released => false,
                        }
                });
            if live {
                return broken(format!(
                    "replay refused: {} (stored at {stored_at}) got {e:?} on a retry sent at {sent}",
                    order
                ));
            }
        }
    }
    Ok(())
}
