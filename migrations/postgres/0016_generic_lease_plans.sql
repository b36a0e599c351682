-- The lease functions planned once per connection (grant.sql, and the two lease triggers below):
-- the node's sessions plan every statement anew (`plan_cache_mode = force_custom_plan`,
-- src/ledger/postgres/open.rs), which for a grant cost about as much as running it. Measured
-- through the engine (one node, 100 vouchers that never sell out, this project's 2-core machine,
-- `pg_stat_statements` with `track_planning`): ~320 µs of planning per grant over its seven
-- statements (the check below alone 120) at ~300 grants a second; `pgbench` of the grant alone,
-- sessions set as the node's: 617-677 µs of PostgreSQL CPU per grant before, 340-407 after.
--
-- A generic plan is made once, perhaps while `leases` is empty and analyzed so, and kept. With the
-- literal `state = 'ACTIVE'` the planner may then sum a voucher's active leases by a whole scan
-- of another partial index of active leases (by holder, by expiry: every voucher's), which it
-- did for one of a grant's two sums in the test
-- `postgres_grant_and_settle_plans_keep_their_indexes_on_tables_analyzed_empty`. So the sums
-- compare the state with a parameter, which proves no partial index, and read the index
-- `leases_by_voucher_state (voucher_code, state)` by equality on both columns. That index is
-- built after this migration's transaction, concurrently (src/ledger/postgres/open.rs,
-- `BUILT_AFTER_MIGRATION`): built here it would block every lease write of the nodes still
-- serving for the whole build (about a second per million leases). Meanwhile the sums read
-- `leases_by_voucher` (migration 3), which it replaces and which is dropped once it is built.

-- DESIGN §3's last line at a grant's commit (migrations 9 and 10), its active leases read by
-- `leases_by_voucher_state`. One statement, one snapshot, as before: the voucher's row (locked
-- by the grant until it commits, so no lease of it closes meanwhile) and its active leases.
CREATE OR REPLACE FUNCTION vouchers_grant_within_total() RETURNS trigger
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_total    BIGINT;
    v_free     BIGINT;
    v_released BIGINT;
    v_won      BIGINT;
    v_unused   BIGINT;
    c_active   CONSTANT TEXT := 'ACTIVE';
BEGIN
    SELECT v.total_limit, v.free, v.released,
           v.closed_consumed + COALESCE(a.consumed, 0), COALESCE(a.unused, 0)
    INTO v_total, v_free, v_released, v_won, v_unused
    FROM vouchers v,
         LATERAL (SELECT SUM(l.consumed) AS consumed, SUM(l.granted - l.consumed) AS unused
                  FROM leases l
                  WHERE l.voucher_code = NEW.voucher_code AND l.state = c_active) a
    WHERE v.code = NEW.voucher_code;
    IF v_free + v_unused + v_won - v_released > v_total THEN
        RAISE EXCEPTION 'grant of % units on % passes total_limit % (free %, leased unused %, reserved + confirmed %)',
            NEW.granted, NEW.voucher_code, v_total, v_free, v_unused, v_won - v_released
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;

-- A close's update of its voucher's `closed_consumed` (migration 10): one lookup by key.
ALTER FUNCTION vouchers_lease_closed()
    SET plan_cache_mode = force_generic_plan SET enable_seqscan = off;
