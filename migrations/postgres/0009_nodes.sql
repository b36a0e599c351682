-- Liveness of lease holders (DESIGN §3, "Reap"). Each process is an incarnation of its node name
-- and holds leases as `name#incarnation` (`leases.node_id`). It beats every few hundred
-- milliseconds; `beat_at` is on the ledger's clock, so a node whose own clock is off cannot make
-- a live holder look dead. The leases of an incarnation that stopped beating are reaped at once.
-- A lease whose holder has no row here (a build from before incarnations) is left to its TTL.
CREATE TABLE IF NOT EXISTS node_names (
    name             TEXT PRIMARY KEY,
    -- The last incarnation number handed out under this name: numbers are never reused.
    last_incarnation BIGINT NOT NULL CHECK (last_incarnation >= 1)
);

CREATE TABLE IF NOT EXISTS nodes (
    holder      TEXT PRIMARY KEY,
    name        TEXT   NOT NULL,
    incarnation BIGINT NOT NULL,
    started_at  BIGINT NOT NULL,
    beat_at     BIGINT NOT NULL,
    -- Since when this holder has beaten without a gap longer than its dead_after: a holder judges
    -- others only once its own streak is that long, so after an outage that silenced everyone
    -- nobody is taken for dead before it had the time to beat again.
    streak_from BIGINT NOT NULL,
    -- This holder's own limit (node.dead_after_ms): each holder is judged by its own setting.
    dead_after  BIGINT NOT NULL CHECK (dead_after > 0)
);

CREATE INDEX IF NOT EXISTS leases_active_by_node ON leases (node_id) WHERE state = 'ACTIVE';

-- DESIGN §3's last line, `reserved + confirmed <= total_limit`. On PostgreSQL `reserved` is not a
-- column (batches of several nodes must not queue behind the voucher row), so a CHECK cannot say
-- it. A grant is the one step that hands units out, and it holds the voucher row: there, no unit
-- may be counted twice: free + unused in active leases + (every lease's consumed - released)
-- stays within total_limit. Runs once per lease granted, never per reservation.
CREATE OR REPLACE FUNCTION vouchers_grant_within_total() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_total    BIGINT;
    v_free     BIGINT;
    v_released BIGINT;
    v_won      BIGINT;
    v_unused   BIGINT;
BEGIN
    SELECT total_limit, free, released INTO v_total, v_free, v_released
    FROM vouchers WHERE code = NEW.voucher_code;
    SELECT COALESCE(SUM(consumed), 0),
           COALESCE(SUM(granted - consumed) FILTER (WHERE state = 'ACTIVE'), 0)
    INTO v_won, v_unused
    FROM leases WHERE voucher_code = NEW.voucher_code;
    IF v_free + v_unused + v_won - v_released > v_total THEN
        RAISE EXCEPTION 'grant of % units on % passes total_limit % (free %, leased unused %, reserved + confirmed %)',
            NEW.granted, NEW.voucher_code, v_total, v_free, v_unused, v_won - v_released
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS leases_grant_within_total ON leases;
CREATE CONSTRAINT TRIGGER leases_grant_within_total AFTER INSERT ON leases
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION vouchers_grant_within_total();
