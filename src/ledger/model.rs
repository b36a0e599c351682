//! The model ledger: the ledger's semantics in memory, with no database and no clock of its own
//! (its time is the `now` each call passes in, as on SQLite; PostgreSQL judges liveness on its
//! own clock). It passes the same conformance suite as SQLite and PostgreSQL
//! (`tests/api/ledger.rs`), which is what keeps it from drifting from them, and it is what a
//! deterministic simulation runs the engine against: every call is a step under one lock, so
//! calls are serializable, as the SQL ledgers' transactions are.
//!
//! The merged commit's decision is [`super::merged::plan_merged`], the same function the SQLite
//! ledger runs; everything else is written out here over maps. It keeps the same rows the SQL
//! schemas keep (vouchers with their counters, leases, reservations with their feed numbers,
//! per-customer usage, switches, holders and their beats), so the reconciler's verdict in
//! [`Ledger::counters`] is computed from rows exactly as the SQL ledgers compute it.
//!
//! Where the SQL schemas refuse a row with a CHECK constraint (DESIGN §3's last line of
//! defence), the model asserts the same after each change and panics: there a broken constraint
//! is a bug of the protocol or of the model, which a simulation must report, not a refusal to
//! carry on from. A voucher the schema would refuse at creation gets `Invalid`.
//!
//! Known differences, none of which the engine relies on: results whose order SQL leaves open
//! come sorted; a merged commit is one atomic step (PostgreSQL may split one into several calls
//! of one transaction); the expiry sweep takes the oldest reservations first and numbers their
//! events in that order; voucher rate limits are kept as given, not clamped to `i32`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};

use async_trait::async_trait;

use super::merged::{plan_merged, LeaseRoom, MergedReads, Rules};
use super::{
    group_restocks, holder_name, is_incarnation, split_holder, Batch, BatchResults, Beat, Closing,
    Counters, Grant, Incarnation, Lease, Ledger, LedgerError, LiveUnits, Restock,
};
use crate::clock::Millis;
use crate::domain::{
    EventKind, FeedEvent, Reservation, ReservationStatus, Switches, SwitchesPatch, Voucher,
    VoucherPatch, VoucherStatus,
};

/// A voucher's row: its definition and its counters.
#[derive(Debug, Clone)]
struct VoucherRow {
    voucher: Voucher,
    /// When it was created (the creating node's clock).
    created_at: Millis,
    free: i64,
    reserved: i64,
    confirmed: i64,
    released: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseState {
    Active,
    Returned,
    Reaped,
}

#[derive(Debug, Clone)]
struct LeaseRow {
    voucher_code: String,
    holder: String,
    granted: i64,
    consumed: i64,
    state: LeaseState,
    expires_at: Millis,
}

#[derive(Debug, Clone)]
struct ReservationRow {
    r: Reservation,
    created_at: Millis,
    updated_at: Millis,
    /// The feed number of its RESERVED event.
    reserved_seq: i64,
    /// The feed number of its second event (confirmed, released or expired), once it had one.
    settled_seq: Option<i64>,
    /// Released by the expiry sweep rather than by its customer.
    expired: bool,
}

/// A lease holder's beat row.
#[derive(Debug, Clone)]
struct NodeRow {
    name: String,
    incarnation: i64,
    beat_at: Millis,
    /// Since when it has beaten without a gap (a silence over half its limit starts it again).
    streak_from: Millis,
    /// Its own limit: silent for longer, it is dead.
    dead_after: i64,
}

#[derive(Debug, Default)]
struct State {
    vouchers: BTreeMap<String, VoucherRow>,
    leases: BTreeMap<i64, LeaseRow>,
    last_lease_id: i64,
    /// By order id (order ids are unique across vouchers, as the SQL schemas make them).
    reservations: HashMap<String, ReservationRow>,
    usage: HashMap<(String, i64), i64>,
    switches: Switches,
    /// The feed's last number handed out.
    feed_last: i64,
    /// Each node name's last incarnation number (never reused).
    node_names: HashMap<String, i64>,
    nodes: BTreeMap<String, NodeRow>,
    /// The vouchers an operator watches.
    watched: BTreeSet<String>,
}

/// One voucher's rows, raw: see [`ModelLedger::raw_rows`].
#[derive(Debug, Clone)]
pub struct RawRows {
    pub total_limit: i64,
    pub per_user_limit: i64,
    pub free: i64,
    /// The voucher row's own counters: reserved, confirmed, released.
    pub kept: [i64; 3],
    /// Every lease of the voucher: (active, granted, consumed).
    pub leases: Vec<(bool, i64, i64)>,
    /// Every reservation of the voucher: (customer, status).
    pub reservations: Vec<(i64, ReservationStatus)>,
    /// Each customer's kept usage.
    pub usage: Vec<(i64, i64)>,
}

/// The in-memory ledger. Cheap to make: a simulation makes one per run.
pub struct ModelLedger {
    state: Mutex<State>,
    origin: String,
}

impl ModelLedger {
    /// One voucher's counters, from the model's state `s` (one lock for all of a call's codes).
    fn counters_of(s: &State, code: &str) -> Option<Counters> {
        let v = s.vouchers.get(code)?;
        let mut by_status: HashMap<&str, i64> = HashMap::new();
        for row in s.reservations.values().filter(|r| r.r.voucher_code == code) {
            *by_status.entry(row.r.status.as_str()).or_insert(0) += 1;
        }
        let by_status: Vec<(String, i64)> = by_status
            .into_iter()
            .map(|(k, n)| (k.to_string(), n))
            .collect();
        let consumed = s
            .leases
            .values()
            .filter(|l| l.voucher_code == code)
            .map(|l| l.consumed)
            .sum();
        let usage = s
            .usage
            .iter()
            .filter(|((c, _), _)| c == code)
            .map(|(_, n)| n)
            .sum();
        let counters = Counters {
            total_limit: v.voucher.total_limit,
            free: v.free,
            leased_unused: s.leased_unused(code),
            reserved: v.reserved,
            confirmed: v.confirmed,
            released: v.released,
            balanced: false,
        };
        Some(super::reconcile(counters, &by_status, consumed, usage))
    }

    /// The ACTIVE leases of `code` with units left: `(id, holder, unused, expires_at)`, for a
    /// simulation's diagnosis of where units sit.
    pub fn unused_leases(&self, code: &str) -> Vec<(i64, String, i64, Millis)> {
        self.state()
            .leases
            .iter()
            .filter(|(_, l)| l.voucher_code == code && l.state == LeaseState::Active)
            .filter(|(_, l)| l.granted > l.consumed)
            .map(|(id, l)| (*id, l.holder.clone(), l.granted - l.consumed, l.expires_at))
            .collect()
    }

    /// One voucher's rows as they stand, for a checker that recomputes the books itself (the
    /// simulator) rather than asking [`super::reconcile`].
    pub fn raw_rows(&self, code: &str) -> Option<RawRows> {
        let s = self.state();
        let v = s.vouchers.get(code)?;
        Some(RawRows {
            total_limit: v.voucher.total_limit,
            per_user_limit: v.voucher.per_user_limit,
            free: v.free,
            kept: [v.reserved, v.confirmed, v.released],
            leases: s
                .leases
                .values()
                .filter(|l| l.voucher_code == code)
                .map(|l| (l.state == LeaseState::Active, l.granted, l.consumed))
                .collect(),
            reservations: s
                .reservations
                .values()
                .filter(|r| r.r.voucher_code == code)
                .map(|r| (r.r.customer_id, r.r.status))
                .collect(),
            usage: s
                .usage
                .iter()
                .filter(|((c, _), _)| c == code)
                .map(|((_, customer), n)| (*customer, *n))
                .collect(),
        })
    }

    /// An empty ledger whose feed calls itself `origin`.
    pub fn new(origin: &str) -> Self {
        Self {
            state: Mutex::new(State::default()),
            origin: origin.to_string(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock can only come from a bug in this module; the state is
        // still the last complete step, as no step writes before it has decided.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    fn leased_unused(&self, code: &str) -> i64 {
        self.leases
            .values()
            .filter(|l| l.voucher_code == code && l.state == LeaseState::Active)
            .map(|l| l.granted - l.consumed)
            .sum()
    }

    /// Closes the ACTIVE leases `which` names; their unused units go back to `free`.
    fn close(&mut self, which: Closing<'_>) -> Vec<Restock> {
        let (id, holder, expired_by) = which.params();
        let state = match which.state() {
            "REAPED" => LeaseState::Reaped,
            _ => LeaseState::Returned,
        };
        let mut back = Vec::new();
        for (lease_id, l) in self.leases.iter_mut() {
            let picked = l.state == LeaseState::Active
                && id.is_none_or(|id| id == *lease_id)
                && holder.as_deref().is_none_or(|h| h == l.holder)
                && expired_by.is_none_or(|t| l.expires_at <= t);
            if picked {
                l.state = state;
                back.push((l.voucher_code.clone(), l.granted - l.consumed));
            }
        }
        let restocks = group_restocks(back);
        for r in &restocks {
            if let Some(v) = self.vouchers.get_mut(&r.voucher_code) {
                v.free += r.units;
            }
            self.assert_rows(&r.voucher_code);
        }
        restocks
    }

    /// Releases the reservations `orders` (all RESERVED): each unit back to `free`, each
    /// customer's usage down by one, each change numbered in the feed in the order given.
    fn release_rows(&mut self, orders: &[String], now: Millis, expired: bool) -> Vec<Restock> {
        let mut back = Vec::new();
        for order in orders {
            let Some(row) = self.reservations.get_mut(order) else {
                continue;
            };
            self.feed_last += 1;
            row.r.status = ReservationStatus::Released;
            row.updated_at = now;
            row.settled_seq = Some(self.feed_last);
            row.expired = expired;
            let code = row.r.voucher_code.clone();
            if let Some(v) = self.vouchers.get_mut(&code) {
                v.free += 1;
                v.reserved -= 1;
                v.released += 1;
            }
            if let Some(n) = self.usage.get_mut(&(code.clone(), row.r.customer_id)) {
                *n -= 1;
            }
            self.assert_rows(&code);
            back.push((code, 1));
        }
        group_restocks(back)
    }

    /// The CHECK constraints of a voucher's row and of its customers' usage (see the module doc).
    fn assert_rows(&self, code: &str) {
        let Some(v) = self.vouchers.get(code) else {
            return;
        };
        let total = v.voucher.total_limit;
        assert!(
            v.free >= 0 && v.reserved >= 0 && v.confirmed >= 0 && v.released >= 0,
            "{code}: a counter went negative: {v:?}"
        );
        assert!(
            v.free + v.reserved + v.confirmed <= total,
            "{code}: free + reserved + confirmed passed the total: {v:?}"
        );
        for ((c, customer), used) in &self.usage {
            assert!(
                c != code || *used >= 0,
                "{code}: customer {customer}'s usage went negative"
            );
        }
    }

    fn reservation(&self, code: &str, order_id: &str) -> Result<Reservation, LedgerError> {
        self.reservations
            .get(order_id)
            .filter(|row| row.r.voucher_code == code)
            .map(|row| row.r.clone())
            .ok_or(LedgerError::NotFound)
    }

    fn commit(&mut self, batches: &[Batch]) -> BatchResults {
        let mut reads = MergedReads::default();
        for b in batches {
            if let Some(v) = self.vouchers.get(&b.voucher_code) {
                let rules = Rules {
                    per_user_limit: v.voucher.per_user_limit,
                    discount: v.voucher.discount_amount,
                    status: v.voucher.status.as_str().to_string(),
                    starts_at: v.voucher.starts_at,
                    ends_at: v.voucher.ends_at,
                };
                reads.rules.insert(b.voucher_code.clone(), rules);
            }
            if let Some(l) = self.leases.get(&b.lease_id) {
                let room = LeaseRoom {
                    voucher_code: l.voucher_code.clone(),
                    active: l.state == LeaseState::Active,
                    room: l.granted - l.consumed,
                };
                reads.leases.insert(b.lease_id, room);
            }
            for row in &b.rows {
                if let Some(stored) = self.reservations.get(&row.order_id) {
                    reads.stored.insert(row.order_id.clone(), stored.r.clone());
                }
                let key = (b.voucher_code.clone(), row.customer_id);
                if let Some(&n) = self.usage.get(&key) {
                    reads
                        .used
                        .entry(key.0)
                        .or_default()
                        .insert(row.customer_id, n);
                }
            }
        }
        let (results, writes) = plan_merged(batches, reads);
        for (lease_id, k) in &writes.consumed {
            if let Some(l) = self.leases.get_mut(lease_id) {
                l.consumed += k;
                assert!(
                    l.consumed <= l.granted,
                    "lease {lease_id}: consumed passed granted: {l:?}"
                );
            }
        }
        for row in writes.rows {
            // A customer's usage grows with each of their new rows.
            *self
                .usage
                .entry((row.voucher_code.to_string(), row.customer_id))
                .or_insert(0) += 1;
            self.feed_last += 1;
            let r = Reservation {
                order_id: row.order_id.to_string(),
                voucher_code: row.voucher_code.to_string(),
                customer_id: row.customer_id,
                discount_amount: row.discount_amount,
                status: ReservationStatus::Reserved,
                expires_at: row.expires_at,
            };
            let stored = ReservationRow {
                r,
                created_at: row.created_at,
                updated_at: row.created_at,
                reserved_seq: self.feed_last,
                settled_seq: None,
                expired: false,
            };
            self.reservations.insert(row.order_id.to_string(), stored);
        }
        for (code, n) in writes.reserved {
            if let Some(v) = self.vouchers.get_mut(code) {
                v.reserved += n;
            }
            self.assert_rows(code);
        }
        results
    }

    fn events(&self, after: i64, limit: i64) -> Vec<FeedEvent> {
        let upto = after.saturating_add(limit.max(0));
        let within = |seq: i64| seq > after && seq <= upto;
        let mut out: Vec<FeedEvent> = Vec::new();
        for row in self.reservations.values() {
            let event = |seq: i64, kind: EventKind, at: Millis| FeedEvent {
                seq,
                kind,
                voucher_code: row.r.voucher_code.clone(),
                order_id: row.r.order_id.clone(),
                customer_id: row.r.customer_id,
                at,
            };
            if within(row.reserved_seq) {
                out.push(event(row.reserved_seq, EventKind::Reserved, row.created_at));
            }
            if let Some(seq) = row.settled_seq.filter(|s| within(*s)) {
                let kind = match (row.r.status, row.expired) {
                    (ReservationStatus::Confirmed, _) => EventKind::Confirmed,
                    (_, true) => EventKind::Expired,
                    _ => EventKind::Released,
                };
                out.push(event(seq, kind, row.updated_at));
            }
        }
        out.sort_by_key(|e| e.seq);
        out.truncate(limit.max(0) as usize);
        out
    }
}

#[async_trait]
impl Ledger for ModelLedger {
    async fn ping(&self) -> Result<(), LedgerError> {
        Ok(())
    }

    async fn create_voucher(&self, voucher: &Voucher, now: Millis) -> Result<(), LedgerError> {
        let v = voucher;
        if v.discount_amount < 0
            || v.min_order_amount < 0
            || v.total_limit < 0
            || v.per_user_limit < 1
            || v.starts_at >= v.ends_at
        {
            return Err(LedgerError::Invalid("the schema refuses this voucher"));
        }
        let mut s = self.state();
        if s.vouchers.contains_key(&voucher.code) {
            return Err(LedgerError::AlreadyExists);
        }
        let row = VoucherRow {
            voucher: voucher.clone(),
            created_at: now,
            free: voucher.total_limit,
            reserved: 0,
            confirmed: 0,
            released: 0,
        };
        s.vouchers.insert(voucher.code.clone(), row);
        Ok(())
    }

    async fn voucher(&self, code: &str) -> Result<Option<Voucher>, LedgerError> {
        Ok(self.state().vouchers.get(code).map(|v| v.voucher.clone()))
    }

    async fn voucher_stock(&self, code: &str) -> Result<Option<(Voucher, i64)>, LedgerError> {
        let s = self.state();
        Ok(s.vouchers
            .get(code)
            .map(|v| (v.voucher.clone(), v.free + s.leased_unused(code))))
    }

    async fn update_voucher(
        &self,
        code: &str,
        patch: &VoucherPatch,
    ) -> Result<(Voucher, Option<Restock>), LedgerError> {
        let mut s = self.state();
        let row = s.vouchers.get_mut(code).ok_or(LedgerError::NotFound)?;
        let (next, added) = super::apply_patch(&row.voucher, patch)?;
        row.voucher = next.clone();
        row.free += added;
        s.assert_rows(code);
        Ok((next, Restock::of(code, added)))
    }

    async fn grant(
        &self,
        code: &str,
        node: &str,
        want: i64,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Grant, LedgerError> {
        let mut s = self.state();
        if is_incarnation(node) && s.nodes.get(node).is_none_or(|n| n.beat_at == 0) {
            return Err(LedgerError::NotLive);
        }
        let leased_unused = s.leased_unused(code);
        let last_id = s.last_lease_id;
        let v = s.vouchers.get_mut(code).ok_or(LedgerError::NotFound)?;
        let free = v.free;
        let ever_reserved = v.reserved + v.confirmed + v.released;
        let units = want.max(1).min(free);
        let lease = (units > 0).then(|| {
            // `free` cannot go negative: units ≤ free.
            v.free -= units;
            Lease {
                id: last_id + 1,
                granted: units,
                expires_at: now + ttl_ms,
            }
        });
        if let Some(l) = &lease {
            s.last_lease_id = l.id;
            let row = LeaseRow {
                voucher_code: code.to_string(),
                holder: node.to_string(),
                granted: l.granted,
                consumed: 0,
                state: LeaseState::Active,
                expires_at: l.expires_at,
            };
            s.leases.insert(l.id, row);
        }
        Ok(Grant {
            ever_reserved: lease.is_none().then_some(ever_reserved),
            lease,
            free_after: free - units,
            leased_unused,
        })
    }

    async fn renew(
        &self,
        lease_ids: &[i64],
        node: &str,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Vec<i64>, LedgerError> {
        let mut s = self.state();
        let mut renewed = Vec::new();
        for id in lease_ids {
            if let Some(l) = s.leases.get_mut(id) {
                if l.state == LeaseState::Active && l.holder == node {
                    l.expires_at = now + ttl_ms;
                    renewed.push(*id);
                }
            }
        }
        renewed.sort_unstable();
        renewed.dedup();
        Ok(renewed)
    }

    async fn active_leases(&self, code: &str, node: &str) -> Result<Vec<i64>, LedgerError> {
        let s = self.state();
        Ok(s.leases
            .iter()
            .filter(|(_, l)| l.voucher_code == code && l.holder == node)
            .filter(|(_, l)| l.state == LeaseState::Active && l.consumed < l.granted)
            .map(|(id, _)| *id)
            .collect())
    }

    async fn return_lease(
        &self,
        lease_id: i64,
        _now: Millis,
    ) -> Result<Option<Restock>, LedgerError> {
        Ok(self
            .state()
            .close(Closing::Lease(lease_id))
            .into_iter()
            .next())
    }

    async fn return_node_leases(
        &self,
        node: &str,
        _now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        Ok(self.state().close(Closing::Node(node)))
    }

    async fn register_node(
        &self,
        name: &str,
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Incarnation, LedgerError> {
        let mut s = self.state();
        let number = {
            let n = s.node_names.entry(name.to_string()).or_insert(0);
            *n += 1;
            *n
        };
        let holder = holder_name(name, number);
        // Rows of earlier runs that hold nothing any more.
        let holding: Vec<String> = s
            .leases
            .values()
            .filter(|l| l.state == LeaseState::Active)
            .map(|l| l.holder.clone())
            .collect();
        s.nodes
            .retain(|h, n| n.beat_at >= now - n.dead_after || holding.contains(h));
        let row = NodeRow {
            name: name.to_string(),
            incarnation: number,
            beat_at: now,
            streak_from: now,
            dead_after: dead_after_ms.max(1),
        };
        s.nodes.insert(holder.clone(), row);
        let mut live_siblings: Vec<i64> = s
            .nodes
            .values()
            .filter(|n| n.name == name && n.incarnation != number)
            .filter(|n| n.beat_at >= now - n.dead_after)
            .map(|n| n.incarnation)
            .collect();
        live_siblings.sort_unstable();
        Ok(Incarnation {
            holder,
            number,
            live_siblings,
        })
    }

    async fn heartbeat(
        &self,
        holder: &str,
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Beat, LedgerError> {
        let mut s = self.state();
        let dead_after = dead_after_ms.max(1);
        let (name, number) = split_holder(holder);
        let row = s.nodes.entry(holder.to_string()).or_insert(NodeRow {
            name: name.to_string(),
            incarnation: number,
            beat_at: now,
            streak_from: now,
            dead_after,
        });
        if row.beat_at == 0 {
            // Retired: a beat that landed after its own process's retire changes nothing.
            return Err(LedgerError::NotFound);
        }
        if now - row.beat_at > dead_after / 2 {
            row.streak_from = now;
        }
        row.beat_at = now;
        row.dead_after = dead_after;
        let streak = row.beat_at - row.streak_from;
        let dead = s
            .nodes
            .iter()
            .filter(|(h, n)| {
                h.as_str() != holder && n.beat_at < now - n.dead_after && n.dead_after <= streak
            })
            .map(|(h, _)| h.clone())
            .collect();
        // The model has no clock of its own: the ledger's time is the caller's.
        Ok(Beat {
            ledger_ms: now,
            dead,
        })
    }

    async fn reap_holder(&self, holder: &str, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        let mut s = self.state();
        let dead = s
            .nodes
            .get(holder)
            .is_some_and(|n| n.beat_at < now - n.dead_after);
        if !dead {
            return Ok(Vec::new());
        }
        s.nodes.remove(holder);
        Ok(s.close(Closing::Dead(holder)))
    }

    async fn retire_node(&self, holder: &str) -> Result<(), LedgerError> {
        if let Some(n) = self.state().nodes.get_mut(holder) {
            n.beat_at = 0;
            n.dead_after = 1;
        }
        Ok(())
    }

    async fn commit_batches(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        Ok(self.state().commit(batches))
    }

    async fn find_orders(&self, order_ids: &[String]) -> Result<Vec<Reservation>, LedgerError> {
        let s = self.state();
        let mut found: Vec<Reservation> = order_ids
            .iter()
            .filter_map(|o| s.reservations.get(o).map(|row| row.r.clone()))
            .collect();
        found.sort_by(|a, b| a.order_id.cmp(&b.order_id));
        found.dedup_by(|a, b| a.order_id == b.order_id);
        Ok(found)
    }

    async fn won_orders(&self, code: &str) -> Result<Vec<(String, i64)>, LedgerError> {
        let s = self.state();
        let mut won: Vec<(String, i64)> = s
            .reservations
            .values()
            .filter(|row| row.r.voucher_code == code && row.r.status != ReservationStatus::Released)
            .map(|row| (row.r.order_id.clone(), row.r.customer_id))
            .collect();
        won.sort();
        Ok(won)
    }

    async fn customer_usage(
        &self,
        code: &str,
        customers: &[i64],
    ) -> Result<Vec<(i64, i64)>, LedgerError> {
        let s = self.state();
        let mut usage: Vec<(i64, i64)> = customers
            .iter()
            .filter_map(|c| s.usage.get(&(code.to_string(), *c)).map(|n| (*c, *n)))
            .collect();
        usage.sort_unstable();
        usage.dedup();
        Ok(usage)
    }

    async fn confirm(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<Reservation, LedgerError> {
        let mut s = self.state();
        let current = s.reservation(code, order_id)?;
        if current.status != ReservationStatus::Reserved || current.expires_at <= now {
            return super::confirm_unchanged(current);
        }
        s.feed_last += 1;
        let seq = s.feed_last;
        let confirmed = match s.reservations.get_mut(order_id) {
            Some(row) => {
                row.r.status = ReservationStatus::Confirmed;
                row.updated_at = now;
                row.settled_seq = Some(seq);
                row.r.clone()
            }
            None => return Err(LedgerError::NotFound),
        };
        if let Some(v) = s.vouchers.get_mut(code) {
            v.reserved -= 1;
            v.confirmed += 1;
        }
        s.assert_rows(code);
        Ok(confirmed)
    }

    async fn release(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<(Reservation, Option<Restock>), LedgerError> {
        let mut s = self.state();
        let current = s.reservation(code, order_id)?;
        if current.status != ReservationStatus::Reserved {
            return super::release_unchanged(current);
        }
        let restock = s
            .release_rows(&[order_id.to_string()], now, false)
            .into_iter()
            .next();
        Ok((s.reservation(code, order_id)?, restock))
    }

    async fn expire_due(&self, now: Millis, limit: i64) -> Result<Vec<Restock>, LedgerError> {
        let mut s = self.state();
        let mut due: Vec<(i64, String)> = s
            .reservations
            .values()
            .filter(|row| row.r.status == ReservationStatus::Reserved && row.r.expires_at <= now)
            .map(|row| (row.reserved_seq, row.r.order_id.clone()))
            .collect();
        due.sort();
        due.truncate(limit.max(0) as usize);
        let orders: Vec<String> = due.into_iter().map(|(_, o)| o).collect();
        Ok(s.release_rows(&orders, now, true))
    }

    async fn reap_expired(&self, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        Ok(self.state().close(Closing::ExpiredBy(now)))
    }

    async fn counters_many(&self, codes: &[String]) -> Result<Vec<Option<Counters>>, LedgerError> {
        let s = self.state();
        Ok(codes
            .iter()
            .map(|code| Self::counters_of(&s, code))
            .collect())
    }

    async fn live_units(
        &self,
        now: Millis,
        ending_after: Millis,
        codes: &[String],
    ) -> Result<Vec<LiveUnits>, LedgerError> {
        let s = self.state();
        Ok(codes
            .iter()
            .filter_map(|c| s.vouchers.get(c))
            .filter(|v| v.voucher.starts_at <= now && v.voucher.ends_at > ending_after)
            .map(|v| LiveUnits {
                code: v.voucher.code.clone(),
                total_limit: v.voucher.total_limit,
                free: v.free,
                leased_unused: s.leased_unused(&v.voucher.code),
                reserved: v.reserved,
                confirmed: v.confirmed,
                released: v.released,
            })
            .collect())
    }

    async fn starting_between(&self, from: Millis, to: Millis) -> Result<Vec<String>, LedgerError> {
        let s = self.state();
        let mut soon: Vec<(Millis, String)> = s
            .vouchers
            .values()
            .map(|v| &v.voucher)
            .filter(|v| {
                v.status == VoucherStatus::Active && v.starts_at > from && v.starts_at <= to
            })
            .map(|v| (v.starts_at, v.code.clone()))
            .collect();
        soon.sort();
        soon.truncate(1000);
        Ok(soon.into_iter().map(|(_, code)| code).collect())
    }

    async fn switches(&self) -> Result<Switches, LedgerError> {
        Ok(self.state().switches)
    }

    async fn set_switches(
        &self,
        patch: &SwitchesPatch,
        _now: Millis,
    ) -> Result<Switches, LedgerError> {
        let mut s = self.state();
        let sw = &mut s.switches;
        sw.sales_paused = patch.sales_paused.unwrap_or(sw.sales_paused);
        sw.read_only = patch.read_only.unwrap_or(sw.read_only);
        sw.version += 1;
        Ok(*sw)
    }

    async fn voucher_codes(
        &self,
        ending_after: Millis,
        after: &str,
        limit: i64,
    ) -> Result<Vec<String>, LedgerError> {
        let mut codes: Vec<String> = self
            .state()
            .vouchers
            .values()
            .filter(|v| v.voucher.ends_at > ending_after && v.voucher.code.as_str() > after)
            .map(|v| v.voucher.code.clone())
            .collect();
        codes.sort();
        codes.truncate(limit.max(0) as usize);
        Ok(codes)
    }

    async fn codes_created_since(&self, since: Millis) -> Result<Vec<String>, LedgerError> {
        Ok(self
            .state()
            .vouchers
            .values()
            .filter(|v| v.created_at >= since)
            .map(|v| v.voucher.code.clone())
            .collect())
    }

    async fn watched_codes(&self) -> Result<Vec<String>, LedgerError> {
        Ok(self.state().watched.iter().cloned().collect())
    }

    async fn set_watched(&self, code: &str, watched: bool) -> Result<(), LedgerError> {
        let mut s = self.state();
        if !s.vouchers.contains_key(code) {
            return Err(LedgerError::NotFound);
        }
        if watched {
            s.watched.insert(code.to_string());
        } else {
            s.watched.remove(code);
        }
        Ok(())
    }

    async fn events(&self, after: i64, limit: i64) -> Result<Vec<FeedEvent>, LedgerError> {
        Ok(self.state().events(after, limit))
    }

    async fn feed_origin(&self) -> Result<String, LedgerError> {
        Ok(self.origin.clone())
    }
}
