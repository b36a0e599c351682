-- A lease grant in one round trip (DESIGN §2, the lease protocol). Applied at every start (it is
-- `CREATE OR REPLACE`), like the merged commit; a change of it takes a new name (`_v3`), so that
-- a node of this build restarting during a rollout never puts its version back over a newer one.
--
-- The voucher row is locked first; every later statement of the function takes a new snapshot,
-- so the active leases it sums include every grant committed before the lock was had. Then
-- `min(want, free)` units (at least one asked for) move from `free` into a new ACTIVE lease. The
-- deferred trigger `leases_grant_within_total` (migration 9) checks DESIGN §3's last line when
-- the call's transaction commits.
--
-- No row: no such voucher. Otherwise one row: `free` before the grant, the units granted (0: the
-- ledger is empty), the unused units of the active leases before this one, the new lease's id
-- (NULL when nothing was granted) and, only when nothing was granted, every unit ever consumed
-- from a lease: the voucher's `closed_consumed` (migration 10) plus its active leases', so that
-- a sold-out probe reads the active leases only, however many the sale has turned over.
CREATE OR REPLACE FUNCTION vouchers_grant_v2(
    p_code    TEXT,
    p_node    TEXT,
    p_want    BIGINT,
    p_now     BIGINT,
    p_expires BIGINT
) RETURNS TABLE (
    out_free   BIGINT,
    out_units  BIGINT,
    out_unused BIGINT,
    out_lease  BIGINT,
    out_ever   BIGINT
)
LANGUAGE plpgsql
-- Plans made once per connection, not at every call (migration 16 says why and what it saved),
-- kept off sequential scans: every lookup here has its index. The active leases' state is a
-- parameter of the plan, not a literal, so that their sums use `leases_by_voucher_state`.
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_free  BIGINT;
    v_units BIGINT;
    c_active CONSTANT TEXT := 'ACTIVE';
BEGIN
    SELECT free INTO v_free FROM vouchers WHERE code = p_code FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_units := LEAST(GREATEST(p_want, 1), v_free);
    IF v_units > 0 THEN
        UPDATE vouchers SET free = free - v_units WHERE code = p_code;
        RETURN QUERY
        WITH unused AS (SELECT COALESCE(SUM(granted - consumed), 0)::BIGINT AS n
                        FROM leases WHERE voucher_code = p_code AND state = c_active)
        INSERT INTO leases (voucher_code, node_id, granted, consumed, state, granted_at, expires_at)
        SELECT p_code, p_node, v_units, 0, 'ACTIVE', p_now, p_expires FROM unused
        RETURNING v_free, v_units, (SELECT n FROM unused), id, NULL::BIGINT;
    ELSE
        RETURN QUERY
        SELECT v_free, 0::BIGINT, COALESCE(SUM(l.granted - l.consumed), 0)::BIGINT,
               NULL::BIGINT,
               ((SELECT v.closed_consumed FROM vouchers v WHERE v.code = p_code)
                + COALESCE(SUM(l.consumed), 0))::BIGINT
        FROM leases l WHERE l.voucher_code = p_code AND l.state = c_active;
    END IF;
END
$$;

-- Version 1, called by nodes of the build before this one while a rollout replaces them: the
-- same answers (it summed every lease for the last column; `closed_consumed` is that sum of the
-- closed ones, kept by a trigger whichever build closes them).
CREATE OR REPLACE FUNCTION vouchers_grant_v1(
    p_code    TEXT,
    p_node    TEXT,
    p_want    BIGINT,
    p_now     BIGINT,
    p_expires BIGINT
) RETURNS TABLE (
    out_free   BIGINT,
    out_units  BIGINT,
    out_unused BIGINT,
    out_lease  BIGINT,
    out_ever   BIGINT
)
LANGUAGE sql AS $$
    SELECT * FROM vouchers_grant_v2(p_code, p_node, p_want, p_now, p_expires)
$$;

-- Version 3: version 2 for a holder that is live here. An incarnation (`name#number`) whose row
-- is gone (a reaper forgot it while it was silent) or retired (`beat_at = 0`) is refused with
-- SQLSTATE VH001 and takes nothing: a lease it took and then crashed with would be listed by
-- nobody's beat (no row), and would wait for its TTL. Its next beat records it again. The row
-- is held FOR KEY SHARE until the grant commits: a reaper's delete of it (FOR UPDATE SKIP
-- LOCKED) skips it meanwhile, and one that got there first makes this grant wait and then find
-- no row; a beat's update does not wait. A holder without a number (a build's from before
-- incarnations) is not checked.
CREATE OR REPLACE FUNCTION vouchers_grant_v3(
    p_code    TEXT,
    p_node    TEXT,
    p_want    BIGINT,
    p_now     BIGINT,
    p_expires BIGINT
) RETURNS TABLE (
    out_free   BIGINT,
    out_units  BIGINT,
    out_unused BIGINT,
    out_lease  BIGINT,
    out_ever   BIGINT
)
LANGUAGE plpgsql
-- As version 2: one generic plan per connection. The settings hold for everything the call
-- runs, the foreign-key check of the new lease's voucher included.
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    IF strpos(p_node, '#') > 0 THEN
        PERFORM 1 FROM nodes WHERE holder = p_node AND beat_at <> 0 FOR KEY SHARE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'lease holder % is not live on this ledger', p_node
                USING ERRCODE = 'VH001';
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM vouchers_grant_v2(p_code, p_node, p_want, p_now, p_expires);
END
$$;
