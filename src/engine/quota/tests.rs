//! The protocol, one rule per test: events in, commands out.

use super::*;
use crate::config::Settings;
use crate::domain::{Reservation, ReservationStatus, VoucherLimits, VoucherStatus};
use crate::ledger::Lease;

type TestCore = VoucherCore<u32, u32>;
type Out = Vec<Command<u32, u32>>;

const T0: Millis = 1_000_000;

fn voucher(total: i64) -> Voucher {
    Voucher {
        code: "V".into(),
        discount_amount: 10,
        min_order_amount: 0,
        total_limit: total,
        per_user_limit: 1,
        starts_at: 0,
        ends_at: T0 * 10,
        status: VoucherStatus::Active,
        limits: VoucherLimits::default(),
    }
}

fn req(n: u32) -> ReserveRequest {
    ReserveRequest {
        customer_id: n as i64,
        order_id: format!("o{n}"),
        order_amount: 100,
    }
}

fn reservation(n: u32) -> Reservation {
    Reservation {
        order_id: format!("o{n}"),
        voucher_code: "V".into(),
        customer_id: n as i64,
        discount_amount: 10,
        status: ReservationStatus::Reserved,
        expires_at: T0 + 1000,
    }
}

fn lease(id: i64, granted: i64, free_after: i64) -> Result<Grant, LedgerError> {
    Ok(Grant {
        lease: Some(Lease {
            id,
            granted,
            expires_at: T0 + 30_000,
        }),
        free_after,
        leased_unused: 0,
        ever_reserved: None,
    })
}

fn empty(leased_unused: i64, ever_reserved: i64) -> Result<Grant, LedgerError> {
    Ok(Grant {
        lease: None,
        free_after: 0,
        leased_unused,
        ever_reserved: Some(ever_reserved),
    })
}

fn failed() -> LedgerError {
    LedgerError::Deadline
}

struct Rig {
    core: TestCore,
    shared: Arc<VoucherShared>,
    now: Millis,
    gate: Gate,
}

impl Rig {
    /// A core whose voucher is loaded.
    fn new() -> Self {
        Self::with(|_| {})
    }

    fn with(edit: impl FnOnce(&mut EngineSettings)) -> Self {
        let mut settings = Settings::defaults().engine;
        edit(&mut settings);
        let sizing = SizingParams::from(&settings);
        let shared = Arc::new(VoucherShared::default());
        let core = TestCore::new("V".into(), settings, sizing, shared.clone(), T0);
        let mut rig = Self {
            core,
            shared,
            now: T0,
            gate: Gate::Open,
        };
        assert!(
            rig.out().is_empty(),
            "a core calls nothing before its first event"
        );
        let first = rig.on(Event::Tick);
        assert!(matches!(first[..], [Command::ReadVoucher { first: true }]));
        rig.on(Event::VoucherRead {
            first: true,
            res: Ok(Some(voucher(100))),
        });
        rig
    }

    fn on(&mut self, event: Event<u32, u32>) -> Out {
        self.core.handle(self.now, self.gate, event);
        self.out()
    }

    fn out(&mut self) -> Out {
        self.core.commands().collect()
    }

    /// The core asks the ledger for units (whatever it was doing).
    fn asks_for_units(&mut self) {
        self.core.start_grant();
        self.out();
    }

    /// The core asks for units and the grant fails.
    fn grant_fails(&mut self) {
        self.asks_for_units();
        self.on(Event::Granted(Err(failed())));
    }

    /// Batch `id` lands with order `n` created.
    fn created(&mut self, id: u64, n: u32) -> Out {
        self.on(Event::Committed {
            id,
            res: Ok(vec![RowOutcome::Created(reservation(n))]),
        })
    }

    /// A reserve, its grant of `units`: the batch it starts.
    fn served(&mut self, n: u32, units: i64) -> (u64, Batch) {
        let out = self.on(Event::Reserve(req(n), n));
        assert!(matches!(out[..], [Command::Grant { .. }]), "{out:?}");
        let out = self.on(Event::Granted(lease(7, units, 50)));
        commit_of(out)
    }
}

/// A core whose voucher is not read yet.
fn bare() -> TestCore {
    let settings = Settings::defaults().engine;
    let sizing = SizingParams::from(&settings);
    let shared = Arc::new(VoucherShared::default());
    TestCore::new("V".into(), settings, sizing, shared, T0)
}

/// A tick, then a reserve reach a new core (its first call is a plain read), then that read
/// answers `res`.
fn reserve_then_first_read(res: Result<Option<Voucher>, LedgerError>) -> Out {
    let mut core = bare();
    core.handle(T0, Gate::Open, Event::Tick);
    core.handle(T0, Gate::Open, Event::Reserve(req(1), 1));
    let out: Out = core.commands().collect();
    assert!(
        matches!(out[..], [Command::ReadVoucher { first: true }]),
        "{out:?}"
    );
    core.handle(T0, Gate::Open, Event::VoucherRead { first: true, res });
    core.commands().collect()
}

/// A reserve is a new core's first event: its first call reads and asks for a first lease
/// (the want of one block), answered `res`.
fn opened_by_a_reserve(res: Result<Opened, LedgerError>) -> (TestCore, Out) {
    let mut core = bare();
    core.handle(T0, Gate::Open, Event::Reserve(req(1), 1));
    let out: Out = core.commands().collect();
    assert!(
        matches!(
            out[..],
            [Command::Open {
                amount: 100,
                now: T0,
                ..
            }]
        ),
        "{out:?}"
    );
    core.handle(T0, Gate::Open, Event::Opened(res));
    let out = core.commands().collect();
    (core, out)
}

#[test]
fn a_cold_core_reads_and_takes_its_first_lease_in_one_call() {
    let (_, out) = opened_by_a_reserve(Ok(Opened {
        voucher: Some(voucher(100)),
        grant: Some(lease(7, 4, 96)),
    }));
    // Straight to the batch: no read or grant of its own after the first call.
    let (_, batch) = commit_of(out);
    assert_eq!((batch.lease_id, batch.rows.len()), (7, 1));
}

#[test]
fn a_first_call_that_found_no_voucher_or_granted_nothing_answers_from_the_definition() {
    let (_, out) = opened_by_a_reserve(Ok(Opened {
        voucher: None,
        grant: None,
    }));
    assert_eq!(answers(&out), [(1, "NotFound".to_string())]);
    // The voucher refuses the order (below its minimum): the ledger took no lease for it.
    let mut v = voucher(100);
    v.min_order_amount = 500;
    let (mut core, out) = opened_by_a_reserve(Ok(Opened {
        voucher: Some(v),
        grant: None,
    }));
    let refused = format!("{:?}", EngineError::NotEligible(Ineligible::MinOrderAmount));
    assert_eq!(answers(&out), [(1, refused)]);
    // Its next eligible reserve asks for units as any core does.
    let mut big = req(2);
    big.order_amount = 600;
    core.handle(T0, Gate::Open, Event::Reserve(big, 2));
    let out: Out = core.commands().collect();
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })), "{out:?}");
}

#[test]
fn a_failed_first_call_answers_503_and_stays_to_return_a_lease_it_may_have_taken() {
    let (mut core, out) = opened_by_a_reserve(Err(failed()));
    assert_eq!(answers(&out), [(1, "Unavailable".to_string())]);
    assert!(!has(&out, |c| matches!(c, Command::Stop)), "{out:?}");
    // A tick does not call again (a ledger that is down is not asked every tick)...
    core.handle(T0 + 1, Gate::Open, Event::Tick);
    let out: Out = core.commands().collect();
    assert!(
        !has(&out, |c| matches!(
            c,
            Command::Open { .. } | Command::ReadVoucher { .. }
        )),
        "{out:?}"
    );
    // ...its next reserve does, once the hold is over.
    let later = T0 + DOWN_MS;
    core.handle(later, Gate::Open, Event::Reserve(req(2), 2));
    let out: Out = core.commands().collect();
    assert!(matches!(out[..], [Command::Open { .. }]), "{out:?}");
    core.handle(
        later,
        Gate::Open,
        Event::Opened(Ok(Opened {
            voucher: Some(voucher(100)),
            grant: Some(lease(8, 4, 96)),
        })),
    );
    core.commands().for_each(drop);
    // The listing the failure asked for finds the lease the lost answer granted: it goes back.
    core.handle(T0 + ORPHAN_CHECK_MS, Gate::Open, Event::Tick);
    let out: Out = core.commands().collect();
    assert!(has(&out, |c| matches!(c, Command::FindLeases)), "{out:?}");
    core.handle(
        T0 + ORPHAN_CHECK_MS,
        Gate::Open,
        Event::Found(Ok(vec![5, 8])),
    );
    let out: Out = core.commands().collect();
    assert!(has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 5, .. }
    )));
    assert!(!has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 8, .. }
    )));
}

#[test]
fn a_first_reserve_the_switches_divert_reads_the_definition_alone() {
    let mut core = bare();
    core.handle(T0, Gate::SalesPaused, Event::Reserve(req(1), 1));
    let out: Out = core.commands().collect();
    assert!(
        matches!(out[..], [Command::ReadVoucher { first: true }]),
        "{out:?}"
    );
}

fn commit_of(out: Out) -> (u64, Batch) {
    let mut commits = out.into_iter().filter_map(|c| match c {
        Command::Commit { id, batch } => Some((id, batch)),
        _ => None,
    });
    let first = commits.next().expect("a batch");
    assert!(commits.next().is_none(), "one batch at a time");
    first
}

fn answers(out: &Out) -> Vec<(u32, String)> {
    out.iter()
        .filter_map(|c| match c {
            Command::Answer(
                n,
                Ok(Reserved {
                    replayed: false, ..
                }),
            ) => Some((*n, "201".into())),
            Command::Answer(n, Ok(Reserved { replayed: true, .. })) => Some((*n, "replay".into())),
            Command::Answer(n, Err(e)) => Some((*n, format!("{e:?}"))),
            _ => None,
        })
        .collect()
}

fn has(out: &Out, f: impl Fn(&Command<u32, u32>) -> bool) -> bool {
    out.iter().any(f)
}

#[test]
fn a_reserve_is_answered_only_after_its_batch_commits() {
    let mut rig = Rig::new();
    let (id, batch) = rig.served(1, 10);
    assert_eq!((batch.lease_id, batch.rows.len()), (7, 1));
    assert_eq!(batch.expires_at, T0 + rig.core.settings.reservation_ttl_ms);
    let out = rig.created(id, 1);
    assert_eq!(answers(&out), [(1, "201".to_string())]);
    assert_eq!(rig.core.room(), 9);
}

#[test]
fn reserves_arriving_during_a_commit_form_the_next_batch() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    for n in 2..=4 {
        let out = rig.on(Event::Reserve(req(n), n));
        assert!(!has(&out, |c| matches!(c, Command::Commit { .. })));
    }
    let out = rig.created(id, 1);
    let (_, next) = commit_of(out);
    let orders: Vec<&str> = next.rows.iter().map(|r| r.order_id.as_str()).collect();
    assert_eq!(orders, ["o2", "o3", "o4"]);
}

#[test]
fn rows_that_took_no_unit_give_it_back_to_the_lease() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    let out = rig.on(Event::Committed {
        id,
        res: Ok(vec![RowOutcome::Replayed(reservation(1))]),
    });
    assert_eq!(answers(&out), [(1, "replay".to_string())]);
    assert_eq!(rig.core.room(), 10);
}

#[test]
fn a_fenced_batch_answers_503_and_its_lease_is_served_no_more() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    let out = rig.on(Event::Committed {
        id,
        res: Err(LedgerError::Fenced),
    });
    assert_eq!(answers(&out), [(1, "Unavailable".to_string())]);
    assert_eq!(rig.core.room(), 0);
    // Still demand, and nothing to serve it from: a new lease is asked for.
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
    let out = rig.on(Event::Reserve(req(2), 2));
    assert!(!has(&out, |c| matches!(c, Command::Commit { .. })));
}

#[test]
fn a_failed_commit_answers_503_keeps_the_units_and_holds_briefly() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    let out = rig.on(Event::Committed {
        id,
        res: Err(failed()),
    });
    assert_eq!(answers(&out), [(1, "Unavailable".to_string())]);
    assert_eq!(rig.core.room(), 10);
    let out = rig.on(Event::Reserve(req(2), 2));
    assert_eq!(answers(&out), [(2, "Unavailable".to_string())]);
    rig.now += DOWN_MS;
    let out = rig.on(Event::Reserve(req(3), 3));
    let (_, batch) = commit_of(out);
    assert_eq!(batch.lease_id, 7);
}

#[test]
fn a_ledger_that_answers_fewer_rows_gets_503_for_the_rest() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    rig.on(Event::Reserve(req(2), 2));
    let out = rig.on(Event::Committed {
        id,
        res: Ok(vec![]),
    });
    assert_eq!(answers(&out), [(1, "Unavailable".to_string())]);
}

#[test]
fn an_answer_for_no_batch_in_flight_changes_nothing() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    let out = rig.on(Event::Committed {
        id: id + 1,
        res: Ok(vec![RowOutcome::Created(reservation(9))]),
    });
    assert!(answers(&out).is_empty());
    assert_eq!(rig.core.room(), 9);
}

#[test]
fn units_in_other_leases_keep_reserves_waiting_and_recall_them() {
    let mut rig = Rig::new();
    rig.on(Event::Reserve(req(1), 1));
    let out = rig.on(Event::Granted(empty(5, 3)));
    assert!(has(&out, |c| matches!(c, Command::Publish(Signal::Recall))));
    assert!(answers(&out).is_empty(), "it waits for the recalled units");
    // Asked again soon; still nothing: it waits on, and recalls at most once per repeat.
    rig.now += RECALL_PROBE_MS;
    let out = rig.on(Event::Tick);
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
    let out = rig.on(Event::Granted(empty(5, 3)));
    assert!(!has(&out, |c| matches!(
        c,
        Command::Publish(Signal::Recall)
    )));
    assert!(answers(&out).is_empty());
    // Past its patience the reserve is settled from the ledger's orders.
    rig.now = T0 + rig.core.settings.recall_wait_ms;
    rig.on(Event::Tick);
    let out = rig.on(Event::Granted(empty(5, 3)));
    assert!(has(
        &out,
        |c| matches!(c, Command::Lookup { reqs, .. } if reqs.len() == 1)
    ));
}

#[test]
fn nothing_anywhere_loads_the_winners_and_raises_the_flag_once() {
    let mut rig = Rig::new();
    rig.on(Event::Reserve(req(1), 1));
    let out = rig.on(Event::Granted(empty(0, 7)));
    assert!(has(&out, |c| matches!(c, Command::Lookup { .. })));
    let verdict = out
        .iter()
        .find_map(|c| match c {
            Command::LoadWinners(v) => Some(*v),
            _ => None,
        })
        .expect("the winners are loaded");
    assert_eq!(verdict.ever_reserved, Some(7));
    let out = rig.on(Event::WinnersLoaded(verdict, Ok(vec![("o0".into(), 0)])));
    assert!(rig.shared.is_sold_out());
    assert!(has(&out, |c| matches!(
        c,
        Command::Publish(Signal::SoldOut)
    )));
    assert!(has(&out, |c| matches!(c, Command::RecountSoon)));
    // A second verdict on the same winners announces nothing.
    let out = rig.on(Event::WinnersLoaded(verdict, Ok(vec![("o0".into(), 0)])));
    assert!(!has(&out, |c| matches!(c, Command::Publish(_))));
}

#[test]
fn a_restock_during_the_verdict_keeps_the_flag_down() {
    let mut rig = Rig::new();
    rig.on(Event::Reserve(req(1), 1));
    let out = rig.on(Event::Granted(empty(0, 7)));
    let verdict = out
        .iter()
        .find_map(|c| match c {
            Command::LoadWinners(v) => Some(*v),
            _ => None,
        })
        .expect("the winners are loaded");
    rig.shared.restock();
    let out = rig.on(Event::WinnersLoaded(verdict, Ok(vec![])));
    assert!(!rig.shared.is_sold_out());
    assert!(!has(&out, |c| matches!(c, Command::Publish(_))));
}

#[test]
fn a_grant_answered_after_our_own_batch_landed_gives_no_verdict() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 1);
    rig.on(Event::Reserve(req(2), 2));
    rig.core.granting = None;
    rig.asks_for_units();
    rig.created(id, 1);
    // The grant counted our batch's unit as leased: no hold, it is asked again.
    let out = rig.on(Event::Granted(empty(1, 1)));
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
    assert!(!has(&out, |c| matches!(
        c,
        Command::Publish(Signal::Recall)
    )));
}

#[test]
fn a_recall_returns_idle_leases_but_never_one_a_batch_draws_on() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    rig.on(Event::Reserve(req(2), 2));
    let out = rig.on(Event::Recall);
    assert!(!has(&out, |c| matches!(c, Command::Return { .. })));
    let out = rig.created(id, 1);
    // Reserve 2 still queued: it is served first, then the lease goes.
    let (id, _) = commit_of(out);
    let out = rig.created(id, 2);
    assert!(has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 7, .. }
    )));
    assert_eq!(rig.core.room(), 0);
}

#[test]
fn an_idle_lease_goes_back_and_an_idle_core_stops() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    rig.created(id, 1);
    rig.now += rig.core.settings.lease_idle_timeout_ms - 1;
    let out = rig.on(Event::Tick);
    assert!(!has(&out, |c| matches!(c, Command::Return { .. })));
    rig.now += 1;
    let out = rig.on(Event::Tick);
    assert!(has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 7, .. }
    )));
    assert!(!has(&out, |c| matches!(c, Command::Stop)));
    // Not while the return is unanswered: a failed one is tried again at the next tick.
    rig.now = T0 + rig.core.settings.actor_idle_stop_ms;
    let out = rig.on(Event::Tick);
    assert!(!has(&out, |c| matches!(c, Command::Stop)));
    rig.on(Event::Returned {
        lease_id: 7,
        ok: false,
    });
    let out = rig.on(Event::Tick);
    assert!(has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 7, .. }
    )));
    assert!(!has(&out, |c| matches!(c, Command::Stop)));
    rig.on(Event::Returned {
        lease_id: 7,
        ok: true,
    });
    let out = rig.on(Event::Tick);
    assert!(has(&out, |c| matches!(c, Command::Stop)));
    // Stopped: every waiter is answered, nothing more starts.
    let out = rig.on(Event::Stopped);
    assert!(out.is_empty());
}

#[test]
fn a_lease_is_renewed_at_half_its_ttl_and_one_lost_is_served_no_more() {
    let mut rig = Rig::new();
    rig.served(1, 10);
    let ttl = rig.core.settings.lease_ttl_ms;
    rig.now = T0 + 30_000 - ttl / 2;
    let out = rig.on(Event::Tick);
    assert!(!has(&out, |c| matches!(c, Command::Renew { .. })));
    rig.now += 1;
    let out = rig.on(Event::Tick);
    assert!(has(
        &out,
        |c| matches!(c, Command::Renew { lease_ids, .. } if lease_ids == &[7])
    ));
    rig.on(Event::Renewed(Ok(vec![])));
    assert_eq!(rig.core.room(), 0, "the ledger no longer lists it as ours");
}

#[test]
fn a_renewed_lease_expires_a_ttl_after_the_renewal_was_asked() {
    let mut rig = Rig::with(|s| s.lease_idle_timeout_ms = 60_000);
    let (id, _) = rig.served(1, 10);
    rig.created(id, 1);
    let (ttl, safety) = (
        rig.core.settings.lease_ttl_ms,
        rig.core.settings.lease_safety_ms,
    );
    rig.now = T0 + 30_000 - ttl / 2 + 1;
    let asked = rig.now;
    rig.on(Event::Tick);
    rig.now += 100;
    rig.on(Event::Renewed(Ok(vec![7])));
    assert_eq!(rig.core.leases[0].expires_at, asked + ttl);
    // Served until the renewed expiry's safety margin.
    rig.now = asked + ttl - safety - 1;
    let out = rig.on(Event::Reserve(req(2), 2));
    assert!(has(&out, |c| matches!(c, Command::Commit { .. })));
}

#[test]
fn a_lease_near_its_expiry_is_handed_back_not_served() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    rig.created(id, 1);
    rig.now = T0 + 30_000 - rig.core.settings.lease_safety_ms;
    let out = rig.on(Event::Reserve(req(2), 2));
    assert!(has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 7, .. }
    )));
    assert!(!has(&out, |c| matches!(c, Command::Commit { .. })));
}

#[test]
fn paused_sales_send_new_reserves_to_the_ledgers_orders() {
    let mut rig = Rig::new();
    rig.gate = Gate::SalesPaused;
    let out = rig.on(Event::Reserve(req(1), 1));
    assert!(has(&out, |c| matches!(
        c,
        Command::Lookup {
            gate: Gate::SalesPaused,
            ..
        }
    )));
    assert!(!has(&out, |c| matches!(c, Command::Grant { .. })));
}

#[test]
fn a_full_queue_answers_503_at_once() {
    let mut rig = Rig::with(|s| s.max_pending = 1);
    rig.on(Event::Reserve(req(1), 1));
    let out = rig.on(Event::Reserve(req(2), 2));
    assert_eq!(answers(&out), [(2, "Unavailable".to_string())]);
}

#[test]
fn a_voucher_the_ledger_does_not_have_answers_404() {
    let out = reserve_then_first_read(Ok(None));
    assert_eq!(answers(&out), [(1, "NotFound".to_string())]);
}

#[test]
fn a_drained_core_answers_503_and_keeps_only_leases_in_flight() {
    let mut rig = Rig::new();
    rig.served(1, 10);
    rig.on(Event::Drain);
    let out = rig.on(Event::Reserve(req(2), 2));
    assert_eq!(answers(&out), [(2, "Unavailable".to_string())]);
    let out = rig.on(Event::Warm(5));
    assert!(has(&out, |c| matches!(c, Command::AnswerWarm(5, Err(_)))));
}

#[test]
fn a_warm_up_is_answered_once_a_lease_is_held() {
    let mut rig = Rig::new();
    let out = rig.on(Event::Warm(5));
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
    let out = rig.on(Event::Granted(lease(7, 4, 50)));
    assert!(has(&out, |c| matches!(c, Command::AnswerWarm(5, Ok(())))));
}

#[test]
fn a_failed_grant_is_followed_by_a_listing_and_an_unknown_lease_goes_back() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    rig.created(id, 1);
    rig.grant_fails();
    rig.now += ORPHAN_CHECK_MS - 1;
    let out = rig.on(Event::Tick);
    assert!(!has(&out, |c| matches!(c, Command::FindLeases)));
    rig.now += 1;
    let out = rig.on(Event::Tick);
    assert!(has(&out, |c| matches!(c, Command::FindLeases)));
    // Lease 7 is served here; 99 is the lost grant's.
    let out = rig.on(Event::Found(Ok(vec![7, 99])));
    assert!(has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 99, .. }
    )));
    assert!(!has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 7, .. }
    )));
    // Done: no more listings.
    rig.now += 10 * ORPHAN_CHECK_MS;
    let out = rig.on(Event::Tick);
    assert!(!has(&out, |c| matches!(c, Command::FindLeases)));
}

#[test]
fn a_listing_answered_while_a_grant_is_out_is_settled_when_the_grant_answers() {
    let mut rig = Rig::new();
    rig.grant_fails();
    rig.now += ORPHAN_CHECK_MS;
    rig.on(Event::Tick);
    rig.asks_for_units();
    // 99 may be the grant's that is out: nothing goes back yet.
    let out = rig.on(Event::Found(Ok(vec![98, 99])));
    assert!(!has(&out, |c| matches!(c, Command::Return { .. })));
    // It was: 98 is the lost one.
    let out = rig.on(Event::Granted(lease(99, 5, 10)));
    assert!(has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 98, .. }
    )));
    assert!(!has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 99, .. }
    )));
    rig.now += ORPHAN_CHECK_MS;
    let out = rig.on(Event::Tick);
    assert!(!has(&out, |c| matches!(c, Command::FindLeases)));
}

#[test]
fn a_grant_failing_while_the_listing_is_out_gets_a_listing_of_its_own() {
    let mut rig = Rig::new();
    rig.grant_fails();
    rig.now += ORPHAN_CHECK_MS;
    let out = rig.on(Event::Tick);
    assert!(has(&out, |c| matches!(c, Command::FindLeases)));
    rig.grant_fails();
    rig.on(Event::Found(Ok(vec![])));
    rig.now += ORPHAN_CHECK_MS;
    let out = rig.on(Event::Tick);
    assert!(has(&out, |c| matches!(c, Command::FindLeases)));
}

#[test]
fn a_fenced_lease_is_handed_back() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    let out = rig.on(Event::Committed {
        id,
        res: Err(LedgerError::Fenced),
    });
    assert!(has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 7, .. }
    )));
}

#[test]
fn a_lease_found_lost_stays_unservable_when_its_batch_gives_units_back() {
    let mut rig = Rig::with(|s| s.lease_idle_timeout_ms = 60_000);
    let (id, _) = rig.served(1, 10);
    let ttl = rig.core.settings.lease_ttl_ms;
    rig.now = T0 + 30_000 - ttl / 2 + 1;
    rig.on(Event::Tick);
    rig.on(Event::Renewed(Ok(vec![])));
    rig.on(Event::Committed {
        id,
        res: Ok(vec![RowOutcome::Replayed(reservation(1))]),
    });
    assert_eq!(rig.core.room(), 0);
    let out = rig.on(Event::Reserve(req(2), 2));
    assert!(!has(&out, |c| matches!(c, Command::Commit { .. })));
}

#[test]
fn a_first_read_failing_after_a_reload_does_not_stop_the_core() {
    let mut core = bare();
    core.handle(T0, Gate::Open, Event::Reload(voucher(100)));
    core.handle(T0, Gate::Open, Event::Reserve(req(1), 1));
    let out: Out = core.commands().collect();
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
    core.handle(
        T0,
        Gate::Open,
        Event::VoucherRead {
            first: true,
            res: Err(failed()),
        },
    );
    let out: Out = core.commands().collect();
    assert!(!has(&out, |c| matches!(c, Command::Stop)));
    assert!(answers(&out).is_empty());
}

#[test]
fn a_core_torn_down_unasked_hands_its_waiters_back_and_one_that_stopped_answers_them() {
    // Torn down (its thread ended) with a reserve in a batch and one queued behind it.
    let mut rig = Rig::new();
    rig.served(1, 10);
    rig.on(Event::Reserve(req(2), 2));
    let out = rig.on(Event::Stopped);
    assert!(answers(&out).is_empty(), "{out:?}");
    assert!(has(&out, |c| matches!(c, Command::HandBack(2))));
    // The lease under the unanswered batch goes back too: nobody will serve it.
    assert!(has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 7, .. }
    )));
    // Stopped after asking to: every waiter gets its 503.
    let out = reserve_then_first_read(Err(failed()));
    assert!(!has(&out, |c| matches!(c, Command::HandBack(_))));
    assert_eq!(answers(&out), [(1, "Unavailable".to_string())]);
}

#[test]
fn a_failed_first_read_without_a_definition_stops_and_answers_503() {
    let out = reserve_then_first_read(Err(failed()));
    assert!(has(&out, |c| matches!(c, Command::Stop)));
    assert_eq!(answers(&out), [(1, "Unavailable".to_string())]);
}

#[test]
fn a_clock_that_jumps_back_does_not_stretch_a_hold() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    rig.now += 8000;
    rig.on(Event::Committed {
        id,
        res: Err(failed()),
    });
    // The clock is right again: 8 s back.
    rig.now -= 8000;
    let out = rig.on(Event::Reserve(req(2), 2));
    assert_eq!(answers(&out), [(2, "Unavailable".to_string())]);
    rig.now += DOWN_MS;
    let out = rig.on(Event::Reserve(req(3), 3));
    assert!(has(&out, |c| matches!(c, Command::Commit { .. })));
}

#[test]
fn a_lease_fenced_under_a_second_batch_goes_back_when_that_batch_lands() {
    let mut rig = Rig::with(|s| s.batches_in_flight = 2);
    let (first, _) = rig.served(1, 10);
    let (second, _) = commit_of(rig.on(Event::Reserve(req(2), 2)));
    let out = rig.on(Event::Committed {
        id: first,
        res: Err(LedgerError::Fenced),
    });
    assert!(!has(&out, |c| matches!(c, Command::Return { .. })));
    let out = rig.created(second, 2);
    assert!(has(&out, |c| matches!(
        c,
        Command::Return { lease_id: 7, .. }
    )));
}

#[test]
fn reserves_queued_before_a_reload_gave_the_first_definition_are_checked() {
    let mut core = bare();
    let mut small = req(1);
    small.order_amount = 1;
    core.handle(T0, Gate::Open, Event::Reserve(small, 1));
    let mut v = voucher(100);
    v.min_order_amount = 50;
    core.handle(T0, Gate::Open, Event::Reload(v));
    let out: Out = core.commands().collect();
    assert_eq!(
        answers(&out),
        [(
            1,
            format!("{:?}", EngineError::NotEligible(Ineligible::MinOrderAmount))
        )]
    );
}

#[test]
fn reserves_a_switch_diverted_go_back_to_units_when_it_is_off_before_their_lookup() {
    let mut rig = Rig::new();
    rig.gate = Gate::SalesPaused;
    let out = rig.on(Event::Reserve(req(1), 1));
    assert!(has(&out, |c| matches!(c, Command::Lookup { .. })));
    // A second one waits for the next lookup; sales resume meanwhile.
    rig.on(Event::Reserve(req(2), 2));
    rig.gate = Gate::Open;
    let out = rig.on(Event::LookedUp(Ok(vec![Err(EngineError::NotEligible(
        Ineligible::Paused,
    ))])));
    assert!(!has(&out, |c| matches!(c, Command::Lookup { .. })));
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
}

#[test]
fn an_empty_handed_core_probes_the_ledger_before_its_flag_is_up() {
    let mut rig = Rig::new();
    rig.on(Event::Reserve(req(1), 1));
    rig.on(Event::Granted(empty(0, 7)));
    assert!(!rig.shared.is_sold_out(), "the winners are still loading");
    rig.now += rig.core.settings.soldout_probe_ms;
    let out = rig.on(Event::Tick);
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
}

#[test]
fn a_sold_out_core_probes_while_its_voucher_is_asked_for_and_not_after() {
    let mut rig = Rig::new();
    rig.on(Event::Reserve(req(1), 1));
    rig.on(Event::Granted(empty(0, 7)));
    let probe = rig.core.settings.soldout_probe_ms;
    // Nobody asks here, but the frontend answers from the flag: still traffic.
    for _ in 0..5 {
        rig.now += probe;
        rig.shared.count_short_circuit(rig.now);
        let out = rig.on(Event::Tick);
        assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
        rig.on(Event::Granted(empty(0, 7)));
    }
    // Quiet: probes stop once three intervals passed without a request.
    let mut probes = 0;
    for _ in 0..10 {
        rig.now += probe;
        let out = rig.on(Event::Tick);
        if has(&out, |c| matches!(c, Command::Grant { .. })) {
            probes += 1;
            rig.on(Event::Granted(empty(0, 7)));
        }
    }
    assert_eq!(probes, 2, "probes after the last request");
    // A request comes back: the ledger is asked again.
    let mut out = rig.on(Event::Reserve(req(2), 2));
    rig.now += probe;
    out.extend(rig.on(Event::Tick));
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })), "{out:?}");
}

#[test]
fn a_drained_core_keeps_only_the_lease_a_batch_is_on() {
    let mut rig = Rig::new();
    rig.served(1, 10);
    rig.asks_for_units();
    rig.on(Event::Granted(lease(8, 5, 0)));
    assert_eq!(rig.core.room(), 9 + 5);
    rig.on(Event::Drain);
    assert_eq!(
        rig.core.room(),
        9,
        "lease 7 (batch in flight) stays, 8 goes"
    );
}

#[test]
fn the_pre_start_cap_is_a_share_of_what_the_first_grant_saw() {
    let mut rig = Rig::new();
    let mut later = voucher(100);
    later.starts_at = T0 + 60_000;
    rig.on(Event::Reload(later));
    rig.on(Event::Warm(5));
    rig.on(Event::Granted(lease(7, 4, 96)));
    let p = rig.core.sizing;
    let cap = (100 / p.prestart_divisor).max(p.min_block).min(p.max_block);
    assert_eq!(rig.core.prestart_cap, Some(cap));
}

#[test]
fn a_batch_landing_with_no_room_left_does_not_lift_a_down_hold() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 1);
    // The lease is used up; the next grant fails: hold Down.
    rig.grant_fails();
    rig.created(id, 1);
    assert_eq!(rig.core.room(), 0);
    let out = rig.on(Event::Reserve(req(2), 2));
    assert_eq!(answers(&out), [(2, "Unavailable".to_string())]);
    assert!(!has(&out, |c| matches!(c, Command::Grant { .. })));
}

#[test]
fn sold_out_elsewhere_asks_the_ledger_only_when_this_node_has_no_flag() {
    let mut rig = Rig::new();
    rig.shared
        .set_sold_out(rig.shared.restock_epoch(), vec![], 1, 16);
    let out = rig.on(Event::SoldOutElsewhere);
    assert!(!has(&out, |c| matches!(c, Command::Grant { .. })));
    rig.shared.restock();
    let out = rig.on(Event::SoldOutElsewhere);
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
}

#[test]
fn a_clock_that_jumps_back_does_not_postpone_the_sold_out_probe() {
    let mut rig = Rig::new();
    let probe = rig.core.settings.soldout_probe_ms;
    rig.shared
        .set_sold_out(rig.shared.restock_epoch(), vec![], 1, 16);
    // Under a clock 8 s ahead, a probe sets the next one 8 s too far. (The voucher is
    // flooded: the frontend answers from its flag all along.)
    rig.now += 8000;
    rig.shared.count_short_circuit(rig.now);
    let out = rig.on(Event::Tick);
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
    rig.on(Event::Granted(empty(0, 0)));
    rig.now -= 8000;
    rig.on(Event::Tick);
    rig.now += probe;
    let out = rig.on(Event::Tick);
    assert!(has(&out, |c| matches!(c, Command::Grant { .. })));
}

#[test]
fn only_a_warmed_voucher_counts_pre_start_requests_as_demand() {
    let mut rig = Rig::new();
    let mut later = voucher(100);
    later.starts_at = T0 + 60_000;
    rig.on(Event::Reload(later));
    for n in 1..=5 {
        let out = rig.on(Event::Reserve(req(n), n));
        assert_eq!(answers(&out).len(), 1, "422 NOT_STARTED at once");
    }
    rig.now += 1000;
    assert_eq!(rig.core.rate.per_sec(rig.now), 0.0);
    rig.on(Event::Warm(9));
    for n in 6..=10 {
        rig.on(Event::Reserve(req(n), n));
    }
    rig.now += 1000;
    assert!(rig.core.rate.per_sec(rig.now) > 0.0);
}

/// Ticks the rig every [`TICK_MS`] until `until`, as the adapter does when the core asks; the
/// commands the ticks gave.
fn tick_until(rig: &mut Rig, until: Millis) -> Out {
    let mut out = Vec::new();
    while rig.core.next_tick_at() <= until {
        rig.now = rig.core.next_tick_at().max(rig.now);
        out.extend(rig.on(Event::Tick));
    }
    rig.now = until;
    out
}

#[test]
fn an_idle_core_asks_for_no_tick_but_its_stop_and_reads_nothing() {
    let mut rig = Rig::new();
    let stop = rig.core.settings.actor_idle_stop_ms;
    // Asked for lately, nothing to do: ticks every second, but nobody asked for it since its
    // definition was read, so it reads nothing again (a flood of first reserves on cold
    // vouchers reads each definition once).
    assert_eq!(rig.core.next_tick_at(), T0 + IDLE_TICK_MS);
    let early = tick_until(&mut rig, T0 + 10_000);
    assert!(
        !early
            .iter()
            .any(|c| matches!(c, Command::ReadVoucher { .. })),
        "{early:?}"
    );
    // Quiet: its next tick is when it would stop, and meanwhile it reads nothing.
    assert_eq!(rig.core.next_tick_at(), T0 + stop);
    let quiet = tick_until(&mut rig, T0 + stop - 1);
    assert!(quiet.is_empty(), "{quiet:?}");
    // A reserve makes it busy: the next tick is due at once and reads the definition again.
    rig.on(Event::Reserve(req(1), 1));
    assert!(rig.core.next_tick_at() <= rig.now);
    let out = rig.on(Event::Tick);
    assert!(
        out.iter().any(|c| matches!(c, Command::ReadVoucher { .. })),
        "{out:?}"
    );
}

#[test]
fn an_idle_core_stops_at_the_tick_it_asked_for() {
    let mut rig = Rig::new();
    let stop = rig.core.settings.actor_idle_stop_ms;
    let out = tick_until(&mut rig, T0 + stop);
    assert!(out.iter().any(|c| matches!(c, Command::Stop)), "{out:?}");
}

#[test]
fn a_core_with_work_ticks_every_tick_ms_and_one_holding_units_every_second() {
    let mut rig = Rig::new();
    // A reserve waits for its grant: every TICK_MS.
    rig.on(Event::Reserve(req(1), 1));
    assert_eq!(rig.core.next_tick_at(), T0 + TICK_MS);
    let out = rig.on(Event::Granted(lease(7, 10, 50)));
    let (id, _) = commit_of(out);
    rig.created(id, 1);
    // Holding units with nothing to do: every second.
    assert_eq!(rig.core.next_tick_at(), T0 + IDLE_TICK_MS);
}

#[test]
fn a_sold_out_or_holding_core_keeps_ticking() {
    let mut rig = Rig::new();
    let (id, _) = rig.served(1, 10);
    rig.created(id, 1);
    // Holding a lease: every TICK_MS, however long nobody asks.
    rig.now = T0 + 60_000;
    rig.on(Event::Tick);
    assert_eq!(rig.core.next_tick_at(), rig.now + TICK_MS);
    // Sold out here (the frontend answers from its flag): every TICK_MS too.
    let mut rig = Rig::new();
    rig.shared
        .set_sold_out(rig.shared.restock_epoch(), vec![], 1, 16);
    rig.now = T0 + 60_000;
    rig.on(Event::Tick);
    assert_eq!(rig.core.next_tick_at(), rig.now + TICK_MS);
}
