-- Confirm and release of one reservation, and the expiry of due ones (DESIGN §3), each one call
-- and its own transaction, so no lock is held across a network round trip.
--
-- Locks, in this order (the merged commit's order, and the change feed's head last, as every
-- transaction takes it): the reservation rows (their status guards "exactly once"), the voucher
-- rows in code order, the feed's head. A customer's usage is counted from the rows (migration
-- 15), so a release or an expiry lowers it by writing the row's status, nothing else. Each
-- reservation row is written once, with its new status and its feed number. Re-applied on every
-- start (CREATE OR REPLACE).

CREATE OR REPLACE FUNCTION vouchers_settle(
    p_code    TEXT,
    p_order   TEXT,
    p_now     BIGINT,
    p_confirm BOOLEAN  -- true: RESERVED -> CONFIRMED (before expiry); false: -> RELEASED
) RETURNS TABLE (
    out_order    TEXT,
    out_voucher  TEXT,
    out_customer BIGINT,
    out_discount BIGINT,
    out_status   TEXT,
    out_expires  BIGINT
)
LANGUAGE plpgsql
-- One generic plan per connection (the node's sessions would otherwise plan each of these
-- statements at every confirm and release; see migration 16), kept off sequential scans: every
-- statement is a lookup by primary key. The row is found by its order id alone and judged here:
-- a plan made while the table was empty and analyzed so took the voucher and status of the
-- lookup for the index `reservations_by_customer` (voucher, customer, status) and filtered every
-- reserved row of the voucher for the order id. Under READ COMMITTED the row locked is the
-- newest version, so judging it after the lock is what the old WHERE did on it.
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_code    TEXT;
    v_status  TEXT;
    v_expires BIGINT;
    v_seq     BIGINT;
BEGIN
    SELECT r.voucher_code, r.status, r.expires_at INTO v_code, v_status, v_expires
    FROM reservations r WHERE r.order_id = p_order
    FOR UPDATE;
    -- COALESCE: a NULL argument matches nothing, as it did in the WHERE.
    IF NOT FOUND OR NOT COALESCE(v_code = p_code AND v_status = 'RESERVED'
                                 AND (NOT p_confirm OR v_expires > p_now), false) THEN
        RETURN;
    END IF;
    IF p_confirm THEN
        UPDATE vouchers SET confirmed = confirmed + 1 WHERE code = p_code;
    ELSE
        UPDATE vouchers SET free = free + 1, released = released + 1 WHERE code = p_code;
    END IF;
    UPDATE feed_head SET last = last + 1 WHERE id = 1 RETURNING last INTO v_seq;
    IF v_seq IS NULL THEN
        RAISE EXCEPTION 'the change feed''s head row is missing';
    END IF;
    RETURN QUERY
    UPDATE reservations r
    SET status = CASE WHEN p_confirm THEN 'CONFIRMED' ELSE 'RELEASED' END,
        updated_at = p_now, settled_seq = v_seq
    WHERE r.order_id = p_order
    RETURNING r.order_id, r.voucher_code, r.customer_id, r.discount_amount, r.status, r.expires_at;
END
$$;

-- Releases up to p_limit unconfirmed reservations whose expiry passed; returns the units given
-- back per voucher. SKIP LOCKED: sweepers on several nodes take disjoint rows.
CREATE OR REPLACE FUNCTION vouchers_expire(p_now BIGINT, p_limit BIGINT)
RETURNS TABLE (out_voucher TEXT, out_units BIGINT)
LANGUAGE plpgsql
AS $$
DECLARE
    v_orders TEXT[];
    v_base   BIGINT;
BEGIN
    SELECT array_agg(d.order_id ORDER BY d.order_id) INTO v_orders FROM (
        SELECT r.order_id FROM reservations r
        WHERE r.status = 'RESERVED' AND r.expires_at <= p_now
        ORDER BY r.expires_at LIMIT p_limit
        FOR UPDATE SKIP LOCKED) d;
    IF v_orders IS NULL THEN
        RETURN;
    END IF;
    PERFORM 1 FROM vouchers v
    WHERE v.code IN (SELECT r.voucher_code FROM reservations r WHERE r.order_id = ANY (v_orders))
    ORDER BY v.code FOR UPDATE;
    UPDATE vouchers v SET free = v.free + c.n, released = v.released + c.n
    FROM (SELECT r.voucher_code AS code, count(*) AS n FROM reservations r
          WHERE r.order_id = ANY (v_orders) GROUP BY r.voucher_code) c
    WHERE v.code = c.code;
    UPDATE feed_head SET last = last + cardinality(v_orders) WHERE id = 1
    RETURNING last - cardinality(v_orders) INTO v_base;
    IF v_base IS NULL THEN
        RAISE EXCEPTION 'the change feed''s head row is missing';
    END IF;
    UPDATE reservations r
    SET status = 'RELEASED', updated_at = p_now, settled_seq = v_base + t.i, expired = true
    FROM unnest(v_orders) WITH ORDINALITY AS t (o, i)
    WHERE r.order_id = t.o;
    RETURN QUERY
    SELECT r.voucher_code, count(*) FROM reservations r
    WHERE r.order_id = ANY (v_orders) GROUP BY r.voucher_code;
END
$$;
