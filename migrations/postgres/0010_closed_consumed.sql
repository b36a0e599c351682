-- The units closed leases consumed, kept on the voucher row (`closed_consumed`), so that the
-- grant check of migration 9 reads the voucher's active leases only. It summed every lease the
-- voucher ever had, under the voucher's row lock: a lease turns over every second or so per
-- hot voucher and node, so over a long campaign each grant grew slower and held the lock longer
-- (measured: 1.3 ms for a grant and its return on a fresh voucher, 5 ms beside 20,000 closed
-- leases).
--
-- A lease's `consumed` no longer changes once it is closed (the merged commit fences on
-- state = 'ACTIVE' under the lease's row lock). The copy is kept by a trigger on the lease's
-- state, not by the statement that closes leases, so that every close counts: a node of the
-- build before this one, still running while a rolling restart migrates the ledger, closes
-- leases with its own statement. The reconciliation (`counters`) compares the copy with the
-- leases.
ALTER TABLE vouchers ADD COLUMN IF NOT EXISTS closed_consumed BIGINT NOT NULL DEFAULT 0
    CHECK (closed_consumed >= 0);

-- The backfill reads every lease ever granted (it is the table that grew): no statement
-- deadline for it, which a long-lived ledger could pass. Lock waits keep theirs.
SET LOCAL statement_timeout = 0;

UPDATE vouchers v SET closed_consumed = c.n
FROM (SELECT voucher_code, SUM(consumed) AS n FROM leases
      WHERE state <> 'ACTIVE' GROUP BY voucher_code) c
WHERE v.code = c.voucher_code;

CREATE OR REPLACE FUNCTION vouchers_grant_within_total() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_total    BIGINT;
    v_free     BIGINT;
    v_released BIGINT;
    v_won      BIGINT;
    v_unused   BIGINT;
BEGIN
    -- One statement, one snapshot: the voucher's row (locked by the grant until it commits, so
    -- no lease of it closes meanwhile) and its active leases, by the partial index.
    SELECT v.total_limit, v.free, v.released,
           v.closed_consumed + COALESCE(SUM(l.consumed), 0),
           COALESCE(SUM(l.granted - l.consumed), 0)
    INTO v_total, v_free, v_released, v_won, v_unused
    FROM vouchers v
    LEFT JOIN leases l ON l.voucher_code = v.code AND l.state = 'ACTIVE'
    WHERE v.code = NEW.voucher_code
    GROUP BY v.code;
    IF v_free + v_unused + v_won - v_released > v_total THEN
        RAISE EXCEPTION 'grant of % units on % passes total_limit % (free %, leased unused %, reserved + confirmed %)',
            NEW.granted, NEW.voucher_code, v_total, v_free, v_unused, v_won - v_released
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;

-- What a lease consumed moves to its voucher's `closed_consumed` as it closes (and back, should a
-- closed lease ever be made ACTIVE again by hand). Every close locks the voucher's row before its
-- leases, so this update waits for nothing.
CREATE OR REPLACE FUNCTION vouchers_lease_closed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE vouchers
    SET closed_consumed = closed_consumed
        + CASE WHEN NEW.state <> 'ACTIVE' THEN NEW.consumed ELSE -OLD.consumed END
    WHERE code = NEW.voucher_code;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS leases_closed ON leases;
CREATE TRIGGER leases_closed AFTER UPDATE OF state ON leases
    FOR EACH ROW WHEN ((OLD.state = 'ACTIVE') <> (NEW.state = 'ACTIVE'))
    EXECUTE FUNCTION vouchers_lease_closed();
